"""Speculation's spare buffers: one pool of host buffers, shared by the buckets of a step and reused step after step,
under a cap (``OffloadOptimizer(speculation_memory=...)``). The row it makes in the host-RAM estimate keeps its old
name, ``undo``.

A speculated bucket's kernel reads the bucket's state and writes the next state into spare buffers *leased* from
this pool: a master, each state buffer and its 8-bit scales, and the low-precision output of bf16/fp16
parameters, each the exact size and pinning of the bucket's own. The commit trades memory between the bucket's
buffers and the lease's (:func:`~zero_offload._compat.take_memory`: the bucket's buffers, and every view of them
that ``opt.state`` or a checkpoint holds, now read the new state; the lease holds the old one); a rollback changes
nothing of the bucket. Either way the lease comes back to the pool, its buffers free for the next lease of their
size. Those bytes are needed from the speculation to ``step()`` only, and only for the buckets the worker reaches
during backward (on the 1.3B preset about a third of them), so a spare per bucket kept for the optimizer's life
would hold up to the whole state again for nothing.

**The cap.** ``limit`` bounds the bytes the pool holds (allocated, leased or free). Given: that many bytes. Not
given (None, the default): learned, so that no more is allocated than the worker has used. The first step that
speculates measures the window: it is bounded by the host's room only, and as allocation is lazy (a buffer is made
only when no free one of its size is held), it allocates what the worker reaches in one backward. From then on the
cap is the largest of the last :data:`RECENT_STEPS` steps' demand (the most bytes leased at once in a step), plus one
bucket of slack (the largest lease asked for so far), which lets the pool grow. A step that ran out of room demanded
more than it got: its demand counts as twice what it leased plus the bucket refused, so a window that widens (or
comes back after steps that did not speculate, e.g. clipped ones) is found again in a few steps, not one bucket per
step. Between steps, free buffers beyond the cap are released.

Whatever the cap, a buffer is not made when the host has less than twice its size available (``MemAvailable``,
capped by the cgroup's limit and ``ulimit -v``): an optional speedup must never be what brings in the OOM killer.

**Growth off the critical path.** Only the first step that speculates makes buffers where the worker leases them
(it measures the window with the worker's real pace). From then on a lease that would have to make a buffer is
refused (``"undo pool growing"``, or ``"undo pool full"`` past the cap): its bucket is updated at ``step()`` as
without speculation, and its pieces are queued. When the step ends, one thread of the pool's own makes the queued
pieces that fit the cap that follows, while the next forward runs; the next step's leases find them free. Making
a bucket's spares on a GPU host (about 0.3 GB page-locked with ``cudaHostRegister`` for the 1.3B preset) took
200-250 ms on the worker, and ``step()`` waited for it: one stall a step while the window widened (H200 lease,
docs/speculation.md). A growing refusal counts in the step's demand as the bucket it would have leased (a full
one as above), so the window widens by about two buckets a step.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from zero_offload.host_memory import HostMemoryEstimate, available_host_bytes, empty_host

__all__ = ["Lease", "UndoPool", "RECENT_STEPS"]

logger = logging.getLogger("zero_offload")

# Steps over which the learned cap remembers the largest demand (a run that stops speculating, e.g. clipping every
# step, gives the memory back after this many steps).
RECENT_STEPS = 10
_ALIGN = 64  # bytes: the unit the pool counts in (every bucket buffer is a multiple of it)

# (name, elements, dtype, pinned) of one buffer a lease holds.
Piece = Tuple[str, int, torch.dtype, bool]
Key = Tuple[int, torch.dtype, bool]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(key: Key) -> int:
    return _aligned(key[0] * key[1].itemsize)


class Lease:
    """The buffers one speculation holds (``buffers``: name -> flat tensor), ``nbytes`` of the pool's."""

    __slots__ = ("buffers", "nbytes", "keys")

    def __init__(self, buffers: Dict[str, torch.Tensor], nbytes: int, keys: Dict[str, Key]):
        self.buffers, self.nbytes, self.keys = buffers, nbytes, keys


class UndoPool:
    """The spare buffers of one optimizer (see the module docstring). Leases are taken by the speculation worker
    and given back by ``step()`` (or by a hook that rolls one back), hence the lock.

    Args:
        limit (int, optional): the most bytes the pool may hold; None: learned. Default: None.
    """

    def __init__(self, limit: Optional[int] = None):
        self.fixed = limit
        self._free: Dict[Key, List[torch.Tensor]] = collections.defaultdict(list)
        self._lock = threading.Lock()
        self._held = 0  # bytes of every buffer made and not released (leased or free)
        self._pinned = 0
        self._in_use = 0  # bytes leased and not given back
        self._leases = 0
        self._step_peak = 0  # the most bytes leased at once this step
        self._refused = 0  # bytes of the first lease refused for lack of room this step (0: none)
        self._largest = 0  # the largest lease asked for so far
        self._recent: collections.deque = collections.deque(maxlen=RECENT_STEPS)
        self._asked = False  # a lease was asked for this step
        self._growing = 0  # bytes of the first lease refused this step because its buffers were not made yet
        self._wanted: List[List[Key]] = []  # what each lease refused so lacked, for the grower
        self._grower: Optional[threading.Thread] = None

    # -- what it holds ---------------------------------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """Bytes the pool holds now (leased or free)."""
        return self._held

    @property
    def pinned_bytes(self) -> int:
        return self._pinned

    def limit(self, asking: int = 0) -> int:
        """The most bytes the pool may hold now (``asking``: the size of the lease being asked for, one bucket of
        slack when the cap is learned)."""
        if self.fixed is not None:
            return self.fixed
        if not self._recent:
            return sys.maxsize  # the first step that speculates: the window is being measured
        return max(self._recent) + max(self._largest, asking)

    def estimate(self) -> HostMemoryEstimate:
        """The pool as a row of the host-RAM estimate: ``undo``."""
        return HostMemoryEstimate(0, 0, {"undo": self._held}, self._pinned, 0)

    # -- leases ----------------------------------------------------------------------------------------------------
    def take(self, pieces: Sequence[Piece]) -> Union[Lease, str]:
        """Buffers for ``pieces`` (name, elements, dtype, pinned), or why not: ``"undo pool full"`` (the cap) or
        ``"host memory"`` (the host could not spare twice what must be made)."""
        keys = {name: (numel, dtype, pin) for name, numel, dtype, pin in pieces}
        total = sum(_nbytes(k) for k in keys.values())
        with self._lock:
            self._largest = max(self._largest, total)
            self._asked = True
            buffers = self._reuse(keys)
            new = {name: k for name, k in keys.items() if name not in buffers}
            why = self._room(sum(_nbytes(k) for k in new.values()), total)
            if why is None and new and self._recent:  # (past the first step: made by the grower, after the step)
                why = "undo pool growing"
            if why is not None:
                for name, t in buffers.items():  # (all or nothing)
                    self._free[keys[name]].append(t)
                if why == "undo pool full" and not self._refused:
                    self._refused = total
                if why == "undo pool growing" and not self._growing:
                    self._growing = total
                if why != "host memory" and self._recent:
                    self._wanted.append(list(new.values()))
                return why
            for name, (numel, dtype, pin) in new.items():
                buffers[name] = empty_host(numel, dtype, pin=pin)
                self._held += _nbytes((numel, dtype, pin))
                self._pinned += _nbytes((numel, dtype, pin)) if pin else 0
            self._in_use += total
            self._leases += 1
            self._step_peak = max(self._step_peak, self._in_use)
        return Lease(buffers, total, keys)

    def _reuse(self, keys: Dict[str, Key]) -> Dict[str, torch.Tensor]:
        out = {}
        for name, key in keys.items():
            free = self._free.get(key)
            if free:
                out[name] = free.pop()
        return out

    def _room(self, new: int, total: int) -> Optional[str]:
        """Why ``new`` bytes cannot be made now (None: they can)."""
        if not new:
            return None
        if self._held + new > self.limit(total):
            return "undo pool full"
        avail = available_host_bytes()
        if avail is not None and 2 * new > avail:
            return "host memory"
        return None

    def give_back(self, lease: Lease) -> None:
        """The lease's buffers are free again (what they hold now does not matter: the bucket's old state after a
        commit, the speculative one after a rollback). The caller has made sure no copy still reads them."""
        with self._lock:
            for name, t in lease.buffers.items():
                self._free[lease.keys[name]].append(t)
            lease.buffers = {}
            self._in_use -= lease.nbytes
            self._leases -= 1

    def end_step(self, record: bool) -> None:
        """Between steps (every lease given back): remember the step's demand (``record``: a step that sent
        buckets), and release free buffers beyond the cap that follows."""
        with self._lock:
            assert self._leases == 0, "undo pool: a lease outlived its step"
            if record and (self._asked or self._recent):  # (steps before the first lease do not count)
                demand = self._step_peak if not self._refused else 2 * self._step_peak + self._refused
                self._recent.append(max(demand, self._step_peak + self._growing))
            self._step_peak = self._refused = self._growing = 0
            self._asked = False
            limit = self.limit()
            for key in sorted(self._free, key=_nbytes, reverse=True):  # the largest first
                free = self._free[key]
                while free and self._held > limit:
                    free.pop()
                    self._held -= _nbytes(key)
                    self._pinned -= _nbytes(key) if key[2] else 0
            wanted, self._wanted = self._wanted, []
            # (A fixed cap that is full refuses leases every step: no thread for them.)
            if wanted and (self._grower is None or not self._grower.is_alive()) \
                    and self._room(sum(map(_nbytes, wanted[0])), 0) is None:
                self._grower = threading.Thread(target=self._grow, args=(wanted,), name="zero_offload undo pool",
                                                daemon=False)
                self._grower.start()

    def _grow(self, wanted: List[List[Key]]) -> None:
        """The grower (a thread of its own, between one step and the next): make what each refused lease of
        ``wanted`` lacked, a lease's buffers all or none, in the order they were asked for, while the cap and the
        host's room allow."""
        for keys in wanted:
            nbytes = sum(map(_nbytes, keys))
            pinned = sum(_nbytes(k) for k in keys if k[2])
            with self._lock:  # (the bytes are counted before they are made: the cap holds whatever runs beside)
                if self._room(nbytes, nbytes) is not None:
                    return
                self._held += nbytes
                self._pinned += pinned
            made: List[Tuple[Key, torch.Tensor]] = []
            try:
                for key in keys:
                    made.append((key, empty_host(key[0], key[1], pin=key[2])))
            except Exception as exc:  # noqa: BLE001 (e.g. cudaHostRegister refused: the pool stays as it is)
                with self._lock:
                    self._held -= nbytes
                    self._pinned -= pinned
                logger.warning("OffloadOptimizer: speculation's undo pool could not grow (%r); buckets beyond what it "
                               "holds are updated at step()", exc)
                return
            with self._lock:
                for key, buf in made:
                    self._free[key].append(buf)

    def wait_grown(self, timeout: Optional[float] = None) -> None:
        """Wait until the buffers queued at the last step's end are made (tests; nothing in a step waits)."""
        grower = self._grower
        if grower is not None:
            grower.join(timeout)

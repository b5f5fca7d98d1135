"""Speculation's undo memory: one pool of host bytes, shared by the buckets of a step and reused step after step,
under a cap (``OffloadOptimizer(speculation_memory=...)``).

A speculated bucket saves what its kernel will change (master, moments, 8-bit scales) and, for bf16/fp16
parameters, gets a buffer for the rounded output the commit uploads. Those bytes are needed from the speculation to
``step()``'s commit or rollback only, and only for the buckets the worker reaches during backward (on the 1.3B
preset about a third of them), so a buffer per bucket kept for the optimizer's life would hold up to the whole
state again for nothing. Here each speculation *leases* its buffers from arenas carved front to back; they are
given back at the commit or rollback, and once all are back the next lease starts again at the front. Buckets of
different sizes share the bytes; no Python work per parameter.

**The cap.** ``limit`` bounds the bytes the arenas hold (allocated, not merely in use). Given: that many bytes.
Not given (None, the default): learned, so that no more is allocated than the worker has used. The first step that
speculates measures the window: it is bounded by the host's room only, and as allocation is lazy (an arena grows
only when a lease does not fit), it allocates what the worker reaches in one backward. From then on the cap is the
largest of the last :data:`RECENT_STEPS` steps' demand (the most bytes leased at once in a step), plus one bucket
of slack (the largest lease asked for so far), which lets the pool grow. A step that ran out of room demanded more
than it got: its demand counts as twice what it leased plus the bucket refused, so a window that widens (or comes
back after steps that did not speculate, e.g. clipped ones) is found again in a few steps, not one bucket per
step.

Whatever the cap, an arena is not grown when the host has less than twice the growth available (``MemAvailable``,
capped by the cgroup's limit): an optional speedup must never be what brings in the OOM killer.

**Arenas.** The saved state is never copied to a device, so it lives in one pageable byte arena, carved into
dtype views at 64-byte boundaries; when a step needed more than one slab, they are merged into one of the step's
peak size before the next step (freed at once: nothing reads them asynchronously). The output buffers of pinned
buckets are uploaded from, asynchronously, so they come from page-locked arenas of their dtype (views of which
keep the allocation alive, see :func:`~zero_offload.host_memory.empty_host`); those slabs are kept as they are
(freeing page-locked memory waits for the device), and the speculation waits for the uploads from them before it
writes there again (:class:`~zero_offload.speculation.Speculative`).
"""

from __future__ import annotations

import collections
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from zero_offload.buckets import estimate_params
from zero_offload.host_memory import HostMemoryEstimate, available_host_bytes, empty_host

__all__ = ["Lease", "UndoPool", "RECENT_STEPS", "plan_undo"]

# Steps over which the learned cap remembers the largest demand (a run that stops speculating, e.g. clipping every
# step, gives the memory back after this many steps).
RECENT_STEPS = 10
_ALIGN = 64  # bytes: every leased buffer starts on a cache line

# (name, elements, dtype, pinned) of one buffer a lease holds.
Piece = Tuple[str, int, torch.dtype, bool]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class _Arena:
    """Slabs of one dtype (``torch.uint8``: any dtype, as views) and pinning, carved front to back."""

    def __init__(self, dtype: torch.dtype, pin: bool):
        self.dtype, self.pin = dtype, pin
        self.itemsize = dtype.itemsize
        self.slabs: List[torch.Tensor] = []
        self.slab = self.offset = 0  # where the next carve starts (slab index, bytes)
        self.peak = 0  # bytes of slab space passed over this step (carved or skipped at a slab's end)
        self.passed = 0  # the same, so far in this round of leases
        self.hint = 0  # the slab size the next step starts with, after a merge

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slabs)

    def fit(self, nbytes: int) -> Optional[torch.Tensor]:
        """``nbytes`` from the slabs held (None: they lack the room)."""
        while self.slab < len(self.slabs):
            slab = self.slabs[self.slab]
            if self.offset + nbytes <= slab.nbytes:
                start = self.offset // self.itemsize
                region = slab[start : start + nbytes // self.itemsize]
                self.offset += nbytes
                self.passed += nbytes
                self.peak = max(self.peak, self.passed)
                return region
            self.passed += slab.nbytes - self.offset
            self.slab, self.offset = self.slab + 1, 0
        return None

    def grow(self, nbytes: int) -> None:
        self.slabs.append(empty_host(nbytes // self.itemsize, self.dtype, pin=self.pin))

    def rewind(self) -> None:
        self.slab = self.offset = self.passed = 0

    def end_step(self, limit: int) -> None:
        """Between steps: merge a pageable arena's slabs into one of the step's peak size (made at the next lease),
        and free everything held beyond ``limit``."""
        if (len(self.slabs) > 1 and not self.pin) or self.nbytes > limit:
            self.hint = min(self.peak, limit) if not self.pin else 0
            self.slabs = []
        self.peak = 0
        self.rewind()


class Lease:
    """The buffers one speculation holds (``buffers``: name -> flat tensor), ``nbytes`` of the pool's."""

    __slots__ = ("buffers", "nbytes")

    def __init__(self, buffers: Dict[str, torch.Tensor], nbytes: int):
        self.buffers, self.nbytes = buffers, nbytes


class UndoPool:
    """The undo pool of one optimizer (see the module docstring). Leases are taken by the speculation worker and
    given back by ``step()`` (or by a hook that rolls one back), hence the lock.

    Args:
        limit (int, optional): the most bytes the pool may hold; None: learned. Default: None.
    """

    def __init__(self, limit: Optional[int] = None):
        self.fixed = limit
        self._arenas: Dict[Tuple[torch.dtype, bool], _Arena] = {}
        self._lock = threading.Lock()
        self._in_use = 0  # bytes leased and not given back
        self._leases = 0
        self._step_peak = 0  # the most bytes leased at once this step
        self._refused = 0  # bytes of the first lease refused for lack of room this step (0: none)
        self._largest = 0  # the largest lease asked for so far
        self._recent: collections.deque = collections.deque(maxlen=RECENT_STEPS)
        self._asked = False  # a lease was asked for this step

    # -- what it holds ---------------------------------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """Bytes the arenas hold now (leased or not)."""
        return sum(a.nbytes for a in list(self._arenas.values()))  # (a copy: the worker may add an arena)

    @property
    def pinned_bytes(self) -> int:
        return sum(a.nbytes for a in list(self._arenas.values()) if a.pin)

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
        return HostMemoryEstimate(0, 0, {"undo": self.held_bytes}, self.pinned_bytes, 0)

    # -- leases ----------------------------------------------------------------------------------------------------
    def take(self, pieces: Sequence[Piece]) -> Union[Lease, str]:
        """Buffers for ``pieces`` (name, elements, dtype, pinned), or why not: ``"undo pool full"`` (the cap) or
        ``"host memory"`` (the host could not spare twice the growth)."""
        need: Dict[Tuple[torch.dtype, bool], int] = {}
        sizes = []
        for _, numel, dtype, pin in pieces:
            key = (dtype, True) if pin else (torch.uint8, False)
            sizes.append((key, need.get(key, 0), numel * dtype.itemsize))
            need[key] = need.get(key, 0) + _aligned(numel * dtype.itemsize)
        total = sum(need.values())
        with self._lock:
            self._largest = max(self._largest, total)
            self._asked = True
            regions = self._carve(need, total)
            if isinstance(regions, str):
                if regions == "undo pool full" and not self._refused:
                    self._refused = total
                return regions
            self._in_use += total
            self._leases += 1
            self._step_peak = max(self._step_peak, self._in_use)
        buffers = {}
        for (name, numel, dtype, _), (key, start, nbytes) in zip(pieces, sizes):
            region = regions[key]
            if key[1]:  # a pinned arena is of the piece's dtype: a slice keeps its allocation alive
                buffers[name] = region[start // dtype.itemsize : start // dtype.itemsize + numel]
            else:
                buffers[name] = region[start : start + nbytes].view(dtype)
        return Lease(buffers, total)

    def _carve(self, need: Dict[Tuple[torch.dtype, bool], int], total: int
               ) -> Union[Dict[Tuple[torch.dtype, bool], torch.Tensor], str]:
        """A region of each arena in ``need`` (all or none: a failure restores the cursors), growing arenas within
        the cap and the host's room."""
        marks = {key: (a.slab, a.offset, a.passed, a.peak) for key, a in self._arenas.items()}
        regions = {}
        for key, nbytes in need.items():
            arena = self._arenas.get(key)
            if arena is None:
                arena = self._arenas[key] = _Arena(*key)
            region = arena.fit(nbytes)
            if region is None:
                why = self._grow(arena, nbytes, total)
                if why is not None:
                    for k, a in self._arenas.items():
                        a.slab, a.offset, a.passed, a.peak = marks.get(k, (0, 0, 0, 0))
                    return why
                region = arena.fit(nbytes)
            regions[key] = region
        return regions

    def _grow(self, arena: _Arena, nbytes: int, total: int) -> Optional[str]:
        room = self.limit(total) - self.held_bytes
        if nbytes > room:
            return "undo pool full"
        size = max(nbytes, min(arena.hint, room)) if not arena.slabs else nbytes
        avail = available_host_bytes()
        if avail is not None and 2 * size > avail:
            if size == nbytes or 2 * nbytes > avail:
                return "host memory"
            size = nbytes
        arena.grow(size)
        arena.hint = 0
        return None

    def give_back(self, lease: Lease) -> None:
        """The lease's buffers are free again (its commit's upload, if any, may still read the output buffer: the
        speculation waits for it before writing there)."""
        with self._lock:
            self._in_use -= lease.nbytes
            self._leases -= 1
            if self._leases == 0:
                for arena in self._arenas.values():
                    arena.rewind()

    def end_step(self, record: bool) -> None:
        """Between steps (every lease given back): remember the step's demand (``record``: a step that sent
        buckets), and fit the arenas to the cap that follows."""
        with self._lock:
            assert self._leases == 0, "undo pool: a lease outlived its step"
            if record and (self._asked or self._recent):  # (steps before the first lease do not count)
                demand = self._step_peak if not self._refused else 2 * self._step_peak + self._refused
                self._recent.append(demand)
            self._step_peak = self._refused = 0
            self._asked = False
            limit = self.limit()
            for arena in self._arenas.values():
                arena.end_step(limit)


def plan_undo(params: Sequence[Any], limit: int, **options: Any) -> HostMemoryEstimate:
    """The ``undo`` row of a plan (``OffloadOptimizer.estimate_host_memory(params, speculation_memory=limit)``):
    the cap, or, where less, every bucket off the CPU speculated at once (its master, state and scales, and the
    output buffer of bf16/fp16 parameters, page-locked like the bucket). ``options``: :func:`estimate_params`'."""
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]

    def only(keep: Callable[[torch.Tensor], bool]) -> List[Dict[str, Any]]:
        out = []
        for group in groups:
            ps = group["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            out.append({**group, "params": [p for p in ps if keep(p[1] if isinstance(p, tuple) else p)]})
        return out

    fp32 = estimate_params(only(lambda p: p.device.type != "cpu" and p.dtype == torch.float32), **options)
    low = estimate_params(only(lambda p: p.device.type != "cpu" and p.dtype != torch.float32), **options)
    outputs = low.buffers.get("grad", 0)  # (the gradient buffer's size: one low-precision element per slot)
    worst = fp32.state_bytes + low.state_bytes + outputs
    held = min(limit, worst)
    pinned = held * outputs // worst if low.pinned_bytes and worst else 0
    return HostMemoryEstimate(0, 0, {"undo": held}, pinned, 0)

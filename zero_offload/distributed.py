"""ZeRO over a ``torch.distributed`` process group: the collectives a sharded :class:`~zero_offload.OffloadOptimizer`
runs (:class:`Comm`), and the transport of its sharded buckets (:class:`ShardedTransport`).

One bucket's journey with a group of N ranks (see :class:`zero_offload.buckets.ShardLayout` for the layout):
its gradients are flattened and reduce-scattered (summed; the 1/N of the average is folded into the kernel's
gradient multiplier), from the backward hooks when streamed (:mod:`zero_offload.grad_stream`) or at ``step()``,
so each rank holds the sum for the shard it owns; the gradient statistics of all buckets (sum of squares, a
non-finite flag, and which parameters have a gradient on any rank) are combined in *one* all-reduce of a small
tensor per step; the kernel updates the shard; the updated shard is all-gathered into the full parameters while
the next bucket is updated. Every collective is started asynchronously (:meth:`Comm.start`) and waited for
with a timeout (:class:`Pending`), and a failure is re-raised naming this rank, the collective and the bucket,
so one rank dying cannot hang the others forever. After a failure the optimizer's :class:`Comm` is *broken*: it
starts and waits for no further collective (an error says why), and its process group is never destroyed, so
that the process can exit while a peer still holds a collective open (see :meth:`Comm._fail`). The work and the
tensors of every host collective are held until gloo's worker has let go of them (:class:`_Held`), or a run could
end in ``std::terminate`` at interpreter shutdown.

Ranks that part ways are caught before gloo meets collectives of different sizes (which aborts the process): the
statistics' all-reduce carries, per rank, where the rank is and a digest of the hyperparameters it steps with,
and each streamed backward begins with an all-reduce of the same size (:meth:`ShardedTransport._agree`); every
rank raises the same error, naming what differs.

``torch.distributed`` is imported here only, and only when a process group is used: ``import zero_offload`` stays
cheap.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import math
import pickle
import struct
import time
import weakref
from itertools import chain
from numbers import Real
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from zero_offload import functional
from zero_offload._compat import increment_version
from zero_offload.buckets import FlatBucket
from zero_offload.state.layout import view_like
from zero_offload.host_memory import copy_many_, empty_host
from zero_offload.records import BucketGrads, Plans
from zero_offload.transport import Transport

__all__ = ["DEFAULT_TIMEOUT", "Comm", "GradStats", "Pending", "ShardedTransport"]

# torch.distributed's own default for a process group's collectives.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
# How long a gloo worker may take to let go of a completed collective's tensors (microseconds, normally; see
# _Held) before they are kept for good instead.
_LET_GO_SECONDS = 10.0


def _dist():
    import torch.distributed as dist

    return dist


def moves_host_tensors(backend: str) -> bool:
    """Whether a group of this backend (``torch.distributed.get_backend``) runs collectives on CPU tensors: every
    backend but NCCL alone does ("cpu:gloo,cuda:nccl" too; "undefined" is init_process_group's default pair)."""
    backend = backend.lower()
    return "gloo" in backend or "mpi" in backend or "nccl" not in backend


def _keep_forever(obj: Any) -> None:
    """Leak one reference to ``obj`` so that it is never destroyed, not even at interpreter shutdown, when module
    globals are cleared (see :meth:`Comm._fail`)."""
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


@dataclasses.dataclass(frozen=True)
class GradStats:
    """One step's gradient statistics, combined over the group.

    Attributes:
        sq (float): sum of squares of the (averaged) gradient over every bucket.
        nonfinite (bool): some rank's shard holds an inf or nan.
    """

    sq: float
    nonfinite: bool


class _Held:
    """The tensors of one collective on host tensors, held by Python until the gloo worker that ran it has let go
    of them.

    A tensor whose Python object dies while C++ still holds it (gloo's ``Work`` does until its worker thread has
    finished with it, a little after ``wait()`` returns) has its Python object kept alive *by* C++, and the last
    C++ owner then needs the GIL to release it. When that is a gloo worker at interpreter shutdown, Python ends
    the thread with ``pthread_exit``, whose unwinding through the work's ``noexcept`` destructor is
    ``std::terminate``: "terminate called without an active exception" after a run without error (issue 27; the
    temporaries were the all-gather's shard view and the reduce-scatter's copy). So the references each tensor
    had before the collective started are counted, and :meth:`let_go` waits until the worker's are gone. No view
    of a held tensor may be made or dropped meanwhile: a view holds a reference to its base, and dropping one made
    before the count would let the tensor go early (it did: the reduce-scatter's part of its copy).

    The ``work`` is held too, and let go of first: the worker drops its tensors only when the work is destroyed,
    which must not be on the worker either once the interpreter is shutting down (a work never waited for, kept
    for good with its tensors; see :class:`Comm`): its destructor gives back the Python objects of the thread
    state captured where it was started (the hook's, in a streamed backward) and the tensors' references, both
    needing the GIL (issue 27, a rank exiting with a streamed reduce-scatter in flight)."""

    __slots__ = ("tensors", "counts", "work")

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = list(tensors)
        self.counts = [t._use_count() for t in self.tensors]
        self.work: Any = None  # set once started

    def let_go(self, limit: float) -> bool:
        """Wait (yielding the GIL) until only the references from before the collective remain, at most ``limit``
        seconds; whether they did (if not, the caller keeps the tensors forever). Our reference to the work goes
        first: the tensors' references go with the work."""
        self.work = None
        deadline = time.monotonic() + limit
        while any(t._use_count() > n for t, n in zip(self.tensors, self.counts)):
            if time.monotonic() > deadline:
                return False
            time.sleep(0)  # the worker releases the work a few microseconds after completing it
        return True


class Pending:
    """A collective in flight (see :meth:`Comm.start`). :meth:`wait` returns once it has completed, waiting at most
    the group's ``timeout``, and raises ``RuntimeError`` naming this rank, the collective and the bucket otherwise,
    or at once if the :class:`Comm` is broken. Waiting twice is free."""

    __slots__ = ("comm", "what", "where", "work", "event", "done", "held")

    def __init__(self, comm: "Comm", what: str, where: str, work: Any, event: Any, held: Optional[_Held]):
        self.comm, self.what, self.where, self.work, self.event = comm, what, where, work, event
        self.held = held
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.comm.check_usable(self.what, self.where)
        try:
            if self.event is not None:
                self.comm._poll_event(self.event)
            else:
                self.comm._wait_work(self.work)
        except Exception as exc:
            raise self.comm._fail(self.what, self.where, exc) from exc
        self.done = True
        self.work = None  # our reference to the work (and, through it, to the tensors) first
        if self.held is not None:
            self.comm._let_go(self.held)
            self.held = None


class _HostReduceScatter:
    """A reduce-scatter of host tensors as gloo runs it: an all-reduce of a copy of the input, then this rank's
    part copied out. Gloo's own reduce-scatter work does the same, but its ``wait()`` ignores the timeout it is
    given and it never reports itself completed; this one keeps the all-reduce's work, which honours both (see
    :meth:`Comm._wait_work`), for the same cost."""

    __slots__ = ("work", "out", "total", "lo")

    def __init__(self, work: Any, out: torch.Tensor, total: torch.Tensor, lo: int):
        self.work, self.out, self.total, self.lo = work, out, total, lo

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(timeout)
        # (The part is sliced here, not kept: a view holds a reference to ``total``, which would blur the count
        # of references that tells when gloo's worker has let go of it; see _Held.)
        self.out.copy_(self.total[self.lo : self.lo + self.out.numel()])
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


class Comm:
    """A process group and the collectives of a sharded optimizer, each waited for with ``timeout``.

    Args:
        group (ProcessGroup): the data-parallel group; every member builds the same optimizer over the same
            parameter shapes, in the same order.
        timeout (timedelta or float): how long to wait for any one collective (seconds if a number).
        grads_reduced (bool): gradients arrive already averaged over the group (DDP); take the owned slice instead
            of reduce-scattering.
        compact_state (bool): the moments are kept as bf16 or 8-bit (``state_dtype``), which
            ``sharded_state_dict()`` cannot hand out: what a broken optimizer still gives says so. Default: False.
    """

    def __init__(self, group: Any, timeout: Union[datetime.timedelta, float], grads_reduced: bool,
                 compact_state: bool = False):
        dist = _dist()
        if not dist.is_available():
            raise RuntimeError("process_group was given but this torch build has no torch.distributed")
        if not dist.is_initialized():
            raise ValueError("process_group was given but torch.distributed is not initialized: call "
                             "torch.distributed.init_process_group(...) first (torchrun sets up its environment)")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup (e.g. "
                            f"torch.distributed.group.WORLD), got {type(group).__name__}")
        if isinstance(timeout, Real) and not isinstance(timeout, bool):
            timeout = datetime.timedelta(seconds=float(timeout))
        if not isinstance(timeout, datetime.timedelta) or not timeout.total_seconds() > 0:
            raise ValueError(f"Invalid timeout: {timeout!r} (a positive datetime.timedelta or number of seconds)")
        self.group = group
        self.timeout = timeout
        self.grads_reduced = bool(grads_reduced)
        self.compact_state = bool(compact_state)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of process_group")
        self.src = dist.get_global_rank(group, 0)
        # Whether the group moves CPU tensors; if not (NCCL alone), small tensors and host state travel through
        # the current GPU.
        self.host_ok = moves_host_tensors(str(dist.get_backend(group)))
        self._rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        # Set by the first collective that fails or times out (see _fail): which, and why. None while usable.
        self.failure: Optional[str] = None
        # The works and tensors of the host collectives started and not yet let go of (see _Held), by id. Those of a
        # collective never waited for (a rank that raised or exits with one in flight, or whose collective failed)
        # are kept for good when this Comm dies or the interpreter exits, whichever comes first: the worker may
        # still be running it then.
        self._held: Dict[int, _Held] = {}
        weakref.finalize(self, _keep_forever, self._held)

    # -- collectives ---------------------------------------------------------------------------------------
    def start(self, what: str, where: str, launch: Callable[[], Any], on_device: bool,
              tensors: Sequence[torch.Tensor] = ()) -> "Pending":
        """Issue a collective (``launch`` calls it with ``async_op=True``) without waiting for it. For CUDA tensors
        (``on_device``; NCCL, whatever else the group also runs) the current stream is made to wait for it
        (``Work.wait()`` does only that: the host goes on, and it must be called here, where that stream is
        current) and an event marks that point; :meth:`Pending.wait` then bounds the host's wait by ``timeout``.
        For CPU tensors (gloo) the work itself is waited for then, and ``tensors`` (every tensor ``launch`` hands
        the collective) are held until its worker has let go of them (see :class:`_Held`)."""
        self.check_usable(what, where)
        held = None if on_device else _Held(tensors)
        try:
            work = launch()
            event = None
            if on_device:
                work.wait()
                event = torch.cuda.Event()
                event.record()
        except Exception as exc:
            if held is not None:
                self._held[id(held)] = held
            raise self._fail(what, where, exc) from exc
        if held is not None:
            held.work = work
            self._held[id(held)] = held
        return Pending(self, what, where, work, event, held)

    def _run(self, what: str, where: str, launch: Callable[[], Any], on_device: bool,
             tensors: Sequence[torch.Tensor] = ()) -> None:
        self.start(what, where, launch, on_device, tensors).wait()

    def _let_go(self, held: _Held) -> None:
        """Release a completed collective's tensors once its worker has (see :class:`_Held`); a worker that has not
        within the timeout is still running it, so they are kept until the process ends."""
        if held.let_go(min(self.timeout.total_seconds(), _LET_GO_SECONDS)):
            self._held.pop(id(held), None)
        elif self._held.pop(id(held), None) is not None:
            _keep_forever(held)

    def _error(self, what: str, where: str, exc: BaseException) -> RuntimeError:
        return RuntimeError(
            f"zero_offload: rank {self.rank} of {self.world}: {what} of {where} failed (timeout "
            f"{self.timeout}): {exc}. Every rank must call step(), clip_grad_norm_(), state_dict() and "
            "sharded_state_dict() together, and run each backward outside no_sync() the same number of times; "
            "another rank may have failed or stopped."
        )

    def _fail(self, what: str, where: str, exc: BaseException) -> RuntimeError:
        """The error for a collective that failed or timed out; from now on this optimizer is broken.

        The ranks are now out of step (this one gave up on a collective the others may still run), so
        :meth:`check_usable` refuses every later collective. The process group is kept alive until the process
        ends, never destroyed: a gloo group's destructor joins its worker threads, and a worker still inside the
        abandoned collective waits for the stalled peer up to the *group's* timeout (30 minutes by default), which
        kept the process from exiting at interpreter shutdown and then ended it in ``std::terminate`` (issue 16).
        Gloo cannot abort a collective in flight (``ProcessGroup.abort()`` and ``shutdown()`` leave it running),
        so the worker is left to die with the process."""
        if self.failure is None:
            self.failure = f"{what} of {where}: {exc}"
            _keep_forever(self.group)
        # (The workers of the collectives in flight hold their tensors until they give up on them, which may be at
        # interpreter shutdown: they stay in _held, kept for good when this Comm goes; see __init__.)
        return self._error(what, where, exc)

    def check_usable(self, what: str, where: str) -> None:
        """Raise ``RuntimeError`` if an earlier collective failed (:meth:`_fail`): none is started or waited for."""
        if self.failure is None:
            return
        raise RuntimeError(
            f"zero_offload: rank {self.rank} of {self.world}: {what} of {where} refused: an earlier collective "
            f"failed ({self.failure}), so this rank is out of step with the others and this optimizer runs no "
            f"further collective. {self._salvage()} state_dict(), step() and clip_grad_norm_() cannot run. Build a "
            "new process group and optimizer to go on; this process group is not usable either (see "
            "docs/reliability.md, Known limits)."
        )

    def _salvage(self) -> str:
        """What a broken optimizer still gives of this rank's state, without a collective."""
        if not self.compact_state:
            return "sharded_state_dict() still gives this rank's shard of the state (no collective);"
        return ("No state dict can be had: sharded_state_dict() needs state_dtype=torch.float32 and state_dict() "
                "the other ranks; this rank's shard stays in host_buffers() (moments in state_dtype, 8-bit ones "
                "with their scales), to be saved as raw buffers only;")

    def _wait_work(self, work: Any) -> None:
        """Wait for a collective on host tensors (gloo) on this thread, at most ``timeout``: gloo's works for the
        collectives started here honour ``Work.wait(timeout)`` (its reduce-scatter does not: see
        :class:`_HostReduceScatter`). No helper thread waits instead: one still blocked in
        ``Work.wait()`` when the interpreter shuts down, woken then by the peer, ends the process in
        ``std::terminate`` (issue 16)."""
        try:
            work.wait(self.timeout)
        except Exception:
            if not work.is_completed():  # gloo's "Operation timed out!"; say which timeout
                raise RuntimeError(f"not completed within {self.timeout}") from None
            raise

    def _poll_event(self, event: Any) -> None:
        """Wait for a CUDA event, at most ``timeout`` (``Event.synchronize`` has no deadline)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        pause = 1e-5
        while not event.query():
            if time.monotonic() > deadline:
                raise RuntimeError(f"not completed within {self.timeout}")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def start_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, where: str) -> "Pending":
        if inp.is_cuda:
            return self.start("reduce_scatter", where,
                              lambda: self._rs(out, inp, group=self.group, async_op=True), True)
        dist = _dist()
        total = inp.clone()
        return self.start("reduce_scatter", where, lambda: _HostReduceScatter(
            dist.all_reduce(total, group=self.group, async_op=True), out, total, self.rank * out.numel()), False,
            (total,))

    def start_all_gather(self, out: torch.Tensor, inp: torch.Tensor, where: str) -> "Pending":
        return self.start("all_gather", where, lambda: self._ag(out, inp, group=self.group, async_op=True),
                          inp.is_cuda, (out, inp))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, where: str) -> None:
        self.start_all_gather(out, inp, where).wait()

    def broadcast(self, t: torch.Tensor, where: str) -> None:
        dist = _dist()
        self._run("broadcast", where, lambda: dist.broadcast(t, self.src, group=self.group, async_op=True),
                  t.is_cuda, (t,))

    def all_reduce(self, t: torch.Tensor, op: Any, where: str) -> None:
        dist = _dist()
        self._run("all_reduce", where, lambda: dist.all_reduce(t, op=op, group=self.group, async_op=True),
                  t.is_cuda, (t,))

    def _device(self) -> torch.device:
        return torch.device("cpu") if self.host_ok else torch.device("cuda", torch.cuda.current_device())

    def all_reduce_host(self, values: Sequence[float], op: Any, where: str) -> List[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self._device())
        self.all_reduce(t, op, where)
        return t.tolist()

    def all_gather_host(self, out: torch.Tensor, shard: torch.Tensor, where: str) -> None:
        """All-gather host tensors (through the GPU when the backend only moves device tensors)."""
        if self.host_ok:
            self.all_gather(out, shard, where)
            return
        dev = self._device()
        full = torch.empty(out.shape, dtype=out.dtype, device=dev)
        self.all_gather(full, shard.to(dev), where)
        out.copy_(full)

    def all_gather_objects(self, obj: Any, where: str) -> List[Any]:
        """Every rank's ``obj`` (picklable), in rank order: ``torch.distributed.all_gather_object`` through
        :meth:`start`, so its tensors are let go of as every collective's are (see :class:`_Held`) and its wait is
        bounded by ``timeout``. Two all-gathers: the pickles' sizes, then the pickles padded to the largest."""
        data = pickle.dumps(obj)
        sizes = torch.zeros(self.world, dtype=torch.int64)
        self.all_gather_host(sizes, torch.tensor([len(data)], dtype=torch.int64), f"the sizes of {where}")
        longest = int(sizes.max())
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.empty(self.world * longest, dtype=torch.uint8)
        self.all_gather_host(out, mine, where)
        return [pickle.loads(out[r * longest : r * longest + int(n)].numpy().tobytes()) for r, n in enumerate(sizes)]

    # -- construction --------------------------------------------------------------------------------------
    def check_same_params(self, tensors: Sequence[torch.Tensor], group_index: int,
                          layout: Sequence[Tuple[str, Any]] = ()) -> None:
        """Raise ``ValueError`` on every rank (so none is left waiting) unless all ranks give the same number of
        parameters with the same shapes, dtypes and device types, and the same ``layout`` (the options that shape
        buckets and collectives, as ``(name, value)`` pairs): otherwise their flat buckets would not line up and
        the collectives would mix unrelated values, or wait for each other forever."""
        mine = (list(layout), [(tuple(p.shape), str(p.dtype).replace("torch.", ""), p.device.type) for p in tensors])
        everyone = self.all_gather_objects(mine, f"the description of param group {group_index}")
        (options0, params0) = everyone[0]
        for r, (options, params) in enumerate(everyone):
            for (name, ours), (_, theirs) in zip(options0, options):
                if ours != theirs:
                    raise ValueError(f"OffloadOptimizer(process_group=...): {name} differs across ranks: {ours!r} on "
                                     f"rank 0, {theirs!r} on rank {r}. Every rank must build the optimizer with the "
                                     "same options.")
            if params == params0:
                continue
            if len(params) != len(params0):
                detail = f"rank 0 has {len(params0)} parameters, rank {r} has {len(params)}"
            else:
                k = next(k for k, (a, b) in enumerate(zip(params0, params)) if a != b)
                detail = f"parameter {k} is {params0[k]} (shape, dtype, device) on rank 0, {params[k]} on rank {r}"
            raise ValueError(f"OffloadOptimizer(process_group=...): param group {group_index} differs across ranks: "
                             f"{detail}. Every rank must pass the same parameters in the same order.")


# Where a rank is when it runs a collective of the statistics' size (see ShardedTransport._agree).
_BACKWARD, _STEP_REDUCE, _STATS, _CLIPPED_STEP, _STATE_DICT = 1.0, 2.0, 3.0, 4.0, 5.0


def _describe(phase: float, backwards: int) -> str:
    after = f"after {backwards} streamed backward{'s' if backwards != 1 else ''}"
    return {_BACKWARD: f"in backward {backwards + 1} of this step, reduce-scattering its gradients",
            _STEP_REDUCE: f"at step(), reduce-scattering the gradients backward did not send ({after})",
            _STATS: f"at step() or clip_grad_norm_(), combining the gradient statistics ({after})",
            _CLIPPED_STEP: f"at step() after clip_grad_norm_() ({after})",
            _STATE_DICT: "in state_dict(), about to gather the state"}.get(phase, f"lost (phase {phase})")


def _digest(settings: Sequence[Tuple[str, float]]) -> float:
    """A 48-bit digest of the settings' values, exact as a float64 (it travels in a float64 all-reduce)."""
    values = [float(v) for _, v in settings]
    raw = hashlib.blake2b(struct.pack(f"<{len(values)}d", *values), digest_size=6).digest()
    return float(int.from_bytes(raw, "little"))


class _Collectives:
    """The collectives in flight for one sharded bucket."""

    __slots__ = ("rs", "ag", "shard_in", "adding")

    def __init__(self) -> None:
        self.rs: Optional[Pending] = None  # the reduce-scatter of gradients
        self.ag: Optional[Pending] = None  # the all-gather of updated parameters
        self.shard_in: Optional[torch.Tensor] = None  # a streamed micro-batch's shard, to add to grad
        self.adding = False


class ShardedTransport(Transport):
    """The transport of sharded buckets (:class:`~zero_offload.buckets.ShardLayout`): gradients are flattened
    and reduce-scattered, so only this rank's shard of their sum reaches the host, and updated shards are
    all-gathered back into the full parameters.

    * On CPU the parameters are views of the bucket's ``flat_param``; gradients are copied into (or, after
      ``zero_grad(set_to_none=False)``, accumulated in) ``flat_grad``, which the reduce-scatter reads; the
      all-gather writes ``flat_param`` in place.
    * On CUDA, gradients are flattened into a transient device buffer on the copy stream, the reduce-scatter leaves
      the owned shard on the device and only that shard is copied to pinned host memory; the updated shard goes up
      on the upload stream and is all-gathered into a transient device buffer copied into the parameters.

    Every rank must issue the collectives in the same order: which parameters have a gradient is agreed over the
    group in :meth:`gather`, so every rank then updates (and all-gathers) the same buckets.

    Args:
        comm (Comm): the group's collectives.
        release (bool): as for :class:`~zero_offload.transport.Transport`.
    """

    sharded = True

    def __init__(self, comm: Comm, *, release: bool):
        super().__init__(release=release)
        self.comm = comm
        self._stats: Optional[GradStats] = None
        self._collectives: Dict[int, _Collectives] = {}
        self._backwards = 0  # backward passes of this step whose reduce-scatters have begun (see _send)

    def add(self, bucket: FlatBucket, streamed: bool) -> None:
        super().add(bucket, streamed)
        self._collectives[id(bucket)] = _Collectives()

    def bind(self, bucket: FlatBucket) -> None:
        """Make the parameters identical on every rank (rank 0's values, broadcast, as DDP does at
        construction) and, on CPU, views of ``flat_param``. A collective: every rank binds its buckets in the same
        order."""
        where = f"initial parameters of {bucket.where}"
        if bucket.resident:
            bucket.masters.fill_param_slots()
            self.comm.broadcast(bucket.flat_param, where)
            bucket.masters.bind()
            return
        full = bucket.full
        flat = torch.zeros(full.padded_numel, dtype=bucket.dtype, device=bucket.device)
        views = [view_like(flat, o, p) for o, p in zip(full.offsets, bucket.params)]
        torch._foreach_copy_(views, [p.detach() for p in bucket.params])
        self.comm.broadcast(flat, where)
        with torch.no_grad():
            torch._foreach_copy_(bucket.params, views)

    # -- gradients ---------------------------------------------------------------------------------------------
    def _send(self, link, idx: List[int], grads: List[torch.Tensor]) -> None:
        """Start the reduce-scatter of a bucket complete in backward. Its shard of the reduced sum is added to an
        earlier micro-batch's with ``release``; otherwise it is recomputed from the gradients accumulated on the
        parameters. The first bucket of each backward (every backward sends every bucket once, in a fixed order)
        is preceded by :meth:`_agree`: a rank running one more backward than another meets its ``step()`` there
        and both raise, where their reduce-scatters would have met the step's all-reduce and aborted gloo."""
        bucket = link.bucket
        if link.launches >= self._backwards:
            self._agree(_BACKWARD, (), "reduce_scatter", f"gradients of {bucket.where}")
            self._backwards += 1
        stream = None if bucket.resident else self.stream(bucket.device)
        self._reduce_scatter(bucket, [p.grad for p in bucket.params], stream,
                             add=self.release and self.launched(bucket))
        if self.release and stream is not None:
            for g in grads:
                g.record_stream(stream)

    def _reduce_scatter(self, bucket: FlatBucket, grads: Sequence[Optional[torch.Tensor]], stream,
                        add: bool = False) -> None:
        """Flatten the gradients (absent ones as zeros) and start leaving this rank's shard of their sum over the
        group (or, with ``grads_reduced``, of the already-reduced gradients) in ``grad``; with ``add``, the shard
        is added to what ``grad`` holds (another micro-batch's, streamed). Nothing is waited for: the
        reduce-scatter runs while the caller goes on, and :meth:`wait_grads` finishes it. On CUDA the copy to the
        host is enqueued on ``stream`` after the collective."""
        self.wait_grads(bucket)  # the previous reduce-scatter may still read flat_grad or write grad
        coll = self._collectives[id(bucket)]
        lo, shard = bucket.shard.lo, bucket.shard.numel
        if add and coll.shard_in is None:
            coll.shard_in = empty_host(shard, bucket.dtype, pin=bucket.pin)
        out = coll.shard_in if add else bucket.grad
        if bucket.resident:
            self._flatten_cpu(bucket, grads)
            if self.comm.grads_reduced:
                out.copy_(bucket.flat_grad[lo : lo + shard])
            else:
                coll.rs = self.comm.start_reduce_scatter(out, bucket.flat_grad, f"gradients of {bucket.where}")
        else:
            self._reduce_scatter_cuda(bucket, grads, stream, out)
        coll.adding = add

    @staticmethod
    def _flatten_cpu(bucket: FlatBucket, grads: Sequence[Optional[torch.Tensor]]) -> None:
        targets, numels = bucket.grads.targets, bucket.full.numels
        dsts, srcs, sizes = [], [], []
        for i, g in enumerate(grads):
            if g is None:
                bucket.grads.clear(i)
                continue
            bucket.grads.filled(i)
            if g is not targets[i]:  # a view installed by zero_grad(set_to_none=False) needs no copy
                dsts.append(targets[i])
                srcs.append(g)
                sizes.append(numels[i])
        if dsts:
            copy_many_(dsts, srcs, sizes)

    def _reduce_scatter_cuda(self, bucket: FlatBucket, grads: Sequence[Optional[torch.Tensor]], stream,
                             out: torch.Tensor) -> None:
        full = bucket.full
        lo, shard = bucket.shard.lo, bucket.shard.numel
        # The gradients were written on the compute stream (by backward, or by DDP's averaging at its end).
        stream.wait_stream(torch.cuda.current_stream(bucket.device))
        with torch.cuda.stream(stream):
            flat = torch.zeros(full.padded_numel, dtype=bucket.dtype, device=bucket.device)
            present = [i for i, g in enumerate(grads) if g is not None]
            if present:
                torch._foreach_copy_([view_like(flat, full.offsets[i], bucket.params[i]) for i in present],
                                     [grads[i] for i in present])
            if self.comm.grads_reduced:
                own = flat[lo : lo + shard]
            else:
                own = torch.empty(shard, dtype=bucket.dtype, device=bucket.device)
                # The stream waits for it.
                self._collectives[id(bucket)].rs = self.comm.start_reduce_scatter(own, flat,
                                                                                  f"gradients of {bucket.where}")
            out.copy_(own, non_blocking=True)
            self.record_d2h(bucket, stream)

    def _settle(self, link) -> None:
        self.wait_grads(link.bucket)  # the reduce-scatter, the copy and the add of a streamed micro-batch

    def wait_grads(self, bucket: FlatBucket) -> None:
        """Wait for the reduce-scatter (at most the group's timeout, else an error naming rank and bucket) and the
        copy to the host, and add a streamed micro-batch's shard."""
        coll = self._collectives[id(bucket)]
        if coll.rs is not None:
            pending, coll.rs = coll.rs, None
            pending.wait()
        super().wait_grads(bucket)
        if coll.adding:
            coll.adding = False
            bucket.grad.add_(coll.shard_in)

    def reset(self) -> None:
        super().reset()
        self._backwards = 0

    def gather(self, plans: Plans, check: bool = False, clipping: bool = False,
               settings: Sequence[Tuple[str, float]] = ()) -> bool:
        """Bring every bucket's reduced gradient shard to the host and combine the sum of squares, the non-finite
        flag and which parameters have a gradient in one all-reduce (each :class:`BucketGrads`'s ``present``
        becomes the group's answer: a gradient on some ranks only counts as zero on the others).

        A bucket whose gradients backward already reduce-scattered (the same on every rank) is only waited for;
        the others' reduce-scatters are all started first (in plan order, the same on every rank), then waited
        for, so they overlap each other and the gradient copies. The all-reduce also carries each streamed
        bucket's ``stale`` flag: a gradient changed on some rank after its reduce-scatter (an in-place clip or
        unscale, or one assigned by hand), and every rank then reduce-scatters that bucket again from the
        gradients on the parameters, with a second all-reduce for the norm (impossible with ``release``, whose
        gradients are gone: an error on every rank).

        The all-reduce also checks that every rank is at the same point (see :meth:`_agree`) with the same
        ``settings`` (name, value) pairs: the hyperparameters a step uses, which the all-gather of the updated
        shards would otherwise silently reconcile (a scheduler stepped on one rank only)."""
        entries = list(chain.from_iterable(plans))
        todo = [bg for bg in entries if not self.launched(bg.bucket)]
        if todo and any(link.streamed for link in self._links.values()):
            # Another rank may have sent these from backward already: it is at the statistics, not here.
            self._agree(_STEP_REDUCE, (), "reduce_scatter", f"gradients of {todo[0].bucket.where}")
        for bg in todo:
            self._reduce_scatter(bg.bucket, bg.pending, None if bg.bucket.resident else self.stream(bg.bucket.device))
        local = [list(bg.present) for bg in entries]
        sqs, bads = self._shard_stats(entries)
        stale = [float(self.launched(bg.bucket) and bg.stale) for bg in entries]
        dist = _dist()
        where = "the gradient norm, non-finite check and gradient presence"
        vals = self.comm.all_reduce_host([sum(sqs), sum(bads), float(clipping), *map(float, chain.from_iterable(local)),
                                          *stale, *self._tail(_STATS, settings)], dist.ReduceOp.SUM, where)
        tail = vals[len(vals) - 3 * self.comm.world :]
        self._check_phases(tail, "all_reduce", where)
        self._check_clipping(int(vals[2]), clipping)
        self._check_settings(tail, settings, where)
        del vals[len(vals) - 3 * self.comm.world :]
        k = 3
        for bg in entries:
            bg.agree([v > 0 for v in vals[k : k + len(bg.present)]])
            k += len(bg.present)
        redo = [i for i, v in enumerate(vals[k:]) if v > 0]
        if redo:
            vals[:2] = self._reduce_again(entries, local, redo, sqs, bads)
        self._stats = GradStats(vals[0], vals[1] > 0 or not math.isfinite(vals[0]))
        return check and self._stats.nonfinite

    # -- agreement -------------------------------------------------------------------------------------------
    def agree(self, settings: Sequence[Tuple[str, float]]) -> None:
        """``step()`` after ``clip_grad_norm_`` (whose all-reduce was the gradient statistics'): check that every
        rank steps with the same ``settings``, in an all-reduce of its own."""
        self._agree(_CLIPPED_STEP, settings, "all_reduce", "the hyperparameters of step()")

    def agree_state(self, buckets: Iterable[FlatBucket]) -> None:
        """``state_dict()``, before gathering: every rank is there, and holds the same state buffers (an amsgrad
        buffer on some ranks only, from a state dict loaded there, would gather unlike sizes and abort gloo)."""
        settings = [(f"{buf.name} buffer of {b.where}", float(buf.name in b.store.flat))
                    for b in buckets for buf in b.rule.buffers if buf.optional]
        self._agree(_STATE_DICT, settings, "all_gather", "the state", state=True)

    def _stats_numel(self) -> int:
        """The length of :meth:`gather`'s all-reduce: fixed for the optimizer's life, the same on every rank."""
        return 3 + sum(len(link.bucket.params) + 1 for link in self._links.values()) + 3 * self.comm.world

    def _tail(self, phase: float, settings: Sequence[Tuple[str, float]]) -> List[float]:
        """What the statistics' all-reduce ends with: per rank, a digest of ``settings``, then where the rank is
        (``phase``, and how many streamed backwards this step has had); zeros in the other ranks' places, so the
        sum holds every rank's."""
        world, rank = self.comm.world, self.comm.rank
        tail = [0.0] * (3 * world)
        tail[rank] = _digest(settings)
        tail[world + 2 * rank], tail[world + 2 * rank + 1] = phase, float(self._backwards)
        return tail

    def _agree(self, phase: float, settings: Sequence[Tuple[str, float]], what: str, where: str,
               state: bool = False) -> None:
        """An all-reduce the size of the gradient statistics', carrying only :meth:`_tail`: collectives of
        different sizes meeting each other abort gloo in C++ (``EnforceNotMet``, exit -6), so the points where
        ranks can part ways (a backward's reduce-scatters, or step()'s) begin with this, which meets the same on
        the other ranks or the statistics' all-reduce; each rank raises if they are not at the same point."""
        vals = [0.0] * (self._stats_numel() - 3 * self.comm.world) + self._tail(phase, settings)
        tail = self.comm.all_reduce_host(vals, _dist().ReduceOp.SUM, f"the check before the {what} of {where}")
        tail = tail[len(tail) - 3 * self.comm.world :]
        self._check_phases(tail, what, where)
        self._check_settings(tail, settings, where, state)

    def _check_phases(self, tail: List[float], what: str, where: str) -> None:
        world = self.comm.world
        at = [(tail[world + 2 * r], int(tail[world + 2 * r + 1])) for r in range(world)]
        if len(set(at)) == 1:
            return
        ranks = "; ".join(f"rank {r} is {_describe(*a)}" for r, a in enumerate(at))
        raise RuntimeError(
            f"zero_offload: rank {self.comm.rank} of {world}: {what} of {where} refused: the ranks are at different "
            f"collectives: {ranks}. Every rank must run each backward outside no_sync() the same number of times "
            "between steps, and call step(), clip_grad_norm_() and state_dict() together. Nothing was sent or "
            "updated; the ranks are still in step (call zero_grad() on every rank to go on)."
        )

    def _check_settings(self, tail: List[float], settings: Sequence[Tuple[str, float]], where: str,
                        state: bool = False) -> None:
        """Raise on every rank, naming what differs and where, unless every rank's digest is the same (the values
        are exchanged only then: every rank sees the same digests, so every rank takes the same path)."""
        world, rank = self.comm.world, self.comm.rank
        if len(set(tail[:world])) == 1:
            return
        n = len(settings)
        mine = [0.0] * (world * n)
        mine[rank * n : (rank + 1) * n] = [float(v) for _, v in settings]
        every = self.comm.all_reduce_host(mine, _dist().ReduceOp.SUM, "the values that differ, to name them")
        diffs = []
        for j, (name, _) in enumerate(settings):
            values = [every[r * n + j] for r in range(world)]
            if len(set(values)) > 1:
                diffs.append(f"{name}: " + ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values)))
        listed = f"{'; '.join(diffs[:4])}{'; ...' if len(diffs) > 4 else ''}"
        if state:
            raise RuntimeError(
                f"zero_offload: rank {rank} of {world}: the ranks hold different state buffers ({where}): {listed}. "
                "Their state cannot be gathered (a state dict with amsgrad loaded on some ranks only?); every rank "
                "must load the same one. Nothing was gathered."
            )
        raise RuntimeError(
            f"zero_offload: rank {rank} of {world}: the ranks step with different hyperparameters ({where}): "
            f"{listed}. Each rank's shard would be updated with its own and the all-gather would hide it: every "
            "rank must use the same (an LR scheduler stepped on one rank only?). Nothing was updated."
        )

    def _check_clipping(self, clipping_ranks: int, clipping: bool) -> None:
        """``clip_grad_norm_`` gathers the gradients itself, so a rank that clips meets the others' ``step()`` in
        this all-reduce: every rank clips, or none does, or each raises here with nothing updated."""
        if 0 < clipping_ranks < self.comm.world:
            raise RuntimeError(
                f"zero_offload: rank {self.comm.rank} of {self.comm.world}: clip_grad_norm_ was called on "
                f"{clipping_ranks} of {self.comm.world} ranks for this step (this rank: "
                f"{'clip_grad_norm_' if clipping else 'step'}). Every rank must call it, or none. Nothing was updated."
            )

    def _reduce_again(self, entries: List[BucketGrads], local: List[List[bool]], redo: List[int], sqs: List[float],
                      bads: List[float]) -> List[float]:
        if self.release:
            raise RuntimeError(
                f"zero_offload: rank {self.comm.rank} of {self.comm.world}: a gradient was assigned or changed in "
                f"place after backward had reduce-scattered it (in {entries[redo[0]].bucket.where}), but "
                "release_grads=True dropped the others', so it cannot be reduced again. Clip with "
                "optimizer.clip_grad_norm_ and do not edit gradients after backward, or pass release_grads=False. "
                "Nothing was updated."
            )
        for i in redo:
            bg = entries[i]
            again = [p.grad if has and g is None else g for p, has, g in zip(bg.bucket.params, local[i], bg.pending)]
            self._reduce_scatter(bg.bucket, again, None if bg.bucket.resident else self.stream(bg.bucket.device))
        redone = self._shard_stats([entries[i] for i in redo])
        for j, i in enumerate(redo):
            sqs[i], bads[i] = redone[0][j], redone[1][j]
        return self.comm.all_reduce_host([sum(sqs), sum(bads)], _dist().ReduceOp.SUM,
                                         "the gradient norm and non-finite check, after reducing again")

    def _shard_stats(self, entries: Sequence[BucketGrads]) -> Tuple[List[float], List[float]]:
        """Wait for each bucket's shard; its sum of squares (of the averaged gradient) and non-finite flag."""
        sqs, bads = [], []
        for bg in entries:
            self.wait_grads(bg.bucket)
            grad = bg.bucket.grad
            s, nonfinite = (functional.device_sq_norm([grad]) if bg.bucket.device_tier
                            else functional.grad_sq_norm(grad))
            sqs.append(s * bg.bucket.grad_multiplier**2)
            bads.append(float(nonfinite))
        return sqs, bads

    def total_norm(self, plans: Plans, norm_type: float) -> Tuple[float, bool]:
        """``clip_grad_norm_``'s total norm of the averaged gradient over the group: the 2-norm from the last
        :meth:`gather` (no further collective), other norms with one more all-reduce."""
        self.wait_all(plans)
        stats = self._stats
        if norm_type == 2.0:
            return math.sqrt(stats.sq), stats.nonfinite
        dist = _dist()
        buckets = [bg.bucket for bg in chain.from_iterable(plans) if bg.bucket.grad.numel()]
        # Padding is zero in the gradient buffers, so it changes neither a max nor a p-norm.
        if norm_type == math.inf:
            local = max((float(b.grad.abs().max()) * b.grad_multiplier for b in buckets), default=0.0)
            total = self.comm.all_reduce_host([local], dist.ReduceOp.MAX, "the gradient inf-norm")[0]
        else:
            local = sum(float(torch.linalg.vector_norm(b.grad.double() * b.grad_multiplier, norm_type)) ** norm_type
                        for b in buckets)
            total = self.comm.all_reduce_host([local], dist.ReduceOp.SUM, f"the gradient {norm_type}-norm")[0]
            total = total ** (1.0 / norm_type)
        return total, stats.nonfinite or not math.isfinite(total)

    # -- parameters --------------------------------------------------------------------------------------------
    def send_params(self, bucket: FlatBucket, indices: Sequence[int]) -> None:
        """Start all-gathering the updated shard (fp32 master, or the bf16/fp16 staging copy) into the full
        parameters, without waiting: the next bucket's update runs meanwhile, and :meth:`finish_params` waits
        (``step()`` waits for every bucket's before it returns). The whole bucket is gathered whatever ``indices``
        are (every rank gathers the same buckets)."""
        coll = self._collectives[id(bucket)]
        lo, shard, full = bucket.shard.lo, bucket.shard.numel, bucket.full
        where = f"parameters of {bucket.where}"
        if bucket.resident:
            # The shard is flat_param's own slice: gathered in place.
            coll.ag = self.comm.start_all_gather(bucket.flat_param, bucket.flat_param[lo : lo + shard], where)
            increment_version([bucket.params[i] for i in indices])
        else:
            src = bucket.staging if bucket.low_precision else bucket.master
            stream = self.stream(bucket.device, upload=True)
            with torch.no_grad(), torch.cuda.stream(stream):
                own = torch.empty(shard, dtype=bucket.dtype, device=bucket.device)
                own.copy_(src, non_blocking=True)
                flat = torch.empty(full.padded_numel, dtype=bucket.dtype, device=bucket.device)
                coll.ag = self.comm.start_all_gather(flat, own, where)  # the stream waits for it
                # Only the parameters updated: another's master may not have been initialised from it yet.
                torch._foreach_copy_([bucket.params[i] for i in indices],
                                     [view_like(flat, full.offsets[i], bucket.params[i]) for i in indices])
            self.record_h2d(bucket, stream)
        bucket.masters.record_versions(indices)

    def finish_params(self, buckets: Iterable[FlatBucket]) -> None:
        buckets = list(buckets)
        for bucket in buckets:
            coll = self._collectives[id(bucket)]
            if coll.ag is not None:
                pending, coll.ag = coll.ag, None
                pending.wait()
        super().finish_params(buckets)


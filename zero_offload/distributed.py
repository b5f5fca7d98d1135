"""The collectives a sharded :class:`~zero_offload.OffloadOptimizer` runs over a ``torch.distributed`` process group
(:class:`Comm`); the transport of its sharded buckets is :mod:`zero_offload.transport.sharded`.

Every collective is started asynchronously (:meth:`Comm.start`) and waited for with a timeout (:class:`Pending`),
and a failure is re-raised naming this rank, the collective and the bucket, so one rank dying cannot hang the others
forever. After a failure the optimizer's :class:`Comm` is *broken*: it starts and waits for no further collective (an
error says why), and its process group is never destroyed, so that the process can exit while a peer still holds a
collective open (see :meth:`Comm._fail`). The work and the tensors of every host collective are held until gloo's
worker has let go of them (:class:`_Held`), or a run could end in ``std::terminate`` at interpreter shutdown.

``torch.distributed`` is imported here only, and only when a process group is used: ``import zero_offload`` stays
cheap.
"""

from __future__ import annotations

import datetime
import pickle
import time
import weakref
from numbers import Real
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

__all__ = ["DEFAULT_TIMEOUT", "Comm", "Pending", "moves_host_tensors"]

# torch.distributed's own default for a process group's collectives.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
# How long a gloo worker may take to let go of a completed collective's tensors (microseconds, normally; see
# _Held) before they are kept for good instead.
_LET_GO_SECONDS = 10.0
# The references to a tensor's TensorImpl (C++'s and Python's); torch 2.3 has no way to read them.
_use_count: Optional[Callable[[torch.Tensor], int]] = getattr(torch.Tensor, "_use_count", None)


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
        self.counts = [_use_count(t) for t in self.tensors]
        self.work: Any = None  # set once started

    def let_go(self, limit: float) -> bool:
        """Wait (yielding the GIL) until only the references from before the collective remain, at most ``limit``
        seconds; whether they did (if not, the caller keeps the tensors forever). Our reference to the work goes
        first: the tensors' references go with the work."""
        self.work = None
        deadline = time.monotonic() + limit
        while any(_use_count(t) > n for t, n in zip(self.tensors, self.counts)):
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
        if self.host_ok and _use_count is None:
            raise RuntimeError(
                f"process_group sharding over {dist.get_backend(group)} needs Tensor._use_count, which this torch "
                f"({torch.__version__}) lacks: without it the host tensors of a collective cannot be held until "
                "gloo's worker lets go of them, and a rank can abort at exit. Upgrade torch, or train "
                "without process_group (or under FSDP2)")
        self._rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        # Set by the first collective that fails or times out (see _fail): which, and why. None while usable.
        self.failure: Optional[str] = None
        self.started = 0  # collectives started (Agreement.failing: whether a rank that raised met the others)
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
        (``Work.wait()`` does only that, and lets go of the tensors NCCL held: the host goes on, and it must be
        called here, where that stream is current; a caller that keeps the compute stream free issues it on a side
        stream, as :class:`~zero_offload.transport.sharded.ShardedDeviceRoute` does) and an event marks that point; :meth:`Pending.wait` then bounds the host's wait by ``timeout``.
        For CPU tensors (gloo) the work itself is waited for then, and ``tensors`` (every tensor ``launch`` hands
        the collective) are held until its worker has let go of them (see :class:`_Held`)."""
        self.check_usable(what, where)
        self.started += 1
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

"""ZeRO over a ``torch.distributed`` process group: the collectives a sharded :class:`~zero_offload.OffloadOptimizer`
runs, and its state gathered (``state_dict()``) or kept sharded (``torch.distributed.checkpoint``).

One bucket's journey with a group of N ranks (see :class:`zero_offload.buckets.ShardedBucket` for the layout):
its gradients are flattened and reduce-scattered (summed; the 1/N of the average is folded into the kernel's
gradient multiplier), from the backward hooks when streamed (:mod:`zero_offload.grad_stream`) or at ``step()``,
so each rank holds the sum for the shard it owns; the gradient statistics of all buckets (sum of squares, a
non-finite flag, and which parameters have a gradient on any rank) are combined in *one* all-reduce of a small
tensor per step; the kernel updates the shard; the updated shard is all-gathered into the full parameters while
the next bucket is updated. Every collective is started asynchronously (:meth:`Comm.start`) and waited for
with a timeout (:class:`Pending`), and a failure is re-raised naming this rank, the collective and the bucket,
so one rank dying cannot hang the others forever. After a failure the optimizer's :class:`Comm` is *broken*: it
starts and waits for no further collective (an error says why), and its process group is never destroyed, so
that the process can exit while a peer still holds a collective open (see :meth:`Comm._fail`).

``torch.distributed`` is imported here only, and only when a process group is used: ``import zero_offload`` stays
cheap.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import time
from copy import deepcopy
from itertools import chain
from numbers import Real
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from zero_offload import functional
from zero_offload.buckets import FlatBucket, ShardedBucket, view_like

__all__ = ["DEFAULT_TIMEOUT", "Comm", "GradStats", "Pending", "shard_pieces", "sharded_state_dict",
           "load_sharded_state_dict"]

# torch.distributed's own default for a process group's collectives.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


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


def shard_pieces(offset: int, numel: int, shard_numel: int, world: int) -> List[Tuple[int, int, int]]:
    """How a slot ``[offset, offset + numel)`` of a bucket cut into ``world`` shards of ``shard_numel`` elements is
    spread over the ranks: ``(rank, start within the slot, length)`` for each rank that owns a non-empty piece."""
    out = []
    for r in range(world):
        a, b = max(offset, r * shard_numel), min(offset + numel, (r + 1) * shard_numel)
        if b > a:
            out.append((r, a - offset, b - a))
    return out


@dataclasses.dataclass(frozen=True)
class GradStats:
    """One step's gradient statistics, combined over the group.

    Attributes:
        sq (float): sum of squares of the (averaged) gradient over every bucket.
        nonfinite (bool): some rank's shard holds an inf or nan.
    """

    sq: float
    nonfinite: bool


class Pending:
    """A collective in flight (see :meth:`Comm.start`). :meth:`wait` returns once it has completed, waiting at most
    the group's ``timeout``, and raises ``RuntimeError`` naming this rank, the collective and the bucket otherwise,
    or at once if the :class:`Comm` is broken. Waiting twice is free."""

    __slots__ = ("comm", "what", "where", "work", "event", "done")

    def __init__(self, comm: "Comm", what: str, where: str, work: Any, event: Any):
        self.comm, self.what, self.where, self.work, self.event = comm, what, where, work, event
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


class _HostReduceScatter:
    """A reduce-scatter of host tensors as gloo runs it: an all-reduce of a copy of the input, then this rank's
    part copied out. Gloo's own reduce-scatter work does the same, but its ``wait()`` ignores the timeout it is
    given and it never reports itself completed; this one keeps the all-reduce's work, which honours both (see
    :meth:`Comm._wait_work`), for the same cost."""

    __slots__ = ("work", "out", "part")

    def __init__(self, work: Any, out: torch.Tensor, part: torch.Tensor):
        self.work, self.out, self.part = work, out, part

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(timeout)
        self.out.copy_(self.part)
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
    """

    def __init__(self, group: Any, timeout: Union[datetime.timedelta, float], grads_reduced: bool):
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

    # -- collectives ---------------------------------------------------------------------------------------
    def start(self, what: str, where: str, launch: Callable[[], Any], on_device: bool) -> "Pending":
        """Issue a collective (``launch`` calls it with ``async_op=True``) without waiting for it. For CUDA tensors
        (``on_device``; NCCL, whatever else the group also runs) the current stream is made to wait for it
        (``Work.wait()`` does only that: the host goes on, and it must be called here, where that stream is
        current) and an event marks that point; :meth:`Pending.wait` then bounds the host's wait by ``timeout``.
        For CPU tensors (gloo) the work itself is waited for then."""
        self.check_usable(what, where)
        try:
            work = launch()
            event = None
            if on_device:
                work.wait()
                event = torch.cuda.Event()
                event.record()
        except Exception as exc:
            raise self._fail(what, where, exc) from exc
        return Pending(self, what, where, work, event)

    def _run(self, what: str, where: str, launch: Callable[[], Any], on_device: bool) -> None:
        self.start(what, where, launch, on_device).wait()

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
        return self._error(what, where, exc)

    def check_usable(self, what: str, where: str) -> None:
        """Raise ``RuntimeError`` if an earlier collective failed (:meth:`_fail`): none is started or waited for."""
        if self.failure is None:
            return
        raise RuntimeError(
            f"zero_offload: rank {self.rank} of {self.world}: {what} of {where} refused: an earlier collective "
            f"failed ({self.failure}), so this rank is out of step with the others and this optimizer runs no "
            "further collective. sharded_state_dict() still gives this rank's shard of the state (no collective); "
            "state_dict(), step() and clip_grad_norm_() cannot run. Build a new process group and optimizer to go "
            "on; this process group is not usable either (see the README's Limits)."
        )

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
        total, n = inp.clone(), out.numel()
        part = total[self.rank * n : (self.rank + 1) * n]
        return self.start("reduce_scatter", where, lambda: _HostReduceScatter(
            dist.all_reduce(total, group=self.group, async_op=True), out, part), False)

    def start_all_gather(self, out: torch.Tensor, inp: torch.Tensor, where: str) -> "Pending":
        return self.start("all_gather", where, lambda: self._ag(out, inp, group=self.group, async_op=True),
                          inp.is_cuda)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, where: str) -> None:
        self.start_all_gather(out, inp, where).wait()

    def broadcast(self, t: torch.Tensor, where: str) -> None:
        dist = _dist()
        self._run("broadcast", where, lambda: dist.broadcast(t, self.src, group=self.group, async_op=True),
                  t.is_cuda)

    def all_reduce(self, t: torch.Tensor, op: Any, where: str) -> None:
        dist = _dist()
        self._run("all_reduce", where, lambda: dist.all_reduce(t, op=op, group=self.group, async_op=True),
                  t.is_cuda)

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

    # -- construction --------------------------------------------------------------------------------------
    def check_same_params(self, tensors: Sequence[torch.Tensor], group_index: int) -> None:
        """Raise ``ValueError`` on every rank (so none is left waiting) unless all ranks give the same number of
        parameters with the same shapes, dtypes and device types: otherwise their flat buckets would not line
        up and the collectives would mix unrelated values."""
        dist = _dist()
        mine = [(tuple(p.shape), str(p.dtype).replace("torch.", ""), p.device.type) for p in tensors]
        everyone: List[Any] = [None] * self.world
        try:
            dist.all_gather_object(everyone, mine, group=self.group)
        except Exception as exc:
            raise RuntimeError(f"zero_offload: rank {self.rank} of {self.world}: comparing param group "
                               f"{group_index} across ranks failed: {exc}") from exc
        for r, theirs in enumerate(everyone):
            if theirs == everyone[0]:
                continue
            if len(theirs) != len(everyone[0]):
                detail = f"rank 0 has {len(everyone[0])} parameters, rank {r} has {len(theirs)}"
            else:
                k = next(k for k, (a, b) in enumerate(zip(everyone[0], theirs)) if a != b)
                detail = f"parameter {k} is {everyone[0][k]} (shape, dtype, device) on rank 0, {theirs[k]} on rank {r}"
            raise ValueError(f"OffloadOptimizer(process_group=...): param group {group_index} differs across ranks: "
                             f"{detail}. Every rank must pass the same parameters in the same order.")

    # -- a step's gradients --------------------------------------------------------------------------------
    def gather(self, plans: Sequence[Sequence[Tuple[FlatBucket, Any, Any]]],
               stream_for: Callable[[torch.device], Any], *, release: bool = False) -> GradStats:
        """Bring every bucket's reduced gradient shard to the host and combine the sum of squares, the non-finite
        flag and which parameters have a gradient in one all-reduce.

        A bucket whose gradients backward already reduce-scattered (``launched``, the same on every rank) is only
        waited for; the others' reduce-scatters are all started first (in plan order, the same on every rank),
        then waited for, so they overlap each other and the gradient copies. The all-reduce also carries each
        streamed bucket's ``stale`` flag: a gradient changed on some rank after its reduce-scatter (an in-place
        clip or unscale, or one assigned by hand), and every rank then reduce-scatters that bucket again from the
        gradients on the parameters, with a second all-reduce for the norm (impossible with ``release``, whose
        gradients are gone: an error on every rank)."""
        entries = list(chain.from_iterable(plans))
        for bucket, grads, _ in entries:
            if not bucket.launched:
                bucket.gather_grads(grads, None if bucket.on_cpu else stream_for(bucket.device))
        sqs, bads, present = self._shard_stats(entries)
        stale = [float(b.launched and b.stale) for b, _, _ in entries]
        dist = _dist()
        vals = self.all_reduce_host([sum(sqs), sum(bads), *present, *stale], dist.ReduceOp.SUM,
                                    "the gradient norm, non-finite check and gradient presence")
        k = 2
        for bucket, grads, _ in entries:
            bucket.set_present([v > 0 for v in vals[k : k + len(grads)]])
            k += len(grads)
        redo = [i for i, v in enumerate(vals[k:]) if v > 0]
        if not redo:
            return GradStats(vals[0], vals[1] > 0 or not math.isfinite(vals[0]))
        if release:
            raise RuntimeError(
                f"zero_offload: rank {self.rank} of {self.world}: a gradient was assigned or changed in place after "
                f"backward had reduce-scattered it (in {entries[redo[0]][0].where}), but release_grads=True dropped "
                "the others', so it cannot be reduced again. Clip with optimizer.clip_grad_norm_ and do not edit "
                "gradients after backward, or pass release_grads=False. Nothing was updated."
            )
        for i in redo:
            bucket, grads, _ = entries[i]
            again = [bucket.params[j].grad if g is True else g for j, g in enumerate(grads)]
            bucket.gather_grads(again, None if bucket.on_cpu else stream_for(bucket.device))
        redone = self._shard_stats([entries[i] for i in redo])
        for j, i in enumerate(redo):
            sqs[i], bads[i] = redone[0][j], redone[1][j]
        sq, bad = self.all_reduce_host([sum(sqs), sum(bads)], dist.ReduceOp.SUM,
                                       "the gradient norm and non-finite check, after reducing again")
        return GradStats(sq, bad > 0 or not math.isfinite(sq))

    @staticmethod
    def _shard_stats(entries: Sequence[Tuple[FlatBucket, Any, Any]]) -> Tuple[List[float], List[float], List[float]]:
        """Wait for each bucket's shard; its sum of squares (of the averaged gradient), non-finite flag, and per
        parameter whether this rank has a gradient."""
        sqs, bads, present = [], [], []
        for bucket, grads, _ in entries:
            bucket.wait_grads()
            s, nonfinite = functional.grad_sq_norm(bucket.grad)
            sqs.append(s * bucket.grad_multiplier**2)
            bads.append(float(nonfinite))
            present += [0.0 if g is None else 1.0 for g in grads]
        return sqs, bads, present

    def total_norm(self, plans: Sequence[Sequence[Tuple[FlatBucket, Any, Any]]], norm_type: float,
                   stats: GradStats) -> Tuple[float, bool]:
        """``clip_grad_norm_``'s total norm of the averaged gradient over the group: the 2-norm from ``stats``
        (no further collective), other norms with one more all-reduce. Returns ``(norm, nonfinite)``."""
        if norm_type == 2.0:
            return math.sqrt(stats.sq), stats.nonfinite
        dist = _dist()
        buckets = [b for b, _, _ in chain.from_iterable(plans) if b.grad.numel()]
        # Padding is zero in the gradient buffers, so it changes neither a max nor a p-norm.
        if norm_type == math.inf:
            local = max((float(b.grad.abs().max()) * b.grad_multiplier for b in buckets), default=0.0)
            total = self.all_reduce_host([local], dist.ReduceOp.MAX, "the gradient inf-norm")[0]
        else:
            local = sum(float(torch.linalg.vector_norm(b.grad.double() * b.grad_multiplier, norm_type)) ** norm_type
                        for b in buckets)
            total = self.all_reduce_host([local], dist.ReduceOp.SUM, f"the gradient {norm_type}-norm")[0]
            total = total ** (1.0 / norm_type)
        return total, stats.nonfinite or not math.isfinite(total)

    # -- full state --------------------------------------------------------------------------------------------
    def full_state(self, buckets_per_group: Sequence[Sequence[ShardedBucket]],
                   param_groups: Sequence[Dict[str, Any]]) -> Dict[int, Dict[str, torch.Tensor]]:
        """Every parameter's state in ``torch.optim.AdamW``'s format (parameter-shaped), gathered bucket by bucket
        onto every rank; keyed by the parameter's index over all groups, as ``Optimizer.state_dict()`` packs it."""
        index: Dict[int, int] = {}
        for p in chain.from_iterable(g["params"] for g in param_groups):
            index.setdefault(id(p), len(index))
        out: Dict[int, Dict[str, torch.Tensor]] = {}
        for bucket in chain.from_iterable(buckets_per_group):
            if not any(bucket.exposed):  # the same on every rank: exposure follows the agreed presence
                continue
            names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if bucket.max_exp_avg_sq is not None else [])
            names += ["master"] if bucket.low_precision else []
            full = {}
            for name in names:
                full[name] = torch.empty(bucket.full.padded_numel, dtype=torch.float32)
                self.all_gather_host(full[name], getattr(bucket, name), f"state '{name}' of {bucket.where}")
            for i, p in enumerate(bucket.params):
                if bucket.exposed[i]:
                    entry = {"step": bucket.steps[i].clone()}
                    entry.update((n, view_like(full[n], bucket.full.offsets[i], p)) for n in names)
                    out[index[id(p)]] = entry
        return out


# ---------------------------------------------------------------------------------- torch.distributed.checkpoint --
def _state_pieces(bucket: FlatBucket, i: int) -> Dict[str, torch.Tensor]:
    """Parameter ``i``'s state tensors that this rank holds, 1-D in slot order (flat ranges of the buffers, so that
    loading into them writes the optimizer's state in place)."""
    if bucket.sharded:
        a, b = bucket.pieces[i]
    else:
        a = bucket.layout.offsets[i]
        b = a + bucket.layout.numels[i]
    names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if bucket.max_exp_avg_sq is not None else [])
    names += ["master"] if bucket.low_precision else []
    return {n: getattr(bucket, n)[a:b] for n in names}


def _sharded_tensor(local: torch.Tensor, bucket: ShardedBucket, i: int):
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    comm = bucket.comm
    numel = bucket.full.numels[i]
    pieces = {r: (start, n) for r, start, n in shard_pieces(bucket.full.offsets[i], numel, bucket.shard_numel,
                                                               comm.world)}
    # A rank that owns nothing of this parameter still gets a shard, empty, at the end: DCP's loader drops a
    # ShardedTensor without local shards from the rank's plan and then reports its key missing.
    metas = [ShardMetadata(shard_offsets=[pieces.get(r, (numel, 0))[0]], shard_sizes=[pieces.get(r, (numel, 0))[1]],
                           placement=f"rank:{r}/cpu") for r in range(comm.world)]
    mine = [Shard(local, m) for m in metas if m.placement.rank() == comm.rank]
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size([numel]), tensor_properties=props)
    # Global metadata is known from the layout on every rank, so no collective is needed to build it.
    return ShardedTensor._init_from_local_shards_and_global_metadata(mine, meta, process_group=comm.group)


def sharded_state_dict(opt) -> Dict[str, Any]:
    """See :meth:`zero_offload.OffloadOptimizer.sharded_state_dict`."""
    index = 0
    state: Dict[str, Dict[str, Any]] = {}
    groups = []
    for group, buckets in zip(opt.param_groups, opt._buckets):
        position = {id(p): index + k for k, p in enumerate(group["params"])}
        groups.append({**{k: deepcopy(v) for k, v in group.items() if k != "params"},
                       "params": list(range(index, index + len(group["params"])))})
        index += len(group["params"])
        for bucket in buckets:
            for i, p in enumerate(bucket.params):
                entry: Dict[str, Any] = {"step": bucket.steps[i].clone()}
                for name, local in _state_pieces(bucket, i).items():
                    if bucket.sharded and bucket.full.numels[i]:
                        entry[name] = _sharded_tensor(local, bucket, i)
                    else:
                        entry[name] = local  # the whole parameter: an ordinary tensor
                state[str(position[id(p)])] = entry
    return {"state": state, "param_groups": groups}


def load_sharded_state_dict(opt, state_dict: Dict[str, Any]) -> None:
    """See :meth:`zero_offload.OffloadOptimizer.load_sharded_state_dict`."""
    from zero_offload.optimizer import _check_hparams

    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("load_sharded_state_dict expects the dict from sharded_state_dict(), filled by "
                         "torch.distributed.checkpoint.load")
    saved_groups, state = state_dict["param_groups"], state_dict["state"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"loaded sharded state dict has {len(saved_groups)} parameter groups, this optimizer has "
                         f"{len(opt.param_groups)}")
    new_groups = []
    for gi, (g, sg) in enumerate(zip(opt.param_groups, saved_groups)):
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(f"loaded sharded state dict, param group {gi}: {len(sg['params'])} parameters, this "
                             f"optimizer's group has {len(g['params'])}")
        ng = {k: v for k, v in sg.items() if k != "params"}
        for k, v in g.items():
            ng.setdefault(k, v)
        try:
            _check_hparams(ng["lr"], ng["betas"], ng["eps"], ng["weight_decay"])
        except ValueError as exc:
            raise ValueError(f"loaded sharded state dict, param group {gi}: {exc}") from None
        if bool(ng["amsgrad"]) != bool(g["amsgrad"]):
            raise ValueError(f"loaded sharded state dict, param group {gi}: amsgrad={ng['amsgrad']}, this optimizer "
                             f"has amsgrad={g['amsgrad']} (the state layout differs; build it with the same amsgrad)")
        ng["params"] = g["params"]
        ng["capturable"] = ng["differentiable"] = False
        new_groups.append(ng)
    steps: Dict[Tuple[int, int], float] = {}
    index = 0
    for group, buckets in zip(opt.param_groups, opt._buckets):
        position = {id(p): index + k for k, p in enumerate(group["params"])}
        index += len(group["params"])
        for bi, bucket in enumerate(buckets):
            for i, p in enumerate(bucket.params):
                key = str(position[id(p)])
                entry = state.get(key)
                if not isinstance(entry, dict) or "step" not in entry:
                    raise ValueError(f"loaded sharded state dict has no state for parameter {key}")
                step = entry["step"]
                step = float(step.item()) if isinstance(step, torch.Tensor) and step.numel() == 1 else step
                if not isinstance(step, Real) or not math.isfinite(step) or step < 0 or step != int(step):
                    raise ValueError(f"loaded sharded state dict, parameter {key}: invalid step {entry['step']!r}")
                steps[(id(bucket), i)] = float(step)
    opt._drop_delayed()  # dcp.load has already replaced the state it would update
    opt._synchronize()
    opt._pending = None
    for bucket in chain.from_iterable(opt._buckets):
        for i, p in enumerate(bucket.params):
            step = steps[(id(bucket), i)]
            bucket.steps[i] = step
            bucket.exposed[i] = step > 0
            if step > 0:
                opt.state[p] = bucket.state_entry(i)
            else:
                opt.state.pop(p, None)
            if bucket.separate_master:
                # A master loaded with the state is kept while the parameter still rounds from it (see
                # FlatBucket.refresh_masters); a parameter never stepped takes its master from the parameter.
                bucket.versions[i] = p._version if step > 0 and bucket.low_precision else -1
        bucket.all_exposed = all(bucket.exposed)
    opt.param_groups = new_groups

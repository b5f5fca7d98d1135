"""Flattening parameters into aligned, contiguous host buckets: where each parameter's master weights, moments,
gradient and low-precision copy live, and how a bucket's gradients get in and its updated parameters get out.

A bucket is a run of parameters of one parameter group that share a device and a dtype. Each parameter gets a
slot in every flat buffer of the bucket at the same offset, a multiple of :data:`ALIGN` elements, so that

* the CPU-Adam kernel updates a whole bucket (or a contiguous run of it) in one call, whatever the number of
  tensors, and every slot starts on a 64-byte line for every dtype;
* the per-parameter optimizer state PyTorch exposes (``exp_avg`` and friends) are views of those slots, shaped
  and strided like the parameter, so ``state_dict()`` has ``torch.optim.AdamW``'s format without a copy;
* a CPU parameter can itself become a view of its slot (the fp32 master, or the low-precision copy the kernel
  writes), so the update needs no copy back.

Padding elements are zero in every buffer and see a zero gradient, so they stay zero (unless ``eps == 0``, when
they become NaN; they are never read).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import operator
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload.host_memory import HostMemoryEstimate, empty_host, estimate_bucket

__all__ = ["ALIGN", "BucketLayout", "FlatBucket", "ShardedBucket", "plan_buckets", "align_up", "view_like",
           "memory_order_flat"]

# Elements. 64 elements is a whole number of 64-byte cache lines for 1-, 2- and 4-byte dtypes and a multiple of
# every SIMD width the kernel uses, so no slot shares a line or a vector with its neighbour.
ALIGN = 64

# Tensors at least this large are copied with torch's own intra-op parallelism; smaller ones are spread over a
# few Python threads instead (torch runs them on the calling thread). Same value as at::internal::GRAIN_SIZE.
_PARALLEL_COPY_NUMEL = 32768


def align_up(n: int, alignment: int = ALIGN) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Where the parameters of one bucket live in its flat buffers.

    Attributes:
        indices (Tuple[int, ...]): positions of the bucket's parameters in their group's ``params`` list.
        offsets (Tuple[int, ...]): element offset of each parameter's slot, multiples of :data:`ALIGN`.
        numels (Tuple[int, ...]): elements of each parameter.
        padded_numel (int): length of each flat buffer.
        device (torch.device): where the parameters live.
        dtype (torch.dtype): the parameters' dtype (and their gradients').
    """

    indices: Tuple[int, ...]
    offsets: Tuple[int, ...]
    numels: Tuple[int, ...]
    padded_numel: int
    device: torch.device
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def span(self, first: int, last: int) -> Tuple[int, int]:
        """Element range covering parameters ``first..last`` (bucket positions, inclusive), padding included."""
        end = self.offsets[last + 1] if last + 1 < len(self.offsets) else self.padded_numel
        return self.offsets[first], end


def plan_buckets(params: Sequence[torch.Tensor], max_numel: int) -> List[BucketLayout]:
    """Split one group's parameters into buckets: one per (device, dtype), in order of first appearance, each cut
    where it would exceed ``max_numel`` elements (a larger parameter gets a bucket to itself; parameters are never
    split). Within a bucket, parameters keep their group order.

    Args:
        params (Sequence[Tensor]): the group's parameters.
        max_numel (int): soft cap on a bucket's elements.
    """
    by_kind: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
    for i, p in enumerate(params):
        by_kind.setdefault((p.device, p.dtype), []).append(i)
    layouts = []
    for (device, dtype), indices in by_kind.items():
        run: List[int] = []
        offsets: List[int] = []
        cursor = 0
        for i in indices:
            n = params[i].numel()
            if run and cursor + n > max_numel:
                layouts.append(_layout(run, offsets, params, cursor, device, dtype))
                run, offsets, cursor = [], [], 0
            run.append(i)
            offsets.append(cursor)
            cursor += align_up(n)
        if run:
            layouts.append(_layout(run, offsets, params, cursor, device, dtype))
    return layouts


def _layout(run, offsets, params, cursor, device, dtype) -> BucketLayout:
    return BucketLayout(tuple(run), tuple(offsets), tuple(params[i].numel() for i in run), cursor, device, dtype)


def view_like(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The slot of ``like`` in ``flat``, with ``like``'s shape and, when ``like`` is dense (e.g. channels-last),
    its strides too: the optimizer state then has the parameter's memory format, as ``torch.zeros_like`` gives
    AdamW, and gradient copies into the slot are straight memory copies."""
    n = like.numel()
    if like.is_contiguous() or not _dense(like):
        return flat[offset : offset + n].view(like.shape)
    return flat.as_strided(like.shape, like.stride(), flat.storage_offset() + offset)


def memory_order_flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a 1-D tensor in the order :func:`view_like` lays them out in a slot: memory order for
    a dense tensor (a view), logical order otherwise (a copy when ``t`` is not contiguous)."""
    if t.is_contiguous() or not _dense(t):
        return t.reshape(-1)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements exactly fill ``t.numel()`` consecutive memory slots in some dimension order."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


_pool: Optional[ThreadPoolExecutor] = None


_get_grad = operator.attrgetter("grad")
_get_layout = operator.attrgetter("layout")


def _copy_pool(workers: int) -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool._max_workers < workers:  # noqa: SLF001 - sized once, grown if threads are raised
        _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zero_offload_copy")
    return _pool


def copy_many_(dsts: List[torch.Tensor], srcs: List[torch.Tensor], numels: Sequence[int]) -> None:
    """``dst.copy_(src)`` for CPU pairs (``numels[i]`` elements each), using every intra-op thread even when the
    tensors are small.

    Torch parallelises one copy only above its grain size, so thousands of small gradient copies would run on
    one core; here they are split into equal-element shares over ``torch.get_num_threads()`` threads (torch ops
    release the GIL). Large tensors are copied afterwards on the calling thread with torch's own parallelism, so
    the two kinds never oversubscribe the cores.
    """
    if any(n >= _PARALLEL_COPY_NUMEL for n in numels):
        small = [i for i, n in enumerate(numels) if n < _PARALLEL_COPY_NUMEL]
        large = [i for i, n in enumerate(numels) if n >= _PARALLEL_COPY_NUMEL]
    else:
        small, large = list(range(len(numels))), []
    threads = torch.get_num_threads()
    cum = list(itertools.accumulate(numels[i] for i in small))
    if threads > 1 and len(small) > 16 and cum[-1] >= 4 * _PARALLEL_COPY_NUMEL:
        cuts = [0] + [bisect.bisect_left(cum, cum[-1] * k / threads) for k in range(1, threads)] + [len(small)]
        shares = [small[a:b] for a, b in zip(cuts, cuts[1:])]
        pool = _copy_pool(threads - 1)
        futures = [pool.submit(_copy_share, dsts, srcs, share) for share in shares[1:] if share]
        _copy_share(dsts, srcs, shares[0])
        for f in futures:
            f.result()
    else:
        _copy_share(dsts, srcs, small)
    _copy_share(dsts, srcs, large)


def _copy_share(dsts: List[torch.Tensor], srcs: List[torch.Tensor], which: Sequence[int]) -> None:
    if which:
        torch._foreach_copy_([dsts[i] for i in which], [srcs[i] for i in which])


class FlatBucket:
    """The host buffers of one bucket, the per-parameter views into them, and the transfers in and out.

    Buffers (each ``layout.padded_numel`` long): ``master`` (fp32), ``exp_avg``, ``exp_avg_sq``, optionally
    ``max_exp_avg_sq`` (fp32), ``grad`` (the parameters' dtype) and, for low-precision parameters, ``staging``
    (the parameters' dtype: the kernel's ``param_out``).

    Where the parameter itself lives:

    * fp32 on CPU: the parameter *is* its master slot (``p.data`` is rebound to the view); no copy, no
      separate master, no ``"master"`` key in the state.
    * bf16/fp16 on CPU: the parameter is its staging slot, which the kernel writes; the fp32 master is separate.
    * on CUDA: the parameter stays where it is; gradients are copied to ``grad`` and the master (fp32) or the
      staging copy (low precision) is copied back, asynchronously on a side stream.

    A separate master is (re)initialised from its parameter before the parameter's next update whenever the
    parameter was changed outside the optimizer (tracked by its autograd version counter) and no longer equals
    the master rounded to its dtype: loading a model checkpoint after building the optimizer just works.
    """

    sharded = False  # see ShardedBucket
    # Multiplies the gradient in the kernel, on top of the loss-scale inverse and clip coefficient.
    grad_multiplier = 1.0
    h2d_event = None  # torch.cuda.Event after the bucket's last upload (see OffloadOptimizer._upload)
    grad_prev: Optional[torch.Tensor] = None  # delayed_update's second gradient buffer

    def __init__(self, layout: BucketLayout, params: Sequence[torch.Tensor], *, amsgrad: bool, pin: bool):
        self.layout = layout
        self.params: List[torch.Tensor] = [params[i] for i in layout.indices]
        self.device = layout.device
        self.dtype = layout.dtype
        self.on_cpu = layout.device.type == "cpu"
        self.low_precision = layout.dtype != torch.float32
        self.pin = pin
        n = layout.padded_numel

        def zeros(dtype: torch.dtype) -> torch.Tensor:
            return empty_host(n, dtype, pin=pin).zero_()

        self.master = zeros(torch.float32)
        self.exp_avg = zeros(torch.float32)
        self.exp_avg_sq = zeros(torch.float32)
        self.max_exp_avg_sq: Optional[torch.Tensor] = zeros(torch.float32) if amsgrad else None
        self.grad = zeros(layout.dtype)
        self.staging: Optional[torch.Tensor] = zeros(layout.dtype) if self.low_precision else None
        # Per-parameter step counts in one tensor: state["step"] is a 0-dim view of an element, so counting a step
        # for a whole bucket is one add, and state_dict() still shows AdamW's 0-dim float32 CPU tensors.
        self.steps = torch.zeros(len(self.params), dtype=torch.float32)

        offs = layout.offsets
        self.master_views = [view_like(self.master, o, p) for o, p in zip(offs, self.params)]
        self.exp_avg_views = [view_like(self.exp_avg, o, p) for o, p in zip(offs, self.params)]
        self.exp_avg_sq_views = [view_like(self.exp_avg_sq, o, p) for o, p in zip(offs, self.params)]
        self.max_views = self._views(self.max_exp_avg_sq)
        self.grad_views = [view_like(self.grad, o, p) for o, p in zip(offs, self.params)]
        self.slot_contiguous = [v.is_contiguous() for v in self.grad_views]
        self.all_slots_contiguous = all(self.slot_contiguous)
        self.staging_views = self._views(self.staging)
        # Whether each grad slot is known to hold zeros: a parameter without a gradient must not leave a stale one
        # in the buffer, which norms and non-finite checks read whole.
        self.grad_slot_zero = [True] * len(self.params)
        # Each parameter's autograd version right after the optimizer last wrote it (or initialised its master
        # from it); -1 = master not initialised. Unused when the parameter is its own master.
        self.versions = [-1] * len(self.params)
        self.exposed = [False] * len(self.params)
        self.all_exposed = False
        self.d2h_event = None  # torch.cuda.Event once a CUDA gather has run
        self.slot_ptrs: List[int] = []  # data_ptr of each CPU parameter's slot, once bound

    # -- layout --------------------------------------------------------------------------------------------------
    def _views(self, flat: Optional[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        if flat is None:
            return None
        return [view_like(flat, o, p) for o, p in zip(self.layout.offsets, self.params)]

    @property
    def separate_master(self) -> bool:
        """Whether the fp32 master is a copy (low precision or CUDA) rather than the parameter itself."""
        return not (self.on_cpu and not self.low_precision)

    def ensure_amsgrad(self) -> None:
        if self.max_exp_avg_sq is None:
            self.max_exp_avg_sq = empty_host(self.layout.padded_numel, torch.float32, pin=self.pin).zero_()
            self.max_views = self._views(self.max_exp_avg_sq)

    def estimate(self) -> HostMemoryEstimate:
        return estimate_bucket(self.layout.numel, self.layout.padded_numel, self.dtype, on_cpu=self.on_cpu,
                               amsgrad=self.max_exp_avg_sq is not None, pin=self.pin,
                               delayed_update=self.grad_prev is not None)

    def buffers(self) -> Dict[str, torch.Tensor]:
        out = {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "grad": self.grad}
        if self.max_exp_avg_sq is not None:
            out["max_exp_avg_sq"] = self.max_exp_avg_sq
        if self.staging is not None:
            out["staging"] = self.staging
        if self.grad_prev is not None:
            out["grad_prev"] = self.grad_prev
        return out

    @property
    def param_slots(self) -> Optional[List[torch.Tensor]]:
        """For CPU buckets, the views the parameters are bound to (master or staging); None on CUDA."""
        if not self.on_cpu:
            return None
        return self.staging_views if self.low_precision else self.master_views

    def bind(self) -> None:
        """Make CPU parameters views of the slots the kernel writes. Called once every bucket of a group has
        been allocated, so a failed allocation leaves the parameters untouched. Values are copied in first, so the
        model is unchanged, and a later in-place load into a parameter lands in its slot."""
        if self.on_cpu:
            for p, slot in zip(self.params, self.param_slots):
                slot.copy_(p.detach())
                p.data = slot
            self.slot_ptrs = [slot.data_ptr() for slot in self.param_slots]

    # -- state -----------------------------------------------------------------------------------------------
    def state_entry(self, i: int) -> Dict[str, torch.Tensor]:
        """Parameter ``i``'s optimizer state in AdamW's format: views, not copies."""
        entry = {"step": self.steps[i], "exp_avg": self.exp_avg_views[i], "exp_avg_sq": self.exp_avg_sq_views[i]}
        if self.max_views is not None:
            entry["max_exp_avg_sq"] = self.max_views[i]
        if self.low_precision:
            entry["master"] = self.master_views[i]
        return entry

    def refresh_masters(self, indices: Sequence[int]) -> None:
        """(Re)initialise the separate masters of ``indices`` whose parameter changed since the optimizer last
        wrote it; see the class docstring."""
        if not self.separate_master:
            return
        stale = [i for i in indices if self.params[i]._version != self.versions[i]]
        if not stale:
            return
        # The parameter's bits land in its own-dtype host slot first (staging for low precision, else the master),
        # in one batch of async copies and one wait; the upcast to the fp32 master then runs on the host.
        landing = self.staging_views if self.low_precision else self.master_views
        if self.on_cpu:
            host = [self.params[i].detach() for i in stale]
        else:
            # Into a scratch copy when the master may be kept: it is compared before being overwritten.
            host = [landing[i] if self.versions[i] == -1 else torch.empty_like(landing[i]) for i in stale]
            torch._foreach_copy_(host, [self.params[i].detach() for i in stale], non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        for i, value in zip(stale, host):
            master = self.master_views[i]
            # A parameter rewritten with the value it already had (a model checkpoint loaded alongside this
            # optimizer's) keeps the fp32 master's extra bits; any other value replaces the master.
            if self.versions[i] == -1 or not torch.equal(master.to(self.dtype), value):
                master.copy_(value)
            self.versions[i] = self.params[i]._version

    def record_versions(self, indices: Sequence[int]) -> None:
        if self.separate_master:
            for i in indices:
                self.versions[i] = self.params[i]._version

    # -- gradients in ----------------------------------------------------------------------------------------
    def collect_grads(self) -> List[Optional[torch.Tensor]]:
        """Each parameter's ``.grad`` (None where absent), checked for what the kernel cannot take. On the hot
        path: C-level loops only (``map``, list comparison), about 0.2 us per parameter."""
        params = self.params
        grads = list(map(_get_grad, params))
        if self.on_cpu:
            moved = list(map(torch.Tensor.data_ptr, params)) != self.slot_ptrs
        else:
            moved = any(p.dtype != self.dtype or p.device != self.device for p in params)
        if moved:
            p = next(p for i, p in enumerate(params) if self._moved(i))
            raise RuntimeError(
                f"OffloadOptimizer: a parameter of shape {tuple(p.shape)} no longer lives where the optimizer put it "
                f"(expected {self.dtype} on {self.device}; its storage, dtype or device was replaced, e.g. by "
                "`p.data = ...`, `model.to(...)` or another optimizer). Move or cast the model first, then build the "
                "optimizer."
            )
        if all(map(operator.is_, grads, self.grad_views)):
            return grads  # every gradient already is its slot: dense, nothing more to check
        # Only a gradient that is not already its slot can be sparse.
        others = [g for g, v in zip(grads, self.grad_views) if g is not v and g is not None]
        if set(map(_get_layout, others)) <= {torch.strided}:
            return grads
        for g in others:
            if g.layout != torch.strided:
                p = params[next(i for i, x in enumerate(grads) if x is g)]
                raise RuntimeError(
                    f"OffloadOptimizer does not support sparse gradients (parameter of shape {tuple(p.shape)} has a "
                    f"{g.layout} gradient); consider torch.optim.SparseAdam"
                )
        return grads

    def _moved(self, i: int) -> bool:
        p = self.params[i]
        if self.on_cpu:
            return p.data_ptr() != self.slot_ptrs[i]
        return p.dtype != self.dtype or p.device != self.device

    def gather_grads(self, grads: List[Optional[torch.Tensor]], stream=None, into_slots: bool = False
                     ) -> Optional[List[Optional[torch.Tensor]]]:
        """Make the gradients readable by the kernel. On CUDA, enqueue async copies into the flat ``grad`` buffer on
        ``stream`` and record ``d2h_event`` (wait with :meth:`wait_grads`); returns None.

        On CPU, returns None when the flat buffer already holds every gradient (each is its slot, or absent);
        otherwise the tensors the kernel reads in place, one per parameter (None where absent): the gradient
        itself where it is contiguous like its slot, else the slot's flat range after a copy into it (a
        channels-last or transposed gradient). Copying fresh gradients into the buffer first would add 8 bytes of
        memory traffic per element to the update's 28.

        ``into_slots`` (streamed buckets, see :mod:`zero_offload.grad_stream`): CPU gradients are copied into the
        buffer too, and an entry ``True`` means the gradient is in its slot already."""
        views, zeroed, numels = self.grad_views, self.grad_slot_zero, self.layout.numels
        if all(map(operator.is_, grads, views)):
            # The zero_grad(set_to_none=False) steady state: backward accumulated into the slots already.
            self.grad_slot_zero = [False] * len(views)
            return None
        if self.on_cpu and not into_slots and any(g is not None and g is not v for g, v in zip(grads, views)):
            return self._grads_in_place(grads)
        dsts, srcs, sizes = [], [], []
        for i, g in enumerate(grads):
            if g is None:
                if not zeroed[i]:
                    views[i].zero_()
                    zeroed[i] = True
            elif g is True or g is views[i]:  # streamed already, or a view from zero_grad(set_to_none=False)
                zeroed[i] = False
            else:
                zeroed[i] = False
                dsts.append(views[i])
                srcs.append(g)
                sizes.append(numels[i])
        if self.on_cpu:
            if dsts:
                copy_many_(dsts, srcs, sizes)
            return None  # every gradient is in its slot or absent; absent ones' slots now hold zeros
        if self.d2h_event is None:
            self.d2h_event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            if dsts:
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
            self.d2h_event.record(stream)
        return None

    def _grads_in_place(self, grads: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        flat, offsets, numels, views = self.grad, self.layout.offsets, self.layout.numels, self.grad_views
        # The usual case, checked in C-level loops: every gradient fresh, present and contiguous like its slot.
        if (self.all_slots_contiguous and not any(map(operator.is_, grads, itertools.repeat(None)))
                and not any(map(operator.is_, grads, views)) and all(map(torch.Tensor.is_contiguous, grads))):
            return grads
        out: List[Optional[torch.Tensor]] = []
        dsts, srcs, sizes = [], [], []
        for i, g in enumerate(grads):
            if g is None:
                out.append(None)
            elif g is not views[i] and self.slot_contiguous[i] and g.is_contiguous():
                out.append(g)
            else:
                # The state's slots have the parameter's memory order; a gradient in any other order (or already
                # in its slot) is read from the slot, whose flat range is in that order.
                if g is not views[i]:
                    dsts.append(views[i])
                    srcs.append(g)
                    sizes.append(numels[i])
                self.grad_slot_zero[i] = False
                out.append(flat[offsets[i] : offsets[i] + numels[i]])
        if dsts:
            copy_many_(dsts, srcs, sizes)
        return out

    def add_grad_prev(self) -> None:
        """Allocate the second gradient buffer of ``delayed_update`` (see :meth:`swap_grad_buffers`)."""
        if self.grad_prev is None:
            self.grad_prev = empty_host(self.layout.padded_numel, self.dtype, pin=self.pin).zero_()
            self._prev_views = [view_like(self.grad_prev, o, p) for o, p in zip(self.layout.offsets, self.params)]
            self._prev_zero = [True] * len(self.params)

    def swap_grad_buffers(self) -> None:
        """Exchange the gradient buffer with the second one: ``delayed_update`` updates from one step's gradients
        while the next backward fills the other."""
        self.add_grad_prev()
        self.grad, self.grad_prev = self.grad_prev, self.grad
        self.grad_views, self._prev_views = self._prev_views, self.grad_views
        self.grad_slot_zero, self._prev_zero = self._prev_zero, self.grad_slot_zero

    def wait_grads(self) -> None:
        if self.d2h_event is not None:
            self.d2h_event.synchronize()

    def wait_params(self) -> None:
        """Nothing to wait for here: uploads are stream-ordered (see ``ShardedBucket.wait_params``)."""

    def zero_grads_as_views(self) -> None:
        """``zero_grad(set_to_none=False)`` for a CPU bucket: every existing gradient becomes its (zeroed) slot of
        the flat buffer, so the next backward accumulates straight into it and the step copies nothing."""
        self.grad.zero_()
        for i, p in enumerate(self.params):
            g = p.grad
            if g is not None:
                self.grad_slot_zero[i] = True
                if g is not self.grad_views[i]:
                    p.grad = self.grad_views[i]

    def runs(self, grads: List[Optional[torch.Tensor]]) -> List[Tuple[int, int, int]]:
        """Contiguous runs ``(first, last, step)`` of parameters that have a gradient and the same step count:
        each is one kernel call. Usually one run covering the whole bucket."""
        steps = self.steps.tolist()
        has = [g is not None for g in grads]
        if all(has) and min(steps) == max(steps):
            return [(0, len(grads) - 1, int(steps[0]))]
        out: List[Tuple[int, int, int]] = []
        first = None
        for i, present in enumerate(has):
            if first is not None and (not present or steps[i] != steps[first]):
                out.append((first, i - 1, int(steps[first])))
                first = None
            if present and first is None:
                first = i
        if first is not None:
            out.append((first, len(grads) - 1, int(steps[first])))
        return out

    # -- parameters out ----------------------------------------------------------------------------------------
    def scatter_params(self, indices: Sequence[int], stream=None) -> None:
        """Make the updated values visible in the parameters ``indices``: on CUDA, async copies of the master or
        the staging copy on ``stream``; on CPU, where the kernel already wrote the parameter's storage, only the
        autograd version bump an in-place op would have made (so a stale saved tensor is still caught)."""
        params = self.params if len(indices) == len(self.params) else [self.params[i] for i in indices]
        if self.on_cpu:
            torch.autograd.graph.increment_version(params)
        else:
            srcs = self.staging_views if self.low_precision else self.master_views
            # no_grad here, not at the callers: grad mode is per thread, and overlap_step uploads from its worker.
            with torch.no_grad(), torch.cuda.stream(stream):
                torch._foreach_copy_(params, [srcs[i] for i in indices], non_blocking=True)
        self.record_versions(indices)


class ShardedBucket(FlatBucket):
    """A bucket whose optimizer state is sharded over the ranks of a process group (ZeRO).

    The bucket's full flat layout (``full``) is padded to a multiple of ``world * ALIGN`` elements and cut into
    ``world`` equal contiguous shards of ``S`` elements (a multiple of :data:`ALIGN`); rank ``r`` owns
    ``[r * S, (r + 1) * S)``. A parameter may straddle shard boundaries, and a rank may own only padding. The host
    state buffers (``master``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), the host gradient ``grad`` and,
    on CUDA, ``staging`` hold that shard only: 12 / world bytes of fp32 state per parameter on each rank.

    ``layout`` describes the shard in the coordinates the optimizer's update loop uses: same parameters, each with
    its *piece* (the part of its slot inside the shard, possibly empty) at a shard-local offset, and
    ``padded_numel == S``. So ``layout.span``, the flat buffers, the per-parameter views (1-D pieces) and the
    kernel calls of :class:`FlatBucket` all work unchanged on the shard; this class replaces how gradients come in
    (flattened, then reduce-scattered or, when they are already reduced, sliced) and how parameters go out (the
    updated shard is all-gathered into the full parameters).

    * On CPU the parameters are views of one full flat buffer ``flat_param`` (the rank's slice of it *is* the fp32
      master, or the bf16/fp16 ``staging`` the kernel writes), and gradients are copied into (or, after
      ``zero_grad(set_to_none=False)``, accumulated in) a full flat buffer ``flat_grad`` that the reduce-scatter
      reads.
    * On CUDA the parameters stay where they are; gradients are flattened into a transient device buffer, the
      reduce-scatter leaves the owned shard on the device and only that shard is copied to pinned host memory;
      the updated shard goes up and is all-gathered into a transient device buffer copied into the parameters.

    Every rank must call the collectives in the same order: which parameters have a gradient is agreed over the
    group before the update (:meth:`set_present`), so every rank runs the same buckets.

    Args:
        layout (BucketLayout): the bucket as :func:`plan_buckets` made it (unsharded).
        params (Sequence[Tensor]): the group's parameters.
        amsgrad (bool): allocate ``max_exp_avg_sq``.
        pin (bool): page-lock the host shard buffers (they take part in device copies); ignored on CPU.
        comm: the group's collectives (``zero_offload.distributed.Comm``).
        where (str): "param group G, bucket B", for error messages.
    """

    sharded = True

    def __init__(self, layout: BucketLayout, params: Sequence[torch.Tensor], *, amsgrad: bool, pin: bool, comm,
                 where: str):
        world, rank = comm.world, comm.rank
        padded = align_up(layout.padded_numel, ALIGN * world)
        shard = padded // world
        lo = rank * shard
        self.comm, self.where = comm, where
        self.full = dataclasses.replace(layout, padded_numel=padded)
        self.shard_lo, self.shard_numel = lo, shard
        # Each parameter's piece: [a, b) in the shard, starting at element `src` of the parameter's slot.
        pieces = [(min(max(o - lo, 0), shard), min(max(o + n - lo, 0), shard))
                  for o, n in zip(layout.offsets, layout.numels)]
        self.pieces = pieces
        self.piece_src = [a + lo - o for (a, _), o in zip(pieces, layout.offsets)]
        self.layout = BucketLayout(layout.indices, tuple(a for a, _ in pieces), tuple(b - a for a, b in pieces),
                                   shard, layout.device, layout.dtype)
        self.params = [params[i] for i in layout.indices]
        self.device, self.dtype = layout.device, layout.dtype
        self.on_cpu = layout.device.type == "cpu"
        self.low_precision = layout.dtype != torch.float32
        self.pin = pin and not self.on_cpu
        self.grad_multiplier = 1.0 if comm.grads_reduced else 1.0 / world

        def zeros(n: int, dtype: torch.dtype) -> torch.Tensor:
            return empty_host(n, dtype, pin=self.pin).zero_()

        self.flat_param: Optional[torch.Tensor] = None
        self.flat_grad: Optional[torch.Tensor] = None
        if self.on_cpu:
            self.flat_param = zeros(padded, layout.dtype)
            self.flat_grad = zeros(padded, layout.dtype)
            self.param_views = [view_like(self.flat_param, o, p) for o, p in zip(self.full.offsets, self.params)]
            self.flat_grad_views = [view_like(self.flat_grad, o, p) for o, p in zip(self.full.offsets, self.params)]
        own = None if self.flat_param is None else self.flat_param[lo : lo + shard]
        self.master = own if (own is not None and not self.low_precision) else zeros(shard, torch.float32)
        self.exp_avg = zeros(shard, torch.float32)
        self.exp_avg_sq = zeros(shard, torch.float32)
        self.max_exp_avg_sq = zeros(shard, torch.float32) if amsgrad else None
        self.grad = zeros(shard, layout.dtype)
        self.staging = None
        if self.low_precision:
            self.staging = own if own is not None else zeros(shard, layout.dtype)
        self.steps = torch.zeros(len(self.params), dtype=torch.float32)
        self.master_views = self._views(self.master)
        self.exp_avg_views = self._views(self.exp_avg)
        self.exp_avg_sq_views = self._views(self.exp_avg_sq)
        self.max_views = self._views(self.max_exp_avg_sq)
        self.grad_views = self._views(self.grad)
        self.staging_views = self._views(self.staging)
        self.grad_slot_zero = [True] * len(self.params)  # of flat_grad's slots (CPU)
        self.present = [False] * len(self.params)  # has a gradient on some rank: set by set_present
        self.versions = [-1] * len(self.params)
        self.exposed = [False] * len(self.params)
        self.all_exposed = False
        self.d2h_event = None
        self.slot_ptrs: List[int] = []
        self.rs_pending = None  # zero_offload.distributed.Pending: the reduce-scatter of gradients in flight
        self.ag_pending = None  # the all-gather of updated parameters in flight
        self.incoming: Optional[torch.Tensor] = None  # a streamed micro-batch's shard, to add to grad
        self.adding = False
        # Streaming: this step's gradients were reduce-scattered from backward hooks (every rank alike), and
        # whether this rank's gradients changed after that (set by GradStreamer.consume).
        self.launched = False
        self.stale = False

    def _views(self, flat: Optional[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        if flat is None:
            return None
        return [flat[a:b] for a, b in self.pieces]

    def estimate(self) -> HostMemoryEstimate:
        return estimate_bucket(self.full.numel, self.full.padded_numel, self.dtype, on_cpu=self.on_cpu,
                               amsgrad=self.max_exp_avg_sq is not None, pin=self.pin, world_size=self.comm.world)

    def buffers(self) -> Dict[str, torch.Tensor]:
        out = super().buffers()
        if self.flat_grad is not None:
            out["flat_grad"] = self.flat_grad
            out["flat_param"] = self.flat_param
        return out

    def bind(self) -> None:
        """Make the parameters identical on every rank (rank 0's values, broadcast, as DDP does at
        construction) and, on CPU, views of ``flat_param``. A collective: every rank binds its buckets in the same
        order."""
        if self.on_cpu:
            for p, view in zip(self.params, self.param_views):
                view.copy_(p.detach())
            self.comm.broadcast(self.flat_param, f"initial parameters of {self.where}")
            for p, view in zip(self.params, self.param_views):
                p.data = view
            self.slot_ptrs = [v.data_ptr() for v in self.param_views]
            return
        flat = torch.zeros(self.full.padded_numel, dtype=self.dtype, device=self.device)
        views = [view_like(flat, o, p) for o, p in zip(self.full.offsets, self.params)]
        torch._foreach_copy_(views, [p.detach() for p in self.params])
        self.comm.broadcast(flat, f"initial parameters of {self.where}")
        with torch.no_grad():
            torch._foreach_copy_(self.params, views)

    # -- state ---------------------------------------------------------------------------------------------
    def refresh_masters(self, indices: Sequence[int]) -> None:
        """As :meth:`FlatBucket.refresh_masters`, for this rank's piece of each parameter. Local: each rank
        decides for its own pieces, with no collective."""
        if not self.separate_master:
            return
        stale = [i for i in indices if self.params[i]._version != self.versions[i]]
        for i in stale:
            a, b = self.pieces[i]
            if b > a:
                if self.on_cpu:
                    value = self.staging_views[i]  # the parameter's own storage
                else:
                    src = self.piece_src[i]
                    value = memory_order_flat(self.params[i].detach())[src : src + b - a].to("cpu")
                master = self.master_views[i]
                if self.versions[i] == -1 or not torch.equal(master.to(self.dtype), value):
                    master.copy_(value)
            self.versions[i] = self.params[i]._version

    def load_entries(self, entries: Sequence[Optional[Dict[str, object]]]) -> None:
        """Copy this rank's piece of each parameter's full (parameter-shaped) state into the shard; ``None``: fresh
        state. Entries are already validated (``optimizer._check_entry``)."""
        for i, entry in enumerate(entries):
            a, b = self.pieces[i]
            src = self.piece_src[i]
            n = b - a
            moments = [self.exp_avg_views[i], self.exp_avg_sq_views[i]]
            if self.max_views is not None:
                moments.append(self.max_views[i])
            if entry is None:
                for m in moments:
                    m.zero_()
                self.steps[i] = 0.0
                self.exposed[i] = False
                if self.separate_master:
                    self.versions[i] = -1
                continue
            self.steps[i] = entry["step"]
            keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.max_views is not None else [])
            for m, key in zip(moments, keys):
                if key in entry:
                    m.copy_(memory_order_flat(entry[key])[src : src + n])
                else:
                    m.zero_()
            if self.separate_master:
                if "master" in entry:
                    self.master_views[i].copy_(memory_order_flat(entry["master"])[src : src + n])
                    self.versions[i] = self.params[i]._version
                else:
                    self.versions[i] = -1

    # -- gradients in --------------------------------------------------------------------------------------
    def set_present(self, present: Sequence[bool]) -> None:
        """Which parameters have a gradient on at least one rank (agreed over the group): those are updated,
        a missing gradient counting as zero on the ranks that lack it."""
        self.present = list(present)

    def runs(self, grads: List[Optional[torch.Tensor]]) -> List[Tuple[int, int, int]]:
        return super().runs([True if p else None for p in self.present])

    def gather_grads(self, grads: List[Optional[torch.Tensor]], stream=None, *, add: bool = False) -> None:
        """Flatten the gradients (absent ones as zeros) and start leaving this rank's shard of their sum over the
        group (or, with ``grads_reduced``, of the already-reduced gradients) in ``grad``; with ``add``, the shard
        is added to what ``grad`` holds (another micro-batch's, streamed). Nothing is waited for: the
        reduce-scatter runs while the caller goes on (the next bucket's gradients, or the rest of backward), and
        :meth:`wait_grads` finishes it. On CUDA the copy to the host is enqueued on ``stream`` after the
        collective and recorded in ``d2h_event``. Returns None: the kernel reads ``grad``."""
        self.wait_grads()  # the previous reduce-scatter may still read flat_grad or write grad
        lo, shard = self.shard_lo, self.shard_numel
        where = f"gradients of {self.where}"
        if add and self.incoming is None:
            self.incoming = empty_host(shard, self.dtype, pin=self.pin)
        out = self.incoming if add else self.grad
        if self.on_cpu:
            dsts, srcs, sizes = [], [], []
            for i, g in enumerate(grads):
                view = self.flat_grad_views[i]
                if g is None:
                    if not self.grad_slot_zero[i]:
                        view.zero_()
                        self.grad_slot_zero[i] = True
                    continue
                self.grad_slot_zero[i] = False
                if g is not view:  # a view installed by zero_grad(set_to_none=False) needs no copy
                    dsts.append(view)
                    srcs.append(g)
                    sizes.append(self.full.numels[i])
            if dsts:
                copy_many_(dsts, srcs, sizes)
            if self.comm.grads_reduced:
                out.copy_(self.flat_grad[lo : lo + shard])
            else:
                self.rs_pending = self.comm.start_reduce_scatter(out, self.flat_grad, where)
        else:
            if self.d2h_event is None:
                self.d2h_event = torch.cuda.Event()
            # The gradients were written on the compute stream (by backward, or by DDP's averaging at its end).
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                flat = torch.zeros(self.full.padded_numel, dtype=self.dtype, device=self.device)
                present = [i for i, g in enumerate(grads) if g is not None]
                if present:
                    torch._foreach_copy_([view_like(flat, self.full.offsets[i], self.params[i]) for i in present],
                                         [grads[i] for i in present])
                if self.comm.grads_reduced:
                    own = flat[lo : lo + shard]
                else:
                    own = torch.empty(shard, dtype=self.dtype, device=self.device)
                    self.rs_pending = self.comm.start_reduce_scatter(own, flat, where)  # the stream waits for it
                out.copy_(own, non_blocking=True)
                self.d2h_event.record(stream)
        self.adding = add
        return None

    def wait_grads(self) -> None:
        """Finish :meth:`gather_grads`: wait for the reduce-scatter (at most the group's timeout, else an error
        naming rank and bucket) and the copy to the host, and add a streamed micro-batch's shard."""
        if self.rs_pending is not None:
            pending, self.rs_pending = self.rs_pending, None
            pending.wait()
        super().wait_grads()
        if self.adding:
            self.adding = False
            self.grad.add_(self.incoming)

    def zero_grads_as_views(self) -> None:
        """``zero_grad(set_to_none=False)`` on CPU: existing gradients become zeroed views of ``flat_grad``."""
        self.flat_grad.zero_()
        for i, p in enumerate(self.params):
            g = p.grad
            if g is not None:
                self.grad_slot_zero[i] = True
                if g is not self.flat_grad_views[i]:
                    p.grad = self.flat_grad_views[i]

    # -- parameters out ------------------------------------------------------------------------------------
    def scatter_params(self, indices: Sequence[int], stream=None) -> None:
        """Start all-gathering the updated shard (fp32 master, or the bf16/fp16 staging copy) into the full
        parameters, without waiting: the next bucket's update runs meanwhile, and :meth:`wait_params` finishes it
        (``step()`` waits for every bucket's before it returns). The whole bucket is gathered whatever ``indices``
        are (every rank gathers the same buckets)."""
        lo, shard = self.shard_lo, self.shard_numel
        where = f"parameters of {self.where}"
        if self.on_cpu:
            # The shard is flat_param's own slice: gathered in place.
            self.ag_pending = self.comm.start_all_gather(self.flat_param, self.flat_param[lo : lo + shard], where)
            torch.autograd.graph.increment_version([self.params[i] for i in indices])
        else:
            src = self.staging if self.low_precision else self.master
            with torch.no_grad(), torch.cuda.stream(stream):
                own = torch.empty(shard, dtype=self.dtype, device=self.device)
                own.copy_(src, non_blocking=True)
                flat = torch.empty(self.full.padded_numel, dtype=self.dtype, device=self.device)
                self.ag_pending = self.comm.start_all_gather(flat, own, where)  # the stream waits for it
                # Only the parameters updated: another's master may not have been initialised from it yet.
                torch._foreach_copy_([self.params[i] for i in indices],
                                     [view_like(flat, self.full.offsets[i], self.params[i]) for i in indices])
        self.record_versions(indices)

    def wait_params(self) -> None:
        if self.ag_pending is not None:
            pending, self.ag_pending = self.ag_pending, None
            pending.wait()

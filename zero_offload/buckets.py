"""Flattening parameters into aligned, contiguous host buckets: where each parameter's master weights, moments,
gradient and low-precision copy live (layout and host buffers; moving bytes in and out is
:mod:`zero_offload.transport`'s job).

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

import dataclasses
import itertools
import logging
import math
import operator
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from zero_offload._reference import poisoned_elements
from zero_offload.functional import Q8_BLOCK, dequantize_state, q8_scale_numel, quantize_state_
from zero_offload.host_memory import HostMemoryEstimate, available_host_bytes, empty_host, estimate_bucket, format_bytes
from zero_offload.options import Options

__all__ = ["ALIGN", "BucketLayout", "FlatBucket", "ShardLayout", "plan_buckets", "align_up", "view_like",
           "memory_order_flat", "check_grads", "should_pin", "estimate_layouts", "estimate_params", "allocate_group"]

logger = logging.getLogger("zero_offload")

# Elements. 64 elements is a whole number of 64-byte cache lines for 1-, 2- and 4-byte dtypes and a multiple of
# every SIMD width the kernel uses, so no slot shares a line or a vector with its neighbour; and it is one block of
# 8-bit state, so every slot (and every shard, see ShardLayout) owns whole scale blocks.
ALIGN = 64
assert ALIGN % Q8_BLOCK == 0
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


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


def should_pin(device: torch.device, pin_memory: Optional[bool]) -> bool:
    """Whether a bucket on ``device`` gets page-locked buffers: ``pin_memory`` as given, or (None) exactly the
    buckets whose parameters are on CUDA (pinning buys nothing without transfers and locks RAM)."""
    if pin_memory is None:
        return device.type == "cuda"
    return bool(pin_memory)


def estimate_layouts(layouts: Sequence[BucketLayout], amsgrad: bool, pin_memory: Optional[bool], world_size: int = 1,
                     delayed_update: bool = False, state_dtype: torch.dtype = torch.float32) -> HostMemoryEstimate:
    """Host bytes of the buckets ``layouts`` would allocate (per rank when sharded over ``world_size``), without
    allocating: the same arithmetic as :meth:`FlatBucket.estimate` of the real buckets."""
    total = HostMemoryEstimate(0, 0, {}, 0, 0)
    for layout in layouts:
        padded = layout.padded_numel if world_size == 1 else align_up(layout.padded_numel, ALIGN * world_size)
        total = total + estimate_bucket(layout.numel, padded, layout.dtype, on_cpu=layout.device.type == "cpu",
                                        amsgrad=amsgrad, pin=should_pin(layout.device, pin_memory),
                                        world_size=world_size, delayed_update=delayed_update,
                                        state_dtype=state_dtype)
    return total


def estimate_params(params: Iterable[Any], *, amsgrad: bool = False, bucket_numel: int, pin_memory: Optional[bool],
                    world_size: int = 1, delayed_update: bool = False,
                    state_dtype: torch.dtype = torch.float32) -> HostMemoryEstimate:
    """:func:`estimate_layouts` of the buckets an optimizer over ``params`` (tensors or group dicts, whose own
    ``amsgrad`` is honoured) would plan; see ``OffloadOptimizer.estimate_host_memory``."""
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    total = HostMemoryEstimate(0, 0, {}, 0, 0)
    for g in groups:
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else [p[1] if isinstance(p, tuple) else p for p in ps]
        total = total + estimate_layouts(plan_buckets(ps, bucket_numel), bool(g.get("amsgrad", amsgrad)),
                                         pin_memory, world_size, delayed_update, state_dtype)
    return total


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



@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How one bucket is cut over the ``world`` ranks of a process group (ZeRO), seen from rank ``rank``.

    The bucket's full flat layout (``full``) is padded to a multiple of ``world * ALIGN`` elements and cut into
    ``world`` equal contiguous shards of ``numel`` elements (a multiple of :data:`ALIGN`); rank ``r`` owns
    ``[r * numel, (r + 1) * numel)``. A parameter may straddle shard boundaries, and a rank may own only padding.
    ``local`` describes the shard in the coordinates the update uses: the same parameters, each with its *piece*
    (the part of its slot inside the shard, possibly empty) at a shard-local offset, so spans, runs and kernel
    calls work on a shard exactly as on a whole bucket.

    Attributes:
        full (BucketLayout): the whole bucket, padded for the cut.
        world (int), rank (int): the group's size and this rank.
        pieces (Tuple[Tuple[int, int], ...]): each parameter's piece ``[a, b)`` in shard coordinates.
        piece_src (Tuple[int, ...]): where each piece starts within its parameter's slot.
        local (BucketLayout): the shard's own layout.
    """

    full: BucketLayout
    world: int
    rank: int
    pieces: Tuple[Tuple[int, int], ...]
    piece_src: Tuple[int, ...]
    local: BucketLayout

    @staticmethod
    def cut(layout: BucketLayout, world: int, rank: int) -> "ShardLayout":
        padded = align_up(layout.padded_numel, ALIGN * world)
        shard = padded // world
        lo = rank * shard
        pieces = tuple((min(max(o - lo, 0), shard), min(max(o + n - lo, 0), shard))
                       for o, n in zip(layout.offsets, layout.numels))
        local = BucketLayout(layout.indices, tuple(a for a, _ in pieces), tuple(b - a for a, b in pieces), shard,
                             layout.device, layout.dtype)
        return ShardLayout(dataclasses.replace(layout, padded_numel=padded), world, rank, pieces,
                           tuple(a + lo - o for (a, _), o in zip(pieces, layout.offsets)), local)

    @property
    def numel(self) -> int:
        return self.full.padded_numel // self.world

    @property
    def lo(self) -> int:
        return self.rank * self.numel

    def pieces_of(self, i: int) -> List[Tuple[int, int, int]]:
        """How parameter ``i``'s slot is spread over the ranks: ``(rank, start within the slot, length)`` for each
        rank that owns a non-empty piece of it."""
        offset, numel, shard = self.full.offsets[i], self.full.numels[i], self.numel
        out = []
        for r in range(self.world):
            a, b = max(offset, r * shard), min(offset + numel, (r + 1) * shard)
            if b > a:
                out.append((r, a - offset, b - a))
        return out


class FlatBucket:
    """The host buffers of one bucket and the per-parameter views into them.

    Buffers (each ``layout.padded_numel`` long): ``master`` (fp32), ``exp_avg``, ``exp_avg_sq``, optionally
    ``max_exp_avg_sq`` (in ``state_dtype``: fp32, bf16, or 8-bit codes, int8 for ``exp_avg`` and uint8 for the
    others, each with a float32 ``<name>_scale`` buffer of one scale per 64 elements), ``grad`` (the parameters'
    dtype) and, for low-precision parameters, ``staging`` (the parameters' dtype: the kernel's ``param_out``).

    With compact state (``state_dtype`` not fp32) the optimizer's ``state`` entries hold ``step`` (and ``master``)
    only: the moments are not fp32 tensors anywhere, and :meth:`moment_fp32` / :meth:`load_moment` convert.

    Where the parameter itself lives:

    * fp32 on CPU: the parameter *is* its master slot (``p.data`` is rebound to the view); no copy, no
      separate master, no ``"master"`` key in the state.
    * bf16/fp16 on CPU: the parameter is its staging slot, which the kernel writes; the fp32 master is separate.
    * on CUDA: the parameter stays where it is; :mod:`zero_offload.transport` copies gradients into ``grad`` and
      the master (fp32) or the staging copy (low precision) back.

    **Sharded** (``shard`` given, see :class:`ShardLayout`): every buffer above holds this rank's shard only
    (12 / world bytes of fp32 state per parameter), ``layout`` is the shard's, and per-parameter views are 1-D
    pieces. On CPU the parameters are views of one full flat buffer ``flat_param`` (the rank's slice of it *is*
    the fp32 master, or the bf16/fp16 ``staging``), and gradients are gathered in a full flat ``flat_grad`` that
    the reduce-scatter reads. The kernel's gradient multiplier carries the 1/world of the average.

    A separate master is (re)initialised from its parameter before the parameter's next update whenever the
    parameter was changed outside the optimizer (tracked by its autograd version counter) and no longer equals
    the master rounded to its dtype: loading a model checkpoint after building the optimizer just works.

    Args:
        layout (BucketLayout): the bucket as :func:`plan_buckets` made it.
        params (Sequence[Tensor]): the group's parameters.
        amsgrad (bool): allocate ``max_exp_avg_sq``.
        pin (bool): page-lock the buffers (those that take part in device copies).
        shard (ShardLayout, optional): this rank's cut of the bucket.
        grads_reduced (bool): sharded, the gradients arrive averaged already (no 1/world in the multiplier).
        where (str): "param group G, bucket B", for error messages.
        group (int): the param group's index, and ``names`` (optional) its ``param_names``: error messages name
            a parameter by both.
        state_dtype (torch.dtype): the moments' storage, ``torch.float32``, ``torch.bfloat16`` or ``torch.int8``
            (8-bit block-wise). Default: ``torch.float32``.
    """

    grad_prev: Optional[torch.Tensor] = None  # delayed_update's second gradient buffer

    def __init__(self, layout: BucketLayout, params: Sequence[torch.Tensor], *, amsgrad: bool, pin: bool,
                 shard: Optional[ShardLayout] = None, grads_reduced: bool = False, where: str = "",
                 state_dtype: torch.dtype = torch.float32, group: int = 0, names: Optional[Sequence[str]] = None):
        self.shard = shard
        self.where = where
        self.group = group
        self.names = None if not names else [names[i] for i in layout.indices]
        self.params: List[torch.Tensor] = [params[i] for i in layout.indices]
        self.shapes = [p.shape for p in self.params]
        self.device, self.dtype = layout.device, layout.dtype
        self.on_cpu = layout.device.type == "cpu"
        self.low_precision = layout.dtype != torch.float32
        # A low-precision CUDA bucket, unsharded: the kernel reads each gradient and writes the rounded parameter
        # into the same slot, which the upload then reads (2 B/param less than a separate staging buffer). The
        # transport orders the next gradient copies into the buffer after that upload. A CPU parameter *is* its
        # staging slot, and a sharded bucket all-gathers from its staging shard: those keep one.
        self.shares_grad = self.low_precision and not self.on_cpu and shard is None
        self.pin = pin and not (shard is not None and self.on_cpu)  # nothing of a sharded CPU bucket goes to a GPU
        # Multiplies the gradient in the kernel, on top of the loss-scale inverse and clip coefficient.
        self.grad_multiplier = 1.0 if shard is None or grads_reduced else 1.0 / shard.world
        self.layout = layout if shard is None else shard.local
        n = self.layout.padded_numel
        own = self._alloc_full() if shard is not None else None
        self.master = own if (own is not None and not self.low_precision) else self._zeros(n, torch.float32)
        self.state_dtype = state_dtype
        self.compact = state_dtype != torch.float32
        self.scales: Dict[str, torch.Tensor] = {}  # 8-bit state: each moment's block scales
        self.exp_avg = self._moment("exp_avg")
        self.exp_avg_sq = self._moment("exp_avg_sq")
        self.max_exp_avg_sq: Optional[torch.Tensor] = self._moment("max_exp_avg_sq") if amsgrad else None
        self.grad = self._zeros(n, layout.dtype)
        self.staging: Optional[torch.Tensor] = None
        if self.low_precision and not self.shares_grad:
            self.staging = own if own is not None else self._zeros(n, layout.dtype)
        # Per-parameter step counts in one tensor: state["step"] is a 0-dim view of an element, so counting a step
        # for a whole bucket is one add, and state_dict() still shows AdamW's 0-dim float32 CPU tensors.
        self.steps = torch.zeros(len(self.params), dtype=torch.float32)
        self.master_views = self._views(self.master)
        self.exp_avg_views = self._views(self.exp_avg)
        self.exp_avg_sq_views = self._views(self.exp_avg_sq)
        self.max_views = self._views(self.max_exp_avg_sq)
        self.grad_views = self._views(self.grad)
        self.staging_views = self._views(self.staging)
        self.slot_contiguous = [v.is_contiguous() for v in self.grad_views]
        self.all_slots_contiguous = all(self.slot_contiguous)
        # Whether each gradient slot (of ``flat_grad`` when sharded on CPU) is known to hold zeros: a parameter
        # without a gradient must not leave a stale one in the buffer, which norms and checks read whole.
        self.grad_slot_zero = [True] * len(self.params)
        # Each parameter's autograd version right after the optimizer last wrote it (or initialised its master
        # from it); -1 = master not initialised. Unused when the parameter is its own master.
        self.versions = [-1] * len(self.params)
        self.exposed = [False] * len(self.params)
        self.all_exposed = False
        self.slot_ptrs: List[int] = []  # data_ptr of each CPU parameter's slot, once bound
        self._grad_ptrs: Dict[int, List[int]] = {}  # data_ptr of a gradient buffer -> its slots' (_slot_grad_ptrs)

    def _zeros(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return empty_host(n, dtype, pin=self.pin).zero_()

    def _moment(self, name: str) -> torch.Tensor:
        """A zeroed moment buffer in the state dtype (and its zeroed scales for 8-bit state)."""
        n = self.layout.padded_numel
        if self.state_dtype != torch.int8:
            return self._zeros(n, self.state_dtype)
        self.scales[name] = self._zeros(q8_scale_numel(n), torch.float32)
        return self._zeros(n, torch.int8 if name == "exp_avg" else torch.uint8)

    def _alloc_full(self) -> Optional[torch.Tensor]:
        """Sharded on CPU: the full flat parameter and gradient buffers; returns the rank's slice of the former."""
        self.flat_param: Optional[torch.Tensor] = None
        self.flat_grad: Optional[torch.Tensor] = None
        if not self.on_cpu:
            return None
        full = self.shard.full
        self.flat_param = self._zeros(full.padded_numel, self.dtype)
        self.flat_grad = self._zeros(full.padded_numel, self.dtype)
        self.param_views = [view_like(self.flat_param, o, p) for o, p in zip(full.offsets, self.params)]
        self.flat_grad_views = [view_like(self.flat_grad, o, p) for o, p in zip(full.offsets, self.params)]
        return self.flat_param[self.shard.lo : self.shard.lo + self.shard.numel]

    # -- layout --------------------------------------------------------------------------------------------------
    def _views(self, flat: Optional[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        if flat is None:
            return None
        if self.shard is not None:
            return [flat[a:b] for a, b in self.shard.pieces]
        return [view_like(flat, o, p) for o, p in zip(self.layout.offsets, self.params)]

    @property
    def sharded(self) -> bool:
        return self.shard is not None

    @property
    def full(self) -> BucketLayout:
        """The whole bucket's layout (the shard's full layout when sharded)."""
        return self.layout if self.shard is None else self.shard.full

    @property
    def separate_master(self) -> bool:
        """Whether the fp32 master is a copy (low precision or CUDA) rather than the parameter itself."""
        return not (self.on_cpu and not self.low_precision)

    def param_out(self, flat_grad: torch.Tensor, a: int, b: int) -> Optional[torch.Tensor]:
        """Where the kernel writes the low-precision parameter of elements ``[a, b)`` (None: fp32, the master is
        the result): the staging buffer, or with :attr:`shares_grad` the gradient buffer it reads."""
        if self.staging is not None:
            return self.staging[a:b]
        return flat_grad[a:b] if self.shares_grad else None

    @property
    def upload_views(self) -> List[torch.Tensor]:
        """What the parameters are uploaded from after an update: the master (fp32), the staging copy, or with
        :attr:`shares_grad` the gradient buffer the kernel last wrote (``delayed_update``'s second buffer, which
        its updates read and its uploads follow before the buffers are swapped)."""
        if not self.low_precision:
            return self.master_views
        if not self.shares_grad:
            return self.staging_views
        return self._prev_views if self.grad_prev is not None else self.grad_views

    def ensure_amsgrad(self) -> None:
        if self.max_exp_avg_sq is None:
            self.max_exp_avg_sq = self._moment("max_exp_avg_sq")
            self.max_views = self._views(self.max_exp_avg_sq)

    def estimate(self) -> HostMemoryEstimate:
        return estimate_bucket(self.full.numel, self.full.padded_numel, self.dtype, on_cpu=self.on_cpu,
                               amsgrad=self.max_exp_avg_sq is not None, pin=self.pin,
                               world_size=1 if self.shard is None else self.shard.world,
                               delayed_update=self.grad_prev is not None, state_dtype=self.state_dtype)

    def buffers(self) -> Dict[str, torch.Tensor]:
        out = {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "grad": self.grad}
        if self.max_exp_avg_sq is not None:
            out["max_exp_avg_sq"] = self.max_exp_avg_sq
        out.update((name + "_scale", scale) for name, scale in self.scales.items())
        if self.staging is not None:
            out["staging"] = self.staging
        if self.grad_prev is not None:
            out["grad_prev"] = self.grad_prev
        if self.shard is not None and self.flat_grad is not None:
            out["flat_grad"] = self.flat_grad
            out["flat_param"] = self.flat_param
        return out

    @property
    def param_slots(self) -> Optional[List[torch.Tensor]]:
        """For CPU buckets, the views the parameters are bound to (master or staging, or ``flat_param``'s when
        sharded); None on CUDA."""
        if not self.on_cpu:
            return None
        if self.shard is not None:
            return self.param_views
        return self.staging_views if self.low_precision else self.master_views

    def fill_param_slots(self) -> None:
        """Copy each CPU parameter's values into the slot it will be bound to (see :meth:`bind`)."""
        for p, slot in zip(self.params, self.param_slots or ()):
            slot.copy_(p.detach())

    def bind(self) -> None:
        """Make CPU parameters views of the slots the kernel writes (after :meth:`fill_param_slots`, so the model
        is unchanged, and a later in-place load into a parameter lands in its slot). Called once every bucket of a
        group has been allocated, so a failed allocation leaves the parameters untouched."""
        if self.on_cpu:
            for p, slot in zip(self.params, self.param_slots):
                p.data = slot
            self.slot_ptrs = [slot.data_ptr() for slot in self.param_slots]

    # -- state ---------------------------------------------------------------------------------------------------
    def state_entry(self, i: int) -> Dict[str, torch.Tensor]:
        """Parameter ``i``'s optimizer state in AdamW's format: views, not copies. With compact state, ``step`` and
        ``master`` only (the moments are not fp32 anywhere; ``state_dict()`` converts them)."""
        slots = self.state_slots(i, master=self.low_precision)
        if self.compact:
            slots = {k: v for k, v in slots.items() if k not in MOMENTS}
        return {"step": self.steps[i], **slots}

    def state_slots(self, i: int, *, master: bool = True) -> Dict[str, torch.Tensor]:
        """Parameter ``i``'s state tensors by name (views of the buffers), the master with ``master`` where it is
        separate from the parameter."""
        out = {"exp_avg": self.exp_avg_views[i], "exp_avg_sq": self.exp_avg_sq_views[i]}
        if self.max_views is not None:
            out["max_exp_avg_sq"] = self.max_views[i]
        if master and self.separate_master:
            out["master"] = self.master_views[i]
        return out

    def kernel_state(self, a: int, b: int, amsgrad: bool,
                     into: Optional[Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]] = None
                     ) -> Dict[str, Optional[torch.Tensor]]:
        """The kernel's state arguments for elements ``[a, b)`` (``a`` a slot or piece start, so a multiple of
        :data:`ALIGN`): the moments, and their scales' blocks for 8-bit state; of ``into`` (copies of the buffers
        by name, and of the scales) where given."""
        flat, scales = into if into is not None else ({n: getattr(self, n) for n in MOMENTS}, self.scales)
        out = {"exp_avg": flat["exp_avg"][a:b], "exp_avg_sq": flat["exp_avg_sq"][a:b],
               "max_exp_avg_sq": flat["max_exp_avg_sq"][a:b] if amsgrad else None}
        if scales:
            blocks = slice(a // Q8_BLOCK, q8_scale_numel(b))
            out.update((name + "_scale", scales[name][blocks]) for name in MOMENTS
                       if name in scales and (amsgrad or name != "max_exp_avg_sq"))
        return out

    def moment_fp32(self, name: str) -> torch.Tensor:
        """Moment ``name``'s whole buffer as float32: the buffer itself for fp32 state, else a new tensor,
        converted in one pass (8-bit state: chunk by chunk, with no other temporary)."""
        buf = getattr(self, name)
        if not self.compact:
            return buf
        if name in self.scales:
            out = dequantize_state(buf, self.scales[name])
            m_scale = self.scales["exp_avg"]
            if name != "exp_avg" and bool(torch.signbit(m_scale).any()):
                # A poisoned element (a non-finite moment, kept per element) is marked in exp_avg's codes only.
                out.masked_fill_(poisoned_elements(self.exp_avg, m_scale).view(-1)[: out.numel()], math.nan)
            return out
        return buf.float()

    def _slot_range(self, i: int) -> Tuple[int, int]:
        """Element range of parameter ``i``'s slot (its piece when sharded) in this bucket's buffers."""
        if self.shard is not None:
            return self.shard.pieces[i]
        o = self.layout.offsets[i]
        return o, o + self.layout.numels[i]

    def load_moment(self, name: str, i: int, value: Optional[torch.Tensor]) -> None:
        """Write parameter ``i``'s moment ``name`` (its piece when sharded) from ``value``, parameter-shaped, any
        floating dtype and device, converted to the state dtype (quantised for 8-bit state); None: zeros.
        ``value`` is already validated (for 8-bit second moments: no negative value)."""
        a, b = self._slot_range(i)
        if value is not None and self.shard is not None:
            src = self.shard.piece_src[i]
            value = memory_order_flat(value)[src : src + b - a]
        if name not in self.scales:
            slot = self.state_slots(i)[name]  # shaped like the parameter, or the 1-D piece
            if value is None:
                slot.zero_()
            else:
                slot.copy_(value)
            return
        blocks = self.scales[name][a // Q8_BLOCK : q8_scale_numel(b)]
        codes = getattr(self, name)[a:b]
        if value is None:
            codes.zero_()
            blocks.zero_()
            return
        flat = torch.empty(b - a, dtype=torch.float32)
        if self.shard is not None:
            flat.copy_(value)
        else:  # in the slot's memory order, whatever the value's strides
            view_like(flat, 0, self.params[i]).copy_(value)
        quantize_state_(codes, blocks, flat)

    def set_exposed(self, i: int, exposed: bool) -> None:
        """Record whether parameter ``i`` has an entry in the optimizer's ``state`` (see checkpoint.expose)."""
        self.exposed[i] = exposed
        self.all_exposed = all(self.exposed)

    def set_step(self, i: int, step: float) -> None:
        self.steps[i] = step

    def count_steps(self, runs: Sequence[Tuple[int, int, int]]) -> None:
        """One more step for the parameters of ``runs`` (see :meth:`runs`)."""
        if len(runs) == 1 and runs[0][0] == 0 and runs[0][1] == len(self.params) - 1:
            self.steps += 1
        else:
            for first, last, _ in runs:
                self.steps[first : last + 1] += 1

    def reset_param(self, i: int) -> None:
        """Parameter ``i`` starts afresh (its moments are zeroed by the caller): step 0, no state entry, master
        taken from the parameter at its next update."""
        self.steps[i] = 0.0
        self.set_exposed(i, False)
        self.master_loaded(i, False)

    def master_loaded(self, i: int, loaded: bool) -> None:
        """A separate master was just written from a checkpoint (kept while the parameter still rounds from it), or
        not (``loaded=False``: taken from the parameter at its next update)."""
        if self.separate_master:
            self.versions[i] = self.params[i]._version if loaded else -1

    def refresh_masters(self, indices: Sequence[int], into: Optional[List[torch.Tensor]] = None) -> None:
        """(Re)initialise the separate masters of ``indices`` whose parameter changed since the optimizer last
        wrote it; see the class docstring. Each rank decides for its own pieces, with no collective. ``into``
        (CPU buckets only): per-parameter copies of the masters to refresh instead, the bucket left as it is."""
        if not self.separate_master:
            return
        stale = [i for i in indices if self.params[i]._version != self.versions[i]]
        if not stale:
            return
        for i, value in zip(stale, self._param_values(stale)):
            master = self.master_views[i] if into is None else into[i]
            # A parameter rewritten with the value it already had (a model checkpoint loaded alongside this
            # optimizer's) keeps the fp32 master's extra bits; any other value replaces the master.
            if value is not None and (self.versions[i] == -1 or not torch.equal(master.to(self.dtype), value)):
                master.copy_(value)
            if into is None:
                self.versions[i] = self.params[i]._version

    def _param_values(self, stale: Sequence[int]) -> List[Optional[torch.Tensor]]:
        """The host values of the parameters ``stale`` (their pieces when sharded; None for an empty piece)."""
        if self.shard is not None:
            out: List[Optional[torch.Tensor]] = []
            for i in stale:
                a, b = self.shard.pieces[i]
                if b <= a:
                    out.append(None)
                elif self.on_cpu:
                    out.append(self.staging_views[i])  # the parameter's own storage
                else:
                    src = self.shard.piece_src[i]
                    out.append(memory_order_flat(self.params[i].detach())[src : src + b - a].to("cpu"))
            return out
        if self.on_cpu:
            return [self.params[i].detach() for i in stale]
        # The parameter's bits land in its own-dtype host slot first (staging for low precision, else the master),
        # in one batch of async copies and one wait; the upcast to the fp32 master then runs on the host. Into a
        # scratch copy when the master may be kept: it is compared before being overwritten.
        # (Never into a gradient slot that carries parameters out: it holds this step's gradient.)
        landing = self.staging_views if self.low_precision else self.master_views
        host = [landing[i] if self.versions[i] == -1 and landing is not None
                else torch.empty_like(self.master_views[i], dtype=self.dtype) for i in stale]
        torch._foreach_copy_(host, [self.params[i].detach() for i in stale], non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return host

    def record_versions(self, indices: Sequence[int]) -> None:
        if self.separate_master:
            for i in indices:
                self.versions[i] = self.params[i]._version

    def load_entries(self, entries: Sequence[Optional[Dict[str, object]]]) -> None:
        """Sharded: copy this rank's piece of each parameter's full (parameter-shaped) state into the shard;
        ``None``: fresh state. Entries are already validated (``checkpoint.check_entry``)."""
        for i, entry in enumerate(entries):
            a, b = self.shard.pieces[i]
            src = self.shard.piece_src[i]
            slots = self.state_slots(i)
            for name in slots:
                if name != "master":
                    self.load_moment(name, i, None if entry is None else entry.get(name))
            if entry is None:
                self.reset_param(i)
                continue
            self.steps[i] = entry["step"]
            if "master" in slots and "master" in entry:
                slots["master"].copy_(memory_order_flat(entry["master"])[src : src + b - a])
            self.master_loaded(i, "master" in entry)

    # -- gradients -----------------------------------------------------------------------------------------------
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
        in_slot = list(map(operator.is_, grads, self.grad_targets))
        if any(in_slot) and self.unbind_rebound_grads():
            in_slot = list(map(operator.is_, grads, self.grad_targets))
        if all(in_slot):
            return grads  # every gradient already is its slot: dense, nothing more to check
        # Only a gradient that is not already its slot can be sparse or shaped unlike its parameter.
        if not any(in_slot) and not any(map(operator.is_, grads, itertools.repeat(None))):
            check_grads(grads, params, self.shapes, self.label)  # the usual fresh gradients: C-level loops only
            return grads
        others = [(g, i) for i, (g, s) in enumerate(zip(grads, in_slot)) if not s and g is not None]
        check_grads([g for g, _ in others], [params[i] for _, i in others], [self.shapes[i] for _, i in others],
                    lambda k: self.label(others[k][1]))
        return grads

    def unbind_rebound_grads(self) -> bool:
        """A gradient that is a view of its slot (``zero_grad(set_to_none=False)``) can be rebound by the user,
        ``p.grad.data = t`` or ``p.grad.set_(t)``: the very view object then holds ``t``'s storage. Such a slot gets
        a fresh view, so the rebound tensor is read like any gradient assigned by hand (and shape-checked), as
        AdamW would read it. Returns whether any was rebound. One ``data_ptr`` per parameter (C-level loop)."""
        targets = self.grad_targets
        expected = self._slot_grad_ptrs()
        if list(map(torch.Tensor.data_ptr, targets)) == expected:
            return False
        flat, offsets = (self.flat_grad, self.full.offsets) if targets is not self.grad_views else (
            self.grad, self.layout.offsets)
        for i, t in enumerate(targets):
            if t.data_ptr() != expected[i]:
                targets[i] = view_like(flat, offsets[i], self.params[i])
                self.grad_slot_zero[i] = False  # (unknown: zeroed at its next use)
        return True

    def _slot_grad_ptrs(self) -> List[int]:
        """The ``data_ptr`` each view of :attr:`grad_targets` has while it views its slot (cached per buffer:
        ``delayed_update`` swaps two)."""
        sharded_cpu = self.shard is not None and self.on_cpu
        flat = self.flat_grad if sharded_cpu else self.grad
        key = flat.data_ptr()
        ptrs = self._grad_ptrs.get(key)
        if ptrs is None:
            offsets = self.full.offsets if sharded_cpu else self.layout.offsets
            ptrs = self._grad_ptrs[key] = [view_like(flat, o, p).data_ptr() for o, p in zip(offsets, self.params)]
        return ptrs

    def label(self, i: int) -> str:
        """Parameter ``i`` as error messages name it: its group, index in the group and name (where given)."""
        name = f" ({self.names[i]!r})" if self.names else ""
        return f"param group {self.group}, parameter {self.layout.indices[i]}{name}"

    def _moved(self, i: int) -> bool:
        p = self.params[i]
        if self.on_cpu:
            return p.data_ptr() != self.slot_ptrs[i]
        return p.dtype != self.dtype or p.device != self.device

    @property
    def grad_targets(self) -> List[torch.Tensor]:
        """Where a parameter's gradient is gathered: its slot of ``grad`` (of ``flat_grad`` when sharded on CPU)."""
        if self.shard is not None and self.on_cpu:
            return self.flat_grad_views
        return self.grad_views

    def slot_filled(self, i: int) -> None:
        """Gradient slot ``i`` now holds (or is about to hold) a gradient."""
        self.grad_slot_zero[i] = False

    def all_slots_filled(self) -> None:
        """Every gradient slot now holds a gradient (the steady state of ``zero_grad(set_to_none=False)``)."""
        if any(self.grad_slot_zero):
            self.grad_slot_zero[:] = [False] * len(self.grad_slot_zero)

    def clear_slot(self, i: int) -> None:
        """Parameter ``i`` has no gradient: its gradient slot must read as zeros."""
        if not self.grad_slot_zero[i]:
            self.grad_targets[i].zero_()
            self.grad_slot_zero[i] = True

    def add_grad_prev(self) -> None:
        """Allocate the second gradient buffer of ``delayed_update`` (see :meth:`swap_grad_buffers`)."""
        if self.grad_prev is None:
            self.grad_prev = self._zeros(self.layout.padded_numel, self.dtype)
            self._prev_views = self._views(self.grad_prev)
            self._prev_zero = [True] * len(self.params)

    def swap_grad_buffers(self) -> None:
        """Exchange the gradient buffer with the second one: ``delayed_update`` updates from one step's gradients
        while the next backward fills the other."""
        self.add_grad_prev()
        self.grad, self.grad_prev = self.grad_prev, self.grad
        self.grad_views, self._prev_views = self._prev_views, self.grad_views
        self.grad_slot_zero, self._prev_zero = self._prev_zero, self.grad_slot_zero

    def zero_grads_as_views(self) -> None:
        """``zero_grad(set_to_none=False)`` for a CPU bucket: every existing gradient becomes its (zeroed) slot of
        the flat buffer, so the next backward accumulates straight into it and the step copies nothing."""
        self.unbind_rebound_grads()  # a rebound view must not stay p.grad: AdamW would zero the tensor it holds
        targets = self.grad_targets
        (self.flat_grad if self.shard is not None else self.grad).zero_()
        for i, p in enumerate(self.params):
            g = p.grad
            if g is not None:
                self.grad_slot_zero[i] = True
                if g is not targets[i]:
                    p.grad = targets[i]

    def runs(self, present: Sequence[bool]) -> List[Tuple[int, int, int]]:
        """Contiguous runs ``(first, last, step)`` of parameters that have a gradient (``present``) and the same step
        count: each is one kernel call. Usually one run covering the whole bucket."""
        steps = self.steps.tolist()
        if all(present) and min(steps) == max(steps):
            return [(0, len(present) - 1, int(steps[0]))]
        out: List[Tuple[int, int, int]] = []
        first = None
        for i, has in enumerate(present):
            if first is not None and (not has or steps[i] != steps[first]):
                out.append((first, i - 1, int(steps[first])))
                first = None
            if has and first is None:
                first = i
        if first is not None:
            out.append((first, len(present) - 1, int(steps[first])))
        return out


def check_grads(grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                shapes: Optional[Sequence[torch.Size]] = None, label: Optional[Callable[[int], str]] = None) -> None:
    """Refuse gradients the kernel cannot take for their parameters: sparse ones, and any shaped unlike the
    parameter (a broadcastable one would be silently expanded by a copy, a smaller one partly applied). C-level
    loops on the hot path. ``label(k)`` names parameter ``k`` in the error (else its shape alone does)."""
    # (``shapes``: the parameters' own, read once: a Parameter's attributes are slow to read.)
    if set(map(_get_layout, grads)) <= {torch.strided} and list(map(_get_shape, grads)) == list(
            shapes if shapes is not None else map(_get_shape, params)):
        return
    for k, (g, p) in enumerate(zip(grads, params)):
        what = "a parameter" if label is None else label(k)
        if g.layout != torch.strided:
            raise RuntimeError(
                f"OffloadOptimizer does not support sparse gradients ({what} of shape {tuple(p.shape)} has a "
                f"{g.layout} gradient); consider torch.optim.SparseAdam"
            )
        if g.shape != p.shape:
            raise RuntimeError(f"OffloadOptimizer: {what} of shape {tuple(p.shape)} has a gradient of shape "
                               f"{tuple(g.shape)}; nothing was updated")


_get_grad = operator.attrgetter("grad")
_get_layout = operator.attrgetter("layout")
_get_shape = operator.attrgetter("shape")


OVERCOMMIT_ENV = "ZERO_OFFLOAD_ALLOW_OVERCOMMIT"


def _check_room(layouts: Sequence[BucketLayout], gi: int, amsgrad: bool, options: Options, world: int) -> None:
    """Refuse, before allocating anything, buckets that cannot fit in the host RAM this process can still take:
    the kernel's OOM killer would end the process instead, with nothing said. The peak is the whole estimate, as a
    CPU parameter's own storage is freed only once its buckets are filled. ``ZERO_OFFLOAD_ALLOW_OVERCOMMIT=1``
    turns the error into a warning (swap, or memory about to be freed elsewhere)."""
    def estimate(amsgrad: bool = amsgrad, world: int = world, delayed: bool = options.delayed_update,
                 state_dtype: torch.dtype = options.state_dtype) -> HostMemoryEstimate:
        return estimate_layouts(layouts, amsgrad, options.pin_memory, world, delayed, state_dtype)

    est = estimate()
    avail = available_host_bytes()
    if avail is None or est.total_bytes <= avail:
        return
    smaller = []
    if amsgrad:
        smaller.append(("amsgrad=False", estimate(amsgrad=False)))
    if options.delayed_update:
        smaller.append(("delayed_update=False", estimate(delayed=False)))
    for dtype, name in ((torch.bfloat16, "torch.bfloat16"), (torch.int8, "torch.int8")):
        if options.state_dtype.itemsize > dtype.itemsize:
            smaller.append((f"state_dtype={name}", estimate(state_dtype=dtype)))
    for n in (2, 4, 8):
        if n > world:
            smaller.append((f"process_group of {n} ranks (per rank)", estimate(world=n)))
    ways = "; ".join(f"{what}: {format_bytes(e.total_bytes)}" for what, e in smaller)
    message = (f"OffloadOptimizer: param group {gi} needs {format_bytes(est.total_bytes)} of host RAM "
               f"({est.bytes_per_param:.2f} B/param for {est.numel:,} parameters), but this process can take "
               f"{format_bytes(avail)} (MemAvailable, capped by its cgroup's limit). It would need, with {ways}. "
               f"Set {OVERCOMMIT_ENV}=1 to allocate anyway.")
    if os.environ.get(OVERCOMMIT_ENV, "").strip() not in ("", "0"):
        logger.warning("%s (allocating anyway: %s is set)", message, OVERCOMMIT_ENV)
        return
    raise MemoryError(message)


def allocate_group(group: Dict[str, Any], gi: int, options: Options,
                   sharded: Optional[Tuple[int, int]] = None) -> List[FlatBucket]:
    """Lay out and allocate the buckets of param group ``gi`` (cut over ``sharded = (world, rank)``), after a
    warning if the host looks too small for them."""
    layouts = plan_buckets(group["params"], options.bucket_numel)
    world, rank = sharded if sharded is not None else (1, 0)
    amsgrad = bool(group["amsgrad"])
    _check_room(layouts, gi, amsgrad, options, world)
    buckets = []
    for bi, layout in enumerate(layouts):
        shard = None if sharded is None else ShardLayout.cut(layout, world, rank)
        bucket = FlatBucket(layout, group["params"], amsgrad=amsgrad, pin=should_pin(layout.device, options.pin_memory),
                            shard=shard, grads_reduced=options.grads_reduced, where=f"param group {gi}, bucket {bi}",
                            state_dtype=options.state_dtype, group=gi, names=group.get("param_names"))
        if options.delayed_update:
            bucket.add_grad_prev()  # allocated now, so the logged estimate and the RSS include it
        buckets.append(bucket)
    return buckets

"""What an :class:`~zero_offload.OffloadOptimizer` would keep on the GPU and in host RAM for a model of N
parameters (``python -m zero_offload.report --params N``), beside ``torch.optim.AdamW``, and whether that fits:
the host buffers come from the optimizer's own estimate over meta tensors (shape and dtype, no storage), so they
are the bytes its bucket layout would allocate. Nothing is allocated."""

from __future__ import annotations

import dataclasses
import decimal
import re
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from zero_offload.buckets import ALIGN, BucketLayout, align_up, estimate_layouts, home_plan, plan_buckets
from zero_offload.fsdp_units import FsdpUnits, RankBuckets, gathered_bytes, rank_buckets, rank_shards, shard_rooms
from zero_offload.rules.adamw import ADAMW
from zero_offload.rules.base import StateBuffer
from zero_offload.state.store import state_bytes
from zero_offload.home_costs import HomeCost
from zero_offload.host_memory import HostMemoryEstimate
from zero_offload.options import (DEFAULT_BUCKET_NUMEL, STATE_DTYPES, SUPPORTED_DTYPES, Options, dtypes_by_name,
                                  planned_placement)

# (The plan's table, notes and verdicts are zero_offload.plan_text's.)
__all__ = ["MemoryPlan", "count_plan", "fsdp_plan", "fsdp_shards", "memory_plan", "meta_params", "parse_count"]


_DTYPES = dtypes_by_name(SUPPORTED_DTYPES)
_STATE_DTYPES = dtypes_by_name(STATE_DTYPES)
# The plan is of AdamW's state (the drop-in's), its buffer names from the rule's declarations.
_RULE = ADAMW
_BUFFERS = {b.name: b for b in _RULE.buffers}
_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
# The largest parameter count a plan is made for: torch counts elements in int64.
MAX_COUNT = 2**63 - 1


def parse_count(text: str) -> int:
    """A parameter count written as ``7B``, ``350M``, ``125k``, ``1.5T``, ``1.3e9``, ``1_000_000`` or ``1,000``.

    Suffixes are decimal (k = 1e3, M = 1e6, B or G = 1e9, T = 1e12), case-insensitive, as model names use them.
    The number is read exactly (as a decimal, not a float), so ``1.5`` or ``1.2345k`` is refused rather than
    rounded to a count nobody asked for.

    Args:
        text (str): the count.

    Returns:
        int: the count.

    Raises:
        ValueError: if ``text`` is not a whole number of parameters from 1 to :data:`MAX_COUNT`, with an optional
            suffix.
    """
    m = re.fullmatch(r"\s*([0-9][0-9_,]*(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ValueError(f"Invalid parameter count: {text!r} (expected e.g. 7B, 350M, 125k or 1.3e9)")
    number = decimal.Decimal(m.group(1).replace("_", "").replace(",", "")).as_tuple()
    # Scaled by the suffix through the exponent: exact, where a decimal multiplication would round to 28 digits.
    shift = len(str(_SUFFIXES[m.group(2).lower()])) - 1
    count = decimal.Decimal((number.sign, number.digits, number.exponent + shift))
    if count < 1:
        raise ValueError(f"Invalid parameter count: {text!r} (must be at least 1)")
    if count > MAX_COUNT:  # compared as a decimal: int() of 1e999999999 alone would take minutes
        raise ValueError(f"Invalid parameter count: {text!r} (at most {MAX_COUNT:.3e}: element counts are int64)")
    if count != count.to_integral_value():
        raise ValueError(f"Invalid parameter count: {text!r} (not a whole number of parameters)")
    return int(count)


def meta_params(numel: int, dtype: torch.dtype, bucket_numel: int = DEFAULT_BUCKET_NUMEL
                ) -> List[torch.Tensor]:
    """Stand-ins for a model of ``numel`` parameters: meta tensors (no storage) of ``bucket_numel`` elements each
    and one for the remainder, so they fill as many buckets as a real model of that size. A real model's many
    tensors add at most 63 elements of alignment padding each, a negligible difference at these sizes.

    Args:
        numel (int): parameter count.
        dtype (torch.dtype): the parameters' dtype.
        bucket_numel (int): elements per bucket, as for the optimizer. Default: 2**25.
    """
    full, rest = divmod(int(numel), int(bucket_numel))
    sizes = [bucket_numel] * full + ([rest] if rest else [])
    return [torch.empty(n, dtype=dtype, device="meta") for n in sizes]


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank that training a model costs with ``OffloadOptimizer`` and with ``torch.optim.AdamW``, by
    where they live. Parameters, gradients and optimizer state only: activations, the CUDA context and allocator
    caches are the same for both and not counted; FSDP2's all-gathered units are (:attr:`fsdp_units`) where the
    units are known, and otherwise not (their cost per parameter of a unit: :meth:`gathered_unit_bytes`).

    Attributes:
        numel (int): parameters of the model (all ranks hold all of them).
        dtype (torch.dtype): the parameters' (and gradients') dtype.
        device (str): where the model is, ``"cuda"`` or ``"cpu"``.
        world_size (int): data-parallel ranks.
        host (HostMemoryEstimate): the optimizer's host buffers for the whole model, from
            :meth:`OffloadOptimizer.estimate_host_memory` (unsharded).
        ours (Dict[str, Dict[str, int]]): with ``OffloadOptimizer``, ``{"gpu": {...}, "host": {...}}`` item ->
            bytes per rank. Host items are the optimizer's buffers (``master``, the update rule's state buffers,
            ``grad buffer``, ``staging``), each divided evenly over ``world_size`` ranks, and,
            for a CPU model, its ``.grad`` tensors. The parameters of a CPU model live in ``master`` (fp32) or
            ``staging`` (bf16/fp16) and are not counted twice.
        adamw (Dict[str, Dict[str, int]]): the same for ``torch.optim.AdamW``: parameters, gradients and moments
            (in the parameters' dtype, as AdamW keeps them), all on the model's device, the same on every rank.
        pinned (int): bytes per rank of the optimizer's buffers that are page-locked (default ``pin_memory``).
        state_dtype (torch.dtype): the optimizer's ``state_dtype``.
        release_grads (bool): planned for ``release_grads=True``: on the GPU, ours counts only the gradients of the
            buckets not yet sent (two buckets' worth at most) instead of all of them.
        gpu_tier_numel (int): parameters whose state stays on the GPU (``gpu_fraction``, or ``placement``'s
            resident share): their moments (and a low-precision model's fp32 master; sharded, the rank's shard of
            the reduced gradients) are in ours' GPU rows, not its host rows.
        gpu_stepped_numel (int): parameters of the buckets stepped on the GPU (resident or parked): their gradients
            stay on the GPU whole, ``release_grads`` or not.
        fsdp (int): FSDP2 ranks the parameters are sharded over (``fully_shard``; 1: none). Then ``numel`` is one
            rank's shards (the largest: rank 0's, each parameter's first rows), every row is that rank's (FSDP2 +
            AdamW on its shards beside ours on them), and ``model_numel`` the whole model's.
        model_numel (int): the whole model's parameters (``numel`` unless ``fsdp`` > 1).
        param_dtype (torch.dtype, optional): under FSDP2, ``MixedPrecisionPolicy.param_dtype``: the dtype FSDP2
            all-gathers the shards in and computes in; None: ``dtype``, the shards' storage dtype (the model's dtype
            as built, which the optimizer updates and the gradient shards take).
        reduce_dtype (torch.dtype, optional): under FSDP2, ``MixedPrecisionPolicy.reduce_dtype``: the dtype the
            gradients are reduce-scattered in; None: ``param_dtype``'s.
        placement (str or dict): the optimizer's ``placement`` planned for. Each home's buckets, host RAM, GPU
            memory, bytes copied each way and kernel elements per step are ``host.homes``
            (:class:`~zero_offload.home_costs.HomeCost`); a parked bucket's state is on the GPU from its reload to
            its write-back only, so it is there and not in the GPU rows. ``"auto"`` (placed after the second step,
            from what it measures) is planned as every bucket on the host: its host RAM and kernel time are upper
            bounds.
        fsdp_rank (int): under FSDP2, the rank whose shards the rows are (0, the largest, unless asked).
        fsdp_units (FsdpUnits, optional): under FSDP2, the units the buckets are cut at
            (:func:`~zero_offload.fsdp_units.model_units`), None where they are unknown (a parameter count only);
            with them, on a GPU, the GPU rows of both columns count FSDP2's own buffers (``FSDP2 gathered``,
            ``FSDP2 unit gradients``, ``FSDP2 reduce-scatter``: :func:`~zero_offload.fsdp_units.gathered_bytes`).
        rank_buckets (Tuple[RankBuckets, ...]): under FSDP2, with the model's parameters known, every rank's
            buckets (how many, their elements and padding), ranks alike together.
    """

    numel: int
    dtype: torch.dtype
    device: str
    world_size: int
    host: HostMemoryEstimate
    ours: Dict[str, Dict[str, int]]
    adamw: Dict[str, Dict[str, int]]
    pinned: int
    state_dtype: torch.dtype = torch.float32
    release_grads: bool = False
    gpu_tier_numel: int = 0
    gpu_stepped_numel: int = 0
    fsdp: int = 1
    model_numel: int = 0
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    placement: Union[str, Dict[str, float]] = "host"
    fsdp_rank: int = 0
    fsdp_units: Optional[FsdpUnits] = None
    rank_buckets: Tuple[RankBuckets, ...] = ()

    def total(self, which: str, where: str) -> int:
        """Bytes per rank of ``which`` (``"ours"`` or ``"adamw"``) in ``where`` (``"gpu"`` or ``"host"``)."""
        return sum(getattr(self, which)[where].values())

    def policy_dtypes(self) -> Tuple[torch.dtype, torch.dtype]:
        """FSDP2's ``MixedPrecisionPolicy`` as it applies: the dtype of the gathered parameters (``param_dtype``;
        unset: the shards') and of the reduce-scatter (``reduce_dtype``; unset: the gathered parameters')."""
        param = self.param_dtype or self.dtype
        return param, self.reduce_dtype or param

    def low_dtype(self) -> Optional[torch.dtype]:
        """The low-precision dtype the model computes in (``param_dtype`` under FSDP2, else the model's), or None
        for a model that is fp32 throughout."""
        compute = self.policy_dtypes()[0]
        return compute if compute != torch.float32 else (self.dtype if self.dtype != torch.float32 else None)

    def adamw_moments(self) -> int:
        """AdamW's state buffers per parameter (two; three with amsgrad): its rows beside parameters, gradients and,
        under FSDP2 with the units known, FSDP2's own."""
        return sum(1 for k in self.adamw["gpu" if self.device == "cuda" else "host"] if k in _BUFFERS)

    def fsdp_gpu_bytes(self) -> int:
        """GPU bytes FSDP2 itself takes beside the shards (its rows of the table, the same in both columns: the
        gathered units, their gradients, the reduce-scatter input); 0 where the units are unknown."""
        return sum(v for k, v in self.adamw.get("gpu", {}).items() if k.startswith("FSDP2 "))

    def adamw_recipes(self) -> Dict[str, int]:
        """Bytes per rank of ``torch.optim.AdamW``'s two ways to train a low-precision model (none for a model fp32
        throughout), where AdamW keeps them (the model's device), for the rank's ``numel`` parameters:

        * ``"low"``: everything in the low dtype: parameters, gradients and moments (AdamW keeps its moments in the
          parameters' dtype): (2 + moments) x 2 B per parameter, 8 B for bf16 with two moments.
        * ``"fp32 master"``: the parameters (or FSDP2's shards) in fp32, the masters the optimizer steps, their
          fp32 gradients and fp32 moments: (2 + moments) x 4 B, 16 B with two moments. That is an fp32 model under
          ``torch.autocast``, or FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` over fp32 shards
          (FSDP2 casts the reduced gradient back to the shard's dtype). The low-precision copies the computation
          uses (autocast's casts of the weights, FSDP2's all-gathered units) come and go in forward and backward
          and are not counted here, as activations are not (FSDP2's are in the GPU rows where the units are known:
          :meth:`fsdp_gpu_bytes`).
        """
        low = self.low_dtype()
        if low is None:
            return {}
        moments = self.adamw_moments()
        return {"low": (2 + moments) * low.itemsize * self.numel, "fp32 master": (2 + moments) * 4 * self.numel}

    def gathered_unit_bytes(self) -> Dict[str, int]:
        """Under FSDP2, bytes per parameter of one all-gathered unit (a module given to ``fully_shard``) on the
        GPU, by stage: ``"gathered"``, its parameters whole in ``param_dtype`` (forward, and again at its backward);
        ``"gradients"``, autograd's gradients of them at its backward, in ``param_dtype`` too; then
        ``"reduce_scatter_input"``, the buffer in ``reduce_dtype`` FSDP2 copies those gradients into (after freeing
        the gathered parameters: ``FSDPParamGroup.post_backward`` reshards before it reduces), kept until the
        reduce-scatter is done. With bf16 parameters and fp32 reduction: 2, 2 and 4 B. (The reduce-scatter's
        output, 1/``fsdp`` of its input, is left out.)"""
        param, reduce = self.policy_dtypes()
        return {"gathered": param.itemsize, "gradients": param.itemsize, "reduce_scatter_input": reduce.itemsize}

def memory_plan(params: Sequence[torch.Tensor], *, device: str = "cuda", amsgrad: bool = False, world_size: int = 1,
                bucket_numel: int = DEFAULT_BUCKET_NUMEL, state_dtype: torch.dtype = torch.float32,
                release_grads: bool = False, gpu_fraction: float = 0.0,
                placement: Union[str, Dict[str, float], None] = None, cuts: Optional[Sequence[int]] = None,
                rooms: Optional[Sequence[int]] = None) -> MemoryPlan:
    """What ``OffloadOptimizer`` and ``torch.optim.AdamW`` would keep where for ``params``, allocating nothing.

    The host buffers are :meth:`OffloadOptimizer.estimate_host_memory`'s (the optimizer's own bucket layout, so
    exact); ``params`` only lend their shapes and dtypes, so meta tensors (see :func:`meta_params`) do. With
    ``world_size > 1`` they are one rank's under ``process_group`` sharding (ZeRO): its shard of the fp32 master,
    the moments and the gradient buffer (and, for a CPU model, the full flat gradient and parameter buffers the
    collectives read); parameters and gradients on the GPU stay whole on every rank.

    Args:
        params (Sequence[Tensor]): the model's parameters (real or meta), all of one dtype.
        device (str): where the model would train, ``"cuda"`` or ``"cpu"``. Default: ``"cuda"``.
        amsgrad (bool): as for the optimizer. Default: False.
        world_size (int): data-parallel ranks. Default: 1.
        bucket_numel (int): as for the optimizer. Default: 2**25.
        state_dtype (torch.dtype): as for the optimizer. Default: torch.float32.
        release_grads (bool): as for the optimizer (CUDA model): ``p.grad`` is dropped once its bucket is on its
            way, so the GPU holds the gradients of at most two buckets (filling, in flight). Default: False.
        gpu_fraction (float): as for the optimizer (CUDA model), a number: the first buckets keep their state on
            the GPU (not ``"auto"``: it depends on the free GPU memory at run time). Default: 0.
        placement (str or dict, optional): as for the optimizer; ``"auto"`` is planned as all on the host. Default:
            None: ``"auto"``, or ``"host"`` for a CPU model, a ``gpu_fraction``, compact state (as the optimizer's).
        cuts, rooms (Sequence[int], optional): FSDP2 (:func:`fsdp_plan`): each parameter's unit, at which the
            buckets are cut; the elements of each shard's storage, which its slot takes over.

    Returns:
        MemoryPlan: bytes per rank by location and item.
    """
    params = list(params)
    placement = planned_placement(placement, device == "cuda", state_dtype=state_dtype, gpu_fraction=gpu_fraction)
    dtype = _check_plan_args(params, device, world_size, gpu_fraction, state_dtype, placement)
    options = Options(bucket_numel=bucket_numel, pin_memory=device == "cuda", state_dtype=state_dtype,
                      release_grads=release_grads, gpu_fraction=gpu_fraction, placement=placement)
    # The optimizer's own layout and estimate, for parameters on `device` (meta tensors live on neither).
    layouts = [dataclasses.replace(l, device=torch.device(device)) for l in plan_buckets(params, bucket_numel, cuts,
                                                                                          rooms)]
    needed = _RULE.buffers_for({"amsgrad": amsgrad})
    homes = home_plan(layouts, options)
    host = estimate_layouts(layouts, needed, options, world_size, _RULE, homes=homes)
    gpu_layouts = [l for l, h in zip(layouts, homes) if h == "resident"]
    gpu_tier = _gpu_tier(gpu_layouts, needed, dtype, world_size)
    gpu_numel = sum(l.numel for l in gpu_layouts)
    numel, param_bytes = sum(layout.numel for layout in layouts), sum(p.nbytes for p in params)
    if device == "cpu":
        # A CPU model's parameter storage becomes a view of master/staging (the estimate can only see that for
        # real CPU tensors, not for meta stand-ins).
        host = dataclasses.replace(host, replaces_param_bytes=param_bytes)
    buffers = {("grad buffer" if k == "grad" else k): v for k, v in host.buffers.items() if v}
    # release_grads drops the gradients of streamed buckets only: those stepped on the GPU stay there.
    stepped = sum(l.numel for l, h in zip(layouts, homes) if h != "host")
    kept = stepped * dtype.itemsize
    in_flight = kept + min(param_bytes - kept, 2 * bucket_numel * dtype.itemsize) if release_grads else param_bytes
    ours, adamw = _sides(device, param_bytes, in_flight, {**buffers}, gpu_tier, [b.name for b in needed])
    return MemoryPlan(numel, dtype, device, world_size, dataclasses.replace(host, numel=numel), ours, adamw,
                      host.pinned_bytes, state_dtype, release_grads and device == "cuda", gpu_numel,
                      gpu_stepped_numel=stepped, placement=placement)


def _sides(device: str, param_bytes: int, in_flight: int, buffers: Dict[str, int], gpu_tier: Dict[str, int],
           state_names: Sequence[str]) -> Tuple[Dict[str, Dict[str, int]], Dict[str, Dict[str, int]]]:
    """:attr:`MemoryPlan.ours` and :attr:`MemoryPlan.adamw` from their parts."""
    model_side = {"params": param_bytes, "gradients": param_bytes}
    adamw_side = {**model_side, **{k: param_bytes for k in state_names}}
    if device == "cuda":
        return ({"gpu": {**model_side, "gradients": in_flight, **gpu_tier}, "host": buffers},
                {"gpu": adamw_side, "host": {}})
    # The parameters are views of master/staging, counted there; backward's .grad tensors come on top.
    return {"gpu": {}, "host": {"gradients": param_bytes, **buffers}}, {"gpu": {}, "host": adamw_side}


def _gpu_tier(layouts: Sequence[BucketLayout], needed: Sequence[StateBuffer], dtype: torch.dtype,
              world_size: int) -> Dict[str, int]:
    """GPU bytes per rank of the buckets ``layouts`` on the device tier, by buffer: fp32 moments, a low-precision
    model's fp32 master, and sharded the rank's shard of the reduced gradients (``grad buffer``, held from the
    step's first reduce-scatter to its end; the full buffer the reduce-scatter reads is made and let go of one bucket
    at a time, on the collective stream, as the host route's is on its copy stream) (the parameters' storage becomes the master or staging slots, counted as
    params; FSDP2's shards too: the home takes their storage over)."""
    out: Dict[str, int] = {}
    for layout in layouts:
        padded = layout.padded_numel if world_size == 1 else align_up(layout.padded_numel, ALIGN * world_size)
        rows = state_bytes(needed, torch.float32, padded // world_size)
        if dtype != torch.float32:
            rows["master"] = 4 * padded // world_size
        if world_size > 1:
            rows["grad buffer"] = dtype.itemsize * padded // world_size
        for name, n in rows.items():
            out[name] = out.get(name, 0) + n
    return out


def _check_gpu_fraction(gpu_fraction: float, device: str, state_dtype: torch.dtype,
                        placement: Union[str, Dict[str, float]] = "host") -> None:
    """The optimizer's checks of ``gpu_fraction`` and ``placement``, less ``gpu_fraction="auto"`` (it depends on the
    free GPU memory at run time, which a plan does not know), for a CUDA model."""
    if gpu_fraction == "auto":
        raise ValueError("Invalid gpu_fraction: 'auto' for a plan (it depends on the free GPU memory at run time, "
                         "which a plan does not know): give a number from 0 to 1")
    options = Options(state_dtype=state_dtype, gpu_fraction=gpu_fraction, placement=placement)
    options._check_gpu_tier()
    if options.gpu_tier and device != "cuda":
        raise ValueError(f"{options.gpu_option} applies to a CUDA model (its state is stepped on the GPU)")


def _check_plan_args(params: Sequence[torch.Tensor], device: str, world_size: int, gpu_fraction: float = 0.0,
                     state_dtype: torch.dtype = torch.float32,
                     placement: Union[str, Dict[str, float]] = "host") -> torch.dtype:
    """:func:`memory_plan`'s checks of its arguments; returns the parameters' one dtype."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"Invalid device: {device!r} (expected 'cuda' or 'cpu')")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"Invalid world_size: {world_size!r} (a positive number of ranks)")
    _check_gpu_fraction(gpu_fraction, device, state_dtype, placement)
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(f"memory_plan needs parameters of one dtype, got {sorted(map(str, dtypes))}")
    return next(iter(dtypes))


def count_plan(numel: int, dtype: torch.dtype, *, bucket_numel: int = DEFAULT_BUCKET_NUMEL, **kw) -> MemoryPlan:
    """:func:`memory_plan` of :func:`meta_params` ``(numel, dtype, bucket_numel)``, made from at most three stand-in
    tensors whatever ``numel`` is: every full bucket costs the same, so two of them and the remainder are planned
    and the other full buckets' bytes added arithmetically (all but the GPU gradients under ``release_grads``,
    which two buckets already cap). Memory and time do not grow with the model.

    Args:
        numel (int): parameter count.
        dtype (torch.dtype): the parameters' dtype.
        bucket_numel (int): as for the optimizer. Default: 2**25.
        **kw: the other arguments of :func:`memory_plan`.
    """
    full, rest = divmod(int(numel), int(bucket_numel))
    fraction = kw.pop("gpu_fraction", 0.0)
    placement = planned_placement(kw.pop("placement", None), kw.get("device", "cuda") == "cuda",
                                  state_dtype=kw.get("state_dtype", torch.float32), gpu_fraction=fraction)
    _check_gpu_fraction(fraction, kw.get("device", "cuda"), kw.get("state_dtype", torch.float32), placement)
    runs = _home_runs(full, rest, bucket_numel, Options(gpu_fraction=fraction, placement=placement))
    if len(runs) > 1:
        # Each home's run of buckets (the first resident, the next parked, the rest on the host, as home_plan
        # places them) planned apart, added up.
        plans = [count_plan(n, dtype, bucket_numel=bucket_numel, placement=home, **kw) for home, n in runs]
        total = plans[0]
        for other in plans[1:]:
            total = _sum_plans(total, other, 1, bucket_numel)
        return dataclasses.replace(total, placement=placement)
    kw.update(gpu_fraction=fraction, placement=placement)
    if full <= 2:
        return memory_plan(meta_params(numel, dtype, bucket_numel), bucket_numel=bucket_numel, **kw)
    head = memory_plan(meta_params(2 * bucket_numel + rest, dtype, bucket_numel), bucket_numel=bucket_numel, **kw)
    one = memory_plan(meta_params(bucket_numel, dtype, bucket_numel), bucket_numel=bucket_numel, **kw)
    return _sum_plans(head, one, full - 2, bucket_numel)


def _home_runs(full: int, rest: int, bucket_numel: int, options: Options) -> List[Tuple[str, int]]:
    """(home, elements) of each run of buckets of one home, in order, for ``full`` buckets of ``bucket_numel``
    elements and a remainder of ``rest`` on a GPU: :func:`~zero_offload.buckets.home_plan`'s rule (each home in turn
    takes the next buckets while they fit in the shares so far; a bucket that does not fit moves on to the next home,
    none left: the rest on the host), counted per home rather than per bucket (a count may be of 10**18 buckets)."""
    shares, total = options.shares(), full * bucket_numel + rest
    runs: List[Tuple[str, int]] = []
    used, budget, placed = 0, 0.0, 0  # elements placed, the shares so far (as home_plan: a float), full buckets
    for home in (h for h in ("resident", "parked") if h in shares):
        budget += shares[home] * total
        k = max(0, min(full - placed, int((budget - used) // bucket_numel)))
        while k < full - placed and used + (k + 1) * bucket_numel <= budget:  # (the float guess, made exact)
            k += 1
        while k > 0 and used + k * bucket_numel > budget:
            k -= 1
        took = k * bucket_numel
        placed += k
        if placed == full and rest and used + took + rest <= budget:  # (the remainder, last, fits too)
            took += rest
        used += took
        if took:
            runs.append((home, took))
        if used == total:
            break
    if used < total:
        runs.append(("host", total - used))
    return runs


def fsdp_shards(params: Sequence[torch.Tensor], ranks: int) -> List[torch.Tensor]:
    """Meta stand-ins for rank 0's shards of ``params`` under FSDP2 over ``ranks`` ranks: each parameter cut along
    its first dimension into ``ceil(rows / ranks)``-row pieces (``fully_shard``'s ``Shard(0)``), rank 0 holding the
    first (the largest shards: later ranks hold as many rows or fewer). See
    :func:`~zero_offload.fsdp_units.rank_shards` for another rank's."""
    return rank_shards(params, ranks, 0)


def fsdp_plan(params: Optional[Sequence[torch.Tensor]], numel: int, dtype: torch.dtype, ranks: int, *,
              param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = None,
              units: Optional[FsdpUnits] = None, rank: int = 0, **kw) -> MemoryPlan:
    """The plan of one rank of an FSDP2 run over ``ranks`` ranks: what ``OffloadOptimizer`` and ``torch.optim.AdamW``
    keep for that rank's shards (FSDP does the collectives, each rank's optimizer sees only its shards). Given
    ``params`` (a model's, real or meta), rank ``rank``'s shards of them (:func:`fsdp_shards`: rank 0's, the
    largest), cut into buckets as the optimizer cuts them: at each of FSDP2's ``units``
    (:func:`~zero_offload.fsdp_units.model_units`; None: unknown, not cut) and with room for FSDP's padding rows
    (the slots take FSDP's storage over); every rank's buckets are in ``rank_buckets``. Else a model of ``numel``
    parameters, ``ceil(numel / ranks)`` of them on the rank (its units unknown). ``**kw``: :func:`memory_plan`'s other
    arguments (``world_size`` is not combined with FSDP2; ``gpu_fraction`` is planned as
    ``placement={"resident": f}``).
    ``device="cpu"``: the shards on the host (a
    CPU mesh, or ``CPUOffloadPolicy``): they are the masters (fp32) or the staging copies, their gradients FSDP's
    own (the ``gradients`` row), read where FSDP leaves them: no gradient buffer. ``placement`` (a CUDA model) is
    the optimizer's under FSDP2: each rank places its own shards' buckets, a parked or resident one taking over
    the storage FSDP keeps for its shards, as on one GPU a parameter is bound to its slot: the bytes per parameter
    of one GPU (each home's figures in ``host.homes``).

    ``param_dtype`` and ``reduce_dtype`` are FSDP2's ``MixedPrecisionPolicy``'s (None: as there). ``dtype`` (or
    ``params``' dtype) is the shards' storage dtype, the model's as built: the table's rows do not change with the
    policy, since FSDP2 keeps the shards and casts their reduced gradients to that dtype; the all-gathered units
    do (:meth:`MemoryPlan.gathered_unit_bytes`). With ``units`` on a GPU, the GPU rows (both columns) count what
    FSDP2 itself holds there beside the shards (:func:`~zero_offload.fsdp_units.gathered_bytes`: the gathered
    units, their gradients, the reduce-scatter input)."""
    params = None if params is None else list(params)
    _check_fsdp_args(params, ranks, rank, param_dtype, reduce_dtype, units, kw.get("world_size", 1))
    fraction = kw.pop("gpu_fraction", 0.0)
    if fraction:  # (the optimizer takes it under FSDP2 as its alias, placement={"resident": f})
        if kw.get("placement") not in (None, "host"):
            _check_gpu_fraction(fraction, kw.get("device", "cuda"), kw.get("state_dtype", torch.float32),
                                kw["placement"])
        kw["placement"] = {"resident": fraction}
    mine: Tuple[RankBuckets, ...] = ()
    if params is not None:
        plan = memory_plan(rank_shards(params, ranks, rank), cuts=None if units is None else units.keys,
                           rooms=shard_rooms(params, ranks), **kw)
        whole = sum(p.numel() for p in params)
        mine = rank_buckets(params, units, ranks, kw.get("bucket_numel", DEFAULT_BUCKET_NUMEL))
    else:
        plan = count_plan(-(-int(numel) // ranks), dtype, **kw)
        whole = int(numel)
    plan = dataclasses.replace(plan, fsdp=ranks, model_numel=whole, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                               fsdp_rank=rank, fsdp_units=units, rank_buckets=mine)
    if plan.device == "cpu":
        host = dataclasses.replace(plan.host, buffers={k: v for k, v in plan.host.buffers.items() if k != "grad"})
        ours = {**plan.ours, "host": {k: v for k, v in plan.ours["host"].items() if k != "grad buffer"}}
        plan = dataclasses.replace(plan, host=host, ours=ours)
    elif units is not None:  # (FSDP2's own GPU memory, the same beside either optimizer)
        own = {f"FSDP2 {k}": v for k, v in gathered_bytes(params, units, ranks, *plan.policy_dtypes()).items()}
        plan = dataclasses.replace(plan, **{side: {**getattr(plan, side), "gpu": {**getattr(plan, side)["gpu"], **own}}
                                            for side in ("ours", "adamw")})
    return plan


def _check_fsdp_args(params: Optional[Sequence[torch.Tensor]], ranks: int, rank: int,
                     param_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype],
                     units: Optional[FsdpUnits], world_size: int) -> None:
    """:func:`fsdp_plan`'s checks of its arguments."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"Invalid fsdp: {ranks!r} (a positive number of FSDP2 ranks)")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
        raise ValueError(f"Invalid rank: {rank!r} (one of the {ranks} FSDP2 ranks, 0 to {ranks - 1})")
    for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if value is not None and value not in _DTYPES.values():
            raise ValueError(f"Invalid {name}: {value!r} (MixedPrecisionPolicy's {name} for a plan: one of "
                             f"{', '.join(map(str, _DTYPES.values()))}, or None)")
    if world_size != 1:
        raise ValueError("an FSDP2 plan takes no world_size: FSDP shards the parameters and each rank's optimizer "
                         "offloads the state of its own shards (the optimizer refuses a process_group there)")
    if units is not None and (params is None or len(units.keys) != len(params)):
        raise ValueError(f"FSDP2 units for {len(units.keys)} parameters, given "
                         f"{'none' if params is None else len(params)}: one unit per parameter of the model")


def _sum_plans(a: MemoryPlan, b: MemoryPlan, k: int, bucket_numel: int) -> MemoryPlan:
    """The plan of a model made of ``a``'s parameters and ``k`` times ``b``'s (same settings). Under
    ``release_grads`` two buckets' worth cap the GPU gradients of streamed buckets whatever the model."""
    def add(x: Dict[str, int], y: Dict[str, int]) -> Dict[str, int]:
        return {key: x.get(key, 0) + k * y.get(key, 0) for key in dict.fromkeys([*x, *y])}

    h, o = a.host, b.host
    homes = {key: h.homes.get(key, HomeCost()) + o.homes.get(key, HomeCost()).times(k)
             for key in dict.fromkeys([*h.homes, *o.homes])}
    host = HostMemoryEstimate(h.numel + k * o.numel, h.padded_numel + k * o.padded_numel, add(h.buffers, o.buffers),
                              h.pinned_bytes + k * o.pinned_bytes, h.replaces_param_bytes + k * o.replaces_param_bytes,
                              homes)
    ours = {where: add(a.ours[where], b.ours[where]) for where in a.ours}
    if a.release_grads:
        size = a.dtype.itemsize
        kept = (a.gpu_stepped_numel + k * b.gpu_stepped_numel) * size  # (HomeCost.numel is a rank's share)
        streamed = ours["gpu"]["gradients"] - kept
        ours["gpu"]["gradients"] = kept + min(streamed, 2 * bucket_numel * size)
    adamw = {where: add(a.adamw[where], b.adamw[where]) for where in a.adamw}
    return dataclasses.replace(a, numel=a.numel + k * b.numel, host=host, ours=ours, adamw=adamw,
                               pinned=a.pinned + k * b.pinned, gpu_tier_numel=a.gpu_tier_numel + k * b.gpu_tier_numel,
                               gpu_stepped_numel=a.gpu_stepped_numel + k * b.gpu_stepped_numel)

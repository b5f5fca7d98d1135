"""What an :class:`~zero_offload.OffloadOptimizer` would keep on the GPU and in host RAM for a model of N
parameters (``python -m zero_offload.report --params N``), beside ``torch.optim.AdamW``, and whether that fits:
the host buffers come from the optimizer's own estimate over meta tensors (shape and dtype, no storage), so they
are the bytes its bucket layout would allocate. Nothing is allocated."""

from __future__ import annotations

import dataclasses
import decimal
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload.buckets import ALIGN, BucketLayout, align_up, estimate_layouts, home_plan, plan_buckets
from zero_offload.rules.adamw import ADAMW
from zero_offload.rules.base import StateBuffer
from zero_offload.state.store import state_bytes
from zero_offload.host_memory import HostMemoryEstimate, format_bytes
from zero_offload.options import (DEFAULT_BUCKET_NUMEL, DTYPE_NAMES, STATE_DTYPES, SUPPORTED_DTYPES, Options,
                                  dtypes_by_name)



__all__ = ["MemoryPlan", "count_plan", "fsdp_plan", "fsdp_shards", "gpu_capacity", "memory_plan", "meta_params",
           "parse_count", "plan_dict",
           "plan_lines", "verdict_lines", "verdicts"]


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
    caches are the same for both and not counted.

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
        gpu_tier_numel (int): parameters whose state stays on the GPU (``gpu_fraction``): their moments (and a
            low-precision model's fp32 master; sharded, the full gradient buffer the reduce-scatter reads) are in
            ours' GPU rows, not its host rows.
        fsdp (int): FSDP2 ranks the parameters are sharded over (``fully_shard``; 1: none). Then ``numel`` is one
            rank's shards (the largest: rank 0's, each parameter's first rows), every row is that rank's (FSDP2 +
            AdamW on its shards beside ours on them), and ``model_numel`` the whole model's.
        model_numel (int): the whole model's parameters (``numel`` unless ``fsdp`` > 1).
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
    fsdp: int = 1
    model_numel: int = 0

    def total(self, which: str, where: str) -> int:
        """Bytes per rank of ``which`` (``"ours"`` or ``"adamw"``) in ``where`` (``"gpu"`` or ``"host"``)."""
        return sum(getattr(self, which)[where].values())


def memory_plan(
    params: Sequence[torch.Tensor],
    *,
    device: str = "cuda",
    amsgrad: bool = False,
    world_size: int = 1,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    state_dtype: torch.dtype = torch.float32,
    release_grads: bool = False,
    gpu_fraction: float = 0.0,
) -> MemoryPlan:
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
            way, so the GPU holds the gradients of at most two buckets (the one filling, the one in flight).
            Default: False.
        gpu_fraction (float): as for the optimizer (CUDA model), a number: the first buckets keep their state on
            the GPU. (``"auto"`` depends on the free GPU memory at run time, which a plan does not know.)
            Default: 0.

    Returns:
        MemoryPlan: bytes per rank by location and item.
    """
    params = list(params)
    dtype = _check_plan_args(params, device, world_size, gpu_fraction, state_dtype)
    options = Options(bucket_numel=bucket_numel, pin_memory=device == "cuda", state_dtype=state_dtype,
                      release_grads=release_grads, gpu_fraction=gpu_fraction)
    # The optimizer's own layout and estimate, for parameters on `device` (meta tensors live on neither).
    layouts = [dataclasses.replace(layout, device=torch.device(device))
               for layout in plan_buckets(params, options.bucket_numel)]
    needed = _RULE.buffers_for({"amsgrad": amsgrad})
    on_gpu = [home == "resident" for home in home_plan(layouts, options)]
    host = estimate_layouts([l for l, g in zip(layouts, on_gpu) if not g], needed, options, world_size, _RULE)
    gpu_layouts = [l for l, g in zip(layouts, on_gpu) if g]
    gpu_tier, gpu_numel = _gpu_tier(gpu_layouts, needed, dtype, world_size), sum(l.numel for l in gpu_layouts)
    numel, param_bytes = sum(layout.numel for layout in layouts), sum(p.nbytes for p in params)
    if device == "cpu":
        # A CPU model's parameter storage becomes a view of master/staging (the estimate can only see that for
        # real CPU tensors, not for meta stand-ins).
        host = dataclasses.replace(host, replaces_param_bytes=param_bytes)
    buffers = {("grad buffer" if k == "grad" else k): v for k, v in host.buffers.items() if v}
    # release_grads drops the gradients of streamed buckets only: the device tier's stay on the GPU.
    kept = gpu_numel * dtype.itemsize
    in_flight = kept + min(param_bytes - kept, 2 * bucket_numel * dtype.itemsize) if release_grads else param_bytes
    ours, adamw = _sides(device, param_bytes, in_flight, {**buffers}, gpu_tier, [b.name for b in needed])
    return MemoryPlan(numel, dtype, device, world_size, dataclasses.replace(host, numel=numel), ours, adamw,
                      host.pinned_bytes, state_dtype, release_grads and device == "cuda", gpu_numel)


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
    model's fp32 master, and sharded the full gradient buffer the reduce-scatter reads (the parameters' storage
    becomes the master or staging slots, counted as params)."""
    out: Dict[str, int] = {}
    for layout in layouts:
        padded = layout.padded_numel if world_size == 1 else align_up(layout.padded_numel, ALIGN * world_size)
        rows = state_bytes(needed, torch.float32, padded // world_size)
        if dtype != torch.float32:
            rows["master"] = 4 * padded // world_size
        if world_size > 1:
            rows["flat_grad"] = padded * dtype.itemsize
        for name, n in rows.items():
            out[name] = out.get(name, 0) + n
    return out


def _check_gpu_fraction(gpu_fraction: float, device: str, state_dtype: torch.dtype) -> None:
    """The optimizer's checks of ``gpu_fraction``, less ``"auto"`` (it depends on the free GPU memory at run time,
    which a plan does not know), for a CUDA model."""
    if gpu_fraction == "auto":
        raise ValueError("Invalid gpu_fraction: 'auto' for a plan (it depends on the free GPU memory at run time, "
                         "which a plan does not know): give a number from 0 to 1")
    Options(state_dtype=state_dtype, gpu_fraction=gpu_fraction)._check_gpu_tier()
    if gpu_fraction and device != "cuda":
        raise ValueError("gpu_fraction applies to a CUDA model (its state stays on the GPU)")


def _check_plan_args(params: Sequence[torch.Tensor], device: str, world_size: int, gpu_fraction: float = 0.0,
                     state_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """:func:`memory_plan`'s checks of its arguments; returns the parameters' one dtype."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"Invalid device: {device!r} (expected 'cuda' or 'cpu')")
    _check_gpu_fraction(gpu_fraction, device, state_dtype)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"Invalid world_size: {world_size!r} (a positive number of ranks)")
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
    _check_gpu_fraction(fraction, kw.get("device", "cuda"), kw.get("state_dtype", torch.float32))
    if 0 < fraction < 1:
        # The first full buckets that fit in the fraction (the remainder, last, only with all) keep their state on
        # the GPU: planned apart, added up.
        on_gpu = min(full, int(fraction * numel // bucket_numel)) * bucket_numel
        if not on_gpu:
            fraction = 0.0
        else:
            gpu = count_plan(on_gpu, dtype, bucket_numel=bucket_numel, gpu_fraction=1.0, **kw)
            return _sum_plans(gpu, count_plan(numel - on_gpu, dtype, bucket_numel=bucket_numel, **kw), 1,
                              bucket_numel)
    if full <= 2:
        return memory_plan(meta_params(numel, dtype, bucket_numel), bucket_numel=bucket_numel, gpu_fraction=fraction,
                           **kw)
    head = memory_plan(meta_params(2 * bucket_numel + rest, dtype, bucket_numel), bucket_numel=bucket_numel,
                       gpu_fraction=fraction, **kw)
    one = memory_plan(meta_params(bucket_numel, dtype, bucket_numel), bucket_numel=bucket_numel,
                      gpu_fraction=fraction, **kw)
    return _sum_plans(head, one, full - 2, bucket_numel)


def fsdp_shards(params: Sequence[torch.Tensor], ranks: int) -> List[torch.Tensor]:
    """Meta stand-ins for rank 0's shards of ``params`` under FSDP2 over ``ranks`` ranks: each parameter cut along
    its first dimension into ``ceil(rows / ranks)``-row pieces (``fully_shard``'s ``Shard(0)``), rank 0 holding the
    first (the largest shards: later ranks hold as many rows or fewer)."""
    out = []
    for p in params:
        shape = tuple(p.shape) or (1,)
        out.append(torch.empty((-(-shape[0] // ranks),) + shape[1:], dtype=p.dtype, device="meta"))
    return out


def fsdp_plan(params: Optional[Sequence[torch.Tensor]], numel: int, dtype: torch.dtype, ranks: int,
              **kw) -> MemoryPlan:
    """The plan of one rank of an FSDP2 run over ``ranks`` ranks: what ``OffloadOptimizer`` and ``torch.optim.AdamW``
    keep for that rank's shards (FSDP does the collectives, each rank's optimizer sees only its shards). Given
    ``params`` (a model's, real or meta), rank 0's shards of them (:func:`fsdp_shards`); else a model of ``numel``
    parameters, ``ceil(numel / ranks)`` of them on the rank. ``**kw``: :func:`memory_plan`'s other arguments
    (``world_size`` and ``gpu_fraction`` are not combined with FSDP2). ``device="cpu"``: the shards on the host (a
    CPU mesh, or ``CPUOffloadPolicy``): they are the masters (fp32) or the staging copies, their gradients FSDP's
    own (the ``gradients`` row), read where FSDP leaves them: no gradient buffer."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"Invalid fsdp: {ranks!r} (a positive number of FSDP2 ranks)")
    if kw.get("world_size", 1) != 1 or kw.get("gpu_fraction", 0.0):
        raise ValueError("an FSDP2 plan takes no world_size or gpu_fraction: FSDP shards the parameters and each "
                         "rank's optimizer offloads the state of its own shards (the optimizer refuses both there)")
    if params is not None:
        params = list(params)
        plan = memory_plan(fsdp_shards(params, ranks), **kw)
        whole = sum(p.numel() for p in params)
    else:
        plan = count_plan(-(-int(numel) // ranks), dtype, **kw)
        whole = int(numel)
    if plan.device == "cpu":
        host = dataclasses.replace(plan.host, buffers={k: v for k, v in plan.host.buffers.items() if k != "grad"})
        ours = {**plan.ours, "host": {k: v for k, v in plan.ours["host"].items() if k != "grad buffer"}}
        plan = dataclasses.replace(plan, host=host, ours=ours)
    return dataclasses.replace(plan, fsdp=ranks, model_numel=whole)


def _sum_plans(a: MemoryPlan, b: MemoryPlan, k: int, bucket_numel: int) -> MemoryPlan:
    """The plan of a model made of ``a``'s parameters and ``k`` times ``b``'s (same settings). Under
    ``release_grads`` two buckets' worth cap the GPU gradients of streamed buckets whatever the model."""
    def add(x: Dict[str, int], y: Dict[str, int]) -> Dict[str, int]:
        return {key: x.get(key, 0) + k * y.get(key, 0) for key in dict.fromkeys([*x, *y])}

    h, o = a.host, b.host
    host = HostMemoryEstimate(h.numel + k * o.numel, h.padded_numel + k * o.padded_numel, add(h.buffers, o.buffers),
                              h.pinned_bytes + k * o.pinned_bytes, h.replaces_param_bytes + k * o.replaces_param_bytes)
    ours = {where: add(a.ours[where], b.ours[where]) for where in a.ours}
    if a.release_grads:
        size = a.dtype.itemsize
        kept = (a.gpu_tier_numel + k * b.gpu_tier_numel) * size
        streamed = ours["gpu"]["gradients"] - kept
        ours["gpu"]["gradients"] = kept + min(streamed, 2 * bucket_numel * size)
    adamw = {where: add(a.adamw[where], b.adamw[where]) for where in a.adamw}
    return dataclasses.replace(a, numel=a.numel + k * b.numel, host=host, ours=ours, adamw=adamw,
                               pinned=a.pinned + k * b.pinned, gpu_tier_numel=a.gpu_tier_numel + k * b.gpu_tier_numel)


def plan_lines(plan: MemoryPlan) -> List[str]:
    """The memory plan as a table: bytes and bytes per parameter, per rank, ours beside AdamW's."""
    name = DTYPE_NAMES[plan.dtype]
    n = plan.numel
    sharded = plan.world_size > 1
    whole = plan.model_numel or n
    out = [
        f"memory plan      {whole:,} parameters{_short_count(whole)}, {name} model on {plan.device}"
        + (f", {plan.world_size} data-parallel ranks" if sharded else "")
        + (f", sharded by FSDP2 over {plan.fsdp} ranks" if plan.fsdp > 1 else ""),
        "                 parameters, gradients and optimizer state per rank; activations not counted",
        "                 nothing allocated: host buffers from OffloadOptimizer.estimate_host_memory over meta tensors",
    ]
    if plan.fsdp > 1:
        out += [f"                 FSDP2: each rank holds {n:,} of them (rank 0's shards, the largest), which its "
                "optimizer offloads;",
                "                 B/param below is per parameter of those shards; FSDP2 + torch.optim.AdamW beside it; "
                "the units'",
                "                 parameters all-gathered for forward and backward (about two units) are not counted"]
    if sharded:
        out.append(f"                 host buffers: one rank's shard under OffloadOptimizer(process_group=...) of "
                   f"{plan.world_size} ranks")
    state = "8-bit" if plan.state_dtype == torch.int8 else DTYPE_NAMES[plan.state_dtype]
    home = "master" if plan.dtype == torch.float32 else "staging"
    rows = _table_rows(plan, state, home)
    width = max(26, *(len(label) + 1 for label, _, _ in rows))
    out += ["", f"{'':{width}}{'OffloadOptimizer':>26}{'torch.optim.AdamW':>26}",
            f"{'':{width}}{'bytes':>16}{'B/param':>10}{'bytes':>16}{'B/param':>10}"]
    out += [f"{label:<{width}}{a}{b}".rstrip() if a else label for label, a, b in rows]
    if plan.dtype != torch.float32 or plan.state_dtype != torch.float32:
        out.append(f"  (AdamW keeps its moments in the parameters' dtype and no fp32 master; ours are {state})")
    out += _state_lines(plan, state)
    out.append("")
    return out + _note_lines(plan, home)


_ROW_ORDER = ("params", "gradients", "master", *_BUFFERS, *(name + "_scale" for name in _BUFFERS), "grad buffer",
              "staging", "grad_prev", "flat_grad")


def _table_rows(plan: MemoryPlan, state: str, home: str) -> List[Tuple[str, str, str]]:
    """The table's rows: (label, ours' cells, AdamW's cells); a label without cells is a heading."""
    n, name = plan.numel, DTYPE_NAMES[plan.dtype]

    def cell(b: Optional[int]) -> str:
        return f"{'-':>16}{'':>10}" if b is None else f"{format_bytes(b):>16}{b / n:>10.2f}"

    rows: List[Tuple[str, str, str]] = []
    for where in ("gpu", "host"):
        ours, adamw = plan.ours[where], plan.adamw[where]
        if not ours and not adamw:
            continue
        rows.append((f"{'GPU' if where == 'gpu' else 'host'} (per rank)", "", ""))
        for item in (i for i in _ROW_ORDER if i in ours or i in adamw):
            ours_cell = cell(ours.get(item))
            if item == "params" and item not in ours and plan.device == "cpu":
                ours_cell = f"{'in ' + home:>16}{'':>10}"
            rows.append((f"  {item} ({_row_dtype(item, name, state, item in ours, item in adamw)})", ours_cell,
                         cell(adamw.get(item))))
        rows.append(("  total", cell(plan.total("ours", where)), cell(plan.total("adamw", where))))
    return rows


def _row_dtype(item: str, name: str, state: str, in_ours: bool, in_adamw: bool) -> str:
    """A row's dtype: the model's for parameters and gradients, fp32 for masters and scales; AdamW keeps its
    moments in the parameters' dtype, ours in the state dtype."""
    if item in ("params", "gradients", "grad buffer", "staging"):
        return name
    if item not in _BUFFERS:
        return "fp32"
    ours = ("int8" if _BUFFERS[item].signed else "uint8") if state == "8-bit" else state
    if not in_ours:
        return name
    return f"{ours}; AdamW {name}" if in_adamw and ours != name else ours


def _note_lines(plan: MemoryPlan, home: str) -> List[str]:
    """Where the host buffers and the gradients live, under the plan's table."""
    sharded = plan.world_size > 1
    out: List[str] = []
    pinned_note = "page-locked" if plan.pinned else "pageable (pinning buys nothing without GPU copies)"
    out.append(f"host memory      {format_bytes(plan.pinned or plan.total('ours', 'host'))} {pinned_note}")
    if plan.device == "cpu" and sharded:
        out.append(f"                 the parameters are views of one flat buffer (params and this rank's {home}); "
                   "after")
        out.append("                 zero_grad(set_to_none=False) the .grad tensors are views of flat_grad, which "
                   "saves the gradients row")
    elif plan.device == "cpu" and plan.fsdp > 1:
        out.append(f"                 the shards FSDP2 keeps on the host (CPUOffloadPolicy, or a CPU mesh) are views "
                   f"of {home};")
        out.append("                 their gradients are FSDP's, read where FSDP leaves them (no grad buffer)")
    elif plan.device == "cpu":
        out.append(f"                 the parameters are views of {home}; after zero_grad(set_to_none=False) the "
                   ".grad tensors")
        out.append("                 are views of the grad buffer, which saves the gradients row")
    if plan.gpu_tier_numel:
        out.append(f"GPU state        gpu_fraction: {plan.gpu_tier_numel:,} parameters "
                   f"({plan.gpu_tier_numel / plan.numel:.0%}, the first buckets) keep their state on the GPU, updated")
        out.append("                 there by torch's fused AdamW; the GPU rows above include it")
    if plan.device == "cuda" and plan.release_grads:
        out.append("gradients        release_grads=True: each .grad is dropped once its bucket is copied, so the GPU "
                   "holds at most")
        out.append("                 two buckets' gradients (clip with opt.clip_grad_norm_; no GradScaler)")
    elif plan.device == "cuda":
        out.append("gradients        copied to the grad buffer during backward, bucket by bucket; the .grad tensors "
                   "stay on")
        out.append("                 the GPU as with AdamW, unless release_grads=True (then only buckets in flight)")
        if plan.dtype != torch.float32 and not sharded:
            out.append(f"                 the grad buffer also carries the updated {DTYPE_NAMES[plan.dtype]} parameters "
                       "back (no staging copy)")
    if plan.device == "cuda" and not sharded:
        out += _speculation_lines(plan)
        copy = plan.host.padded_numel * plan.dtype.itemsize
        out += [f"uploads          with speculate=True or delayed_update: up to {format_bytes(copy)} more on the GPU "
                "during backward", "                 (the new parameters, copied up early, only where the GPU has "
                "room beyond gpu_margin_gib;", "                 given back at step(); none with "
                "uploads_in_backward=False; not in the verdict below)"]
    return out


def _speculation_lines(plan: MemoryPlan) -> List[str]:
    """Speculation's pool of spare buffers, on top of the table (``speculate=True``, a model on GPUs): its worst
    case."""
    outputs = plan.host.padded_numel * plan.dtype.itemsize if plan.dtype != torch.float32 else 0
    worst = plan.host.state_bytes + outputs
    return [f"speculation      with speculate=True (off by default): a pool on top of the table, at most "
            f"{format_bytes(worst)} ({worst / plan.numel:.3g} B/param:",
            "                 every bucket speculated at once); it holds what the worker reaches during backward "
            "(learned),", "                 or at most speculation_memory bytes (not in the verdict below)"]


def _short_count(n: int) -> str:
    """`` (1.3B)``-style count of parameters, or nothing below a thousand."""
    for suffix in "tbmk":  # (parse_count's suffixes, which read it back)
        if n >= _SUFFIXES[suffix]:
            return f" ({n / _SUFFIXES[suffix]:.3g}{suffix.upper()})"
    return ""


def _state_lines(plan: MemoryPlan, state: str) -> List[str]:
    """The byte arithmetic of the moments for the plan's ``state_dtype``, per parameter and per rank."""
    moments = [m for m in _BUFFERS if plan.host.buffers.get(m)]
    per = {"fp32": "4 B", "bf16": "2 B", "8-bit": "1 B code + 4 B scale / 64 = 1.0625 B"}[state]
    share = sum(plan.host.buffers.get(m, 0) + plan.host.buffers.get(m + "_scale", 0) for m in moments)
    elements = len(moments) * plan.host.padded_numel / plan.world_size / plan.numel  # (moment elements per param)
    return [f"state_dtype      {state}: {len(moments)} moments x {per} per element = {share / plan.numel:.4g} B/param "
            f"per rank with padding", f"                 (fp32 state: {4 * elements:.4g} B/param; state_dtype="
            f"torch.bfloat16 or torch.int8 saves {2 * elements:.4g} or {(4 - 1.0625) * elements:.4g} B/param)"]


# ------------------------------------------------------------------------------------------ verdicts, JSON, HF --
def gpu_capacity() -> Optional[int]:
    """Total memory of CUDA device 0 in bytes, or None without one (never initialises CUDA when there is none)."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def verdicts(plan: MemoryPlan, nproc_per_node: int = 1, gpu_bytes: Optional[int] = None,
             host_bytes: Optional[int] = None) -> Dict[str, Optional[object]]:
    """Whether the plan fits: host RAM for all ranks of one node together, and one GPU for one rank.

    Args:
        plan (MemoryPlan): from :func:`memory_plan`.
        nproc_per_node (int): ranks (GPUs) per node: their host buffers add up on the node. Default: 1.
        gpu_bytes (int, optional): memory of one GPU; None: unknown (no verdict). Default: None.
        host_bytes (int, optional): host RAM available on the node; None: unknown. Default: None.

    Returns:
        dict: ``host_per_node`` (bytes), ``host_fits``, ``gpu_fits`` and ``adamw_gpu_fits`` (bool, or None when
        the capacity is unknown), ``gpu_left`` (bytes a GPU keeps for activations, the CUDA context and the
        allocator with ours, or None).
    """
    host_node = plan.total("ours", "host") * nproc_per_node
    ours_gpu, adamw_gpu = plan.total("ours", "gpu"), plan.total("adamw", "gpu")
    known_gpu = gpu_bytes is not None and plan.device == "cuda"
    return {
        "host_per_node": host_node,
        "host_fits": None if host_bytes is None else host_node <= host_bytes,
        "gpu_fits": ours_gpu <= gpu_bytes if known_gpu else None,
        "adamw_gpu_fits": adamw_gpu <= gpu_bytes if known_gpu else None,
        "gpu_left": gpu_bytes - ours_gpu if known_gpu else None,
    }


def gpu_size(n: int) -> str:
    """A GPU's memory in both units, ``80.0 GB (74.5 GiB)``: GPUs are sold in GB (10**9 bytes), the rest of the
    report counts in GiB (2**30), and ``80GB`` and ``80GiB`` are different cards' worth."""
    return f"{n / 1e9:.1f} GB ({format_bytes(n)})"


def verdict_lines(plan: MemoryPlan, v: Dict[str, Optional[object]], nproc_per_node: int,
                  gpu_bytes: Optional[int], host_bytes: Optional[int]) -> List[str]:
    """The verdicts of :func:`verdicts` as report lines."""
    yes = {True: "fits", False: "does NOT fit", None: "unknown"}
    node = f"{nproc_per_node} ranks on one node: " if nproc_per_node > 1 else ""
    need = format_bytes(v["host_per_node"])
    if host_bytes is None:
        out = [f"host verdict     {node}{need} of host RAM needed (available RAM unknown)"]
    else:
        out = [f"host verdict     {node}{need} needed, {format_bytes(host_bytes)} available now: {yes[v['host_fits']]}"]
    if plan.device != "cuda":
        return out
    if gpu_bytes is None:
        out.append("GPU verdict      no GPU here: give --gpu-memory (e.g. 80GB) for a verdict")
        return out
    out.append(f"GPU verdict      {gpu_size(gpu_bytes)} per GPU: OffloadOptimizer {yes[v['gpu_fits']]}, "
               f"torch.optim.AdamW {yes[v['adamw_gpu_fits']]}")
    left = v["gpu_left"]
    if left is not None and left > 0:
        out.append(f"                 with OffloadOptimizer {format_bytes(left)} per GPU remain for activations, the "
                   "CUDA context and the allocator")
    return out


def plan_dict(plan: MemoryPlan, v: Dict[str, Optional[object]], nproc_per_node: int, gpu_bytes: Optional[int],
              host_bytes: Optional[int]) -> Dict[str, object]:
    """The plan and its verdicts as plain JSON-ready data (bytes as integers)."""
    name = DTYPE_NAMES[plan.dtype]
    return {
        "params": plan.model_numel or plan.numel, "params_per_rank": plan.numel, "fsdp": plan.fsdp,
        "dtype": name, "device": plan.device, "world_size": plan.world_size,
        "nproc_per_node": nproc_per_node, "release_grads": plan.release_grads,
        "state_dtype": DTYPE_NAMES[plan.state_dtype], "gpu_tier_params": plan.gpu_tier_numel,
        "per_rank": {"OffloadOptimizer": plan.ours, "torch.optim.AdamW": plan.adamw},
        "totals_per_rank": {which: {where: plan.total(key, where) for where in ("gpu", "host")}
                            for which, key in (("OffloadOptimizer", "ours"), ("torch.optim.AdamW", "adamw"))},
        "pinned_per_rank": plan.pinned,
        "capacity": {"gpu_bytes": gpu_bytes, "host_available_bytes": host_bytes},
        "verdict": v,
    }



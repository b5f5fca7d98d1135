"""The memory plan told: the table of :func:`~zero_offload.memory_plan.memory_plan`'s bytes, ours beside
``torch.optim.AdamW``, the notes under it, the verdicts (does it fit) and the JSON form
(``python -m zero_offload.report --params N``). The numbers come from :mod:`zero_offload.memory_plan`; this module
only words them."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from zero_offload.cost_model import ASSUMED_FROM, ASSUMED_RATES, Rates
from zero_offload.home_costs import HOMES, HomeCost
from zero_offload.host_memory import format_bytes
from zero_offload.memory_plan import _BUFFERS, _SUFFIXES, MemoryPlan
from zero_offload.options import DTYPE_NAMES

__all__ = ["gpu_capacity", "gpu_size", "home_lines", "home_section", "leaves_out_lines", "plan_dict", "plan_lines",
           "unit_lines", "verdict_lines", "verdicts"]

# A plan's rates where none are given: the cost model's assumed ones, said so.
_ASSUMED = (ASSUMED_RATES, f"assumed (not measured): {ASSUMED_FROM}")


def plan_lines(plan: MemoryPlan, rates: Tuple[Rates, str] = _ASSUMED) -> List[str]:
    """The memory plan as a table: bytes and bytes per parameter, per rank, ours beside AdamW's; then each home's
    bytes, traffic and predicted kernel time per step by ``rates`` (the rates and where they come from)."""
    out = _header_lines(plan)
    state = "8-bit" if plan.state_dtype == torch.int8 else DTYPE_NAMES[plan.state_dtype]
    home = "master" if plan.dtype == torch.float32 else "staging"
    rows = _table_rows(plan, state, home)
    width = max(26, *(len(label) + 1 for label, _, _ in rows))
    out += ["", f"{'':{width}}{'OffloadOptimizer':>26}{'torch.optim.AdamW':>26}",
            f"{'':{width}}{'bytes':>16}{'B/param':>10}{'bytes':>16}{'B/param':>10}"]
    out += [f"{label:<{width}}{a}{b}".rstrip() if a else label for label, a, b in rows]
    if plan.dtype != torch.float32 or plan.state_dtype != torch.float32:
        out.append(f"  (AdamW keeps its moments in the parameters' dtype and no fp32 master; ours are {state})")
    out += _recipe_lines(plan)
    out += _state_lines(plan, state)
    out.append("")
    return out + _note_lines(plan, home) + unit_lines(plan) + home_section(plan, *rates)


def home_section(plan: MemoryPlan, rates: Rates, source: str) -> List[str]:
    """Each home's buckets, host RAM, GPU memory, bytes copied each way and the CPU kernel's and copies' predicted
    time per step, per rank (:mod:`zero_offload.home_costs`), under the plan's ``placement``."""
    placement = plan.placement
    out = [f"homes            placement={placement!r}, per rank and per step: each home's buckets, the memory "
           "they hold,", "                 the bytes they copy each way, the predicted time of the CPU kernel and "
           "of the copies (each alone)"]
    out += home_lines(plan.host.homes, rates, source, indent=" " * 17)
    if placement == "auto":
        out += ["                 'auto' places after the second step, from the rates it measures then and the "
                "GPU memory", "                 the steps left: planned here as every bucket on the host (upper "
                "bounds on host RAM and the kernel's time)"]
    return out


def _header_lines(plan: MemoryPlan) -> List[str]:
    """What is planned: the model (under FSDP2 its whole count and the rank's, each labelled, and the mixed
    precision policy), per rank, and what the GPU figure leaves out."""
    name, n, whole = DTYPE_NAMES[plan.dtype], plan.numel, plan.model_numel or plan.numel
    sharded = plan.world_size > 1
    if plan.fsdp > 1:
        param, reduce = _policy_names(plan)
        w = len(f"{whole:,}")
        out = [f"memory plan      whole model: {whole:>{w},} parameters{_short_count(whole)}, {name} on {plan.device}, "
               f"sharded by FSDP2 over {plan.fsdp} ranks",
               f"                 per rank:    {n:>{w},} parameters{_short_count(n)}: rank {plan.fsdp_rank}'s shards"
               f"{' (the largest)' if plan.fsdp_rank == 0 else ''}, which its optimizer offloads",
               f"                 FSDP2 MixedPrecisionPolicy(param_dtype={param}, reduce_dtype={reduce}) "
               "(--param-dtype, --reduce-dtype;",
               f"                 unset: the shards' dtype, param_dtype); --dtype {name} is the shards' storage dtype "
               "(the model as",
               "                 built), which the optimizer updates and the gradient shards keep (FSDP2 casts them to "
               "it)",
               "                 B/param below is per parameter of the rank's shards; FSDP2 + torch.optim.AdamW beside "
               "ours"]
    else:
        out = [f"memory plan      {whole:,} parameters{_short_count(whole)}, {name} model on {plan.device}"
               + (f", {plan.world_size} data-parallel ranks" if sharded else "")]
    out += ["                 parameters, gradients and optimizer state per rank; nothing allocated: host buffers",
            "                 from OffloadOptimizer.estimate_host_memory over meta tensors"]
    if sharded:
        out.append(f"                 host buffers: one rank's shard under OffloadOptimizer(process_group=...) of "
                   f"{plan.world_size} ranks")
    return out + leaves_out_lines(plan)


def leaves_out_lines(plan: MemoryPlan) -> List[str]:
    """What the plan's figures leave out: activations (and on a GPU its context and the allocator's cache), the same
    with either optimizer; under FSDP2 without the model (``--params``) the all-gathered units, whose cost per
    parameter of a unit the mixed precision policy sets, and which the planner cannot size, not knowing the modules
    given to ``fully_shard`` (with the model they are rows of the table: :func:`unit_lines`)."""
    where = "the CUDA context and the allocator's cache" if plan.device == "cuda" else "allocator caches"
    out = [f"leaves out       activations, {where} (the same with either optimizer)"]
    if plan.fsdp > 1 and plan.fsdp_units is not None:
        if plan.device != "cuda":
            out.append("                 and FSDP2's gathered units, on the device the model computes on")
    elif plan.fsdp > 1:
        unit = plan.gathered_unit_bytes()
        param, reduce = _policy_names(plan)
        out += ["                 and FSDP2's all-gathered units, which the planner cannot size: it does not know "
                "the modules",
                f"                 you give fully_shard. A unit of U parameters holds U x {unit['gathered']} B while "
                f"gathered ({param}, param_dtype);",
                f"                 at its backward U x {unit['gradients']} B more for its {param} gradients, which "
                f"then go into a U x {unit['reduce_scatter_input']} B",
                f"                 {reduce} reduce-scatter input (reduce_dtype; the gathered parameters freed first); "
                "FSDP2",
                "                 prefetches the next unit, so about two units are gathered at once (--model CONFIG: "
                "the plan",
                "                 finds the units, cuts the buckets at them and counts these; see --fsdp-units)"]
    return out


def _recipe_lines(plan: MemoryPlan) -> List[str]:
    """torch.optim.AdamW's two ways to train a low-precision model, each with its bytes per parameter: all in the
    low dtype (the column when the model is stored so), and with fp32 masters (see
    :meth:`MemoryPlan.adamw_recipes`)."""
    recipes = plan.adamw_recipes()
    if not recipes:
        return []
    low, n = DTYPE_NAMES[plan.low_dtype()], plan.numel
    moments = plan.adamw_moments()
    column = "low" if plan.dtype != torch.float32 else "fp32 master"
    how = (f"fp32 shards under MixedPrecisionPolicy(param_dtype={low})" if plan.fsdp > 1
           else f"an fp32 model under torch.autocast ({low} copies uncounted)")
    said = {"low": [f"{low} parameters, gradients, {moments} moments"],
            "fp32 master": [f"fp32 parameters (masters), gradients, {moments} moments:", how]}
    out = [f"AdamW recipes    torch.optim.AdamW {'on the GPU' if plan.device == 'cuda' else 'on the host'}, per rank,"
           f" two ways to train in {low}:"]
    for key, b in recipes.items():
        first, *more = said[key]
        if key == column:
            first = first.rstrip(":") + " (the column above)" + (":" if more else "")
        label = f"all {low}" if key == "low" else key
        out.append(f"  {label:<14}{format_bytes(b):>11}{b / n:7.2f} B/param  {first}")
        out += [" " * 44 + line for line in more]
    return out


_ROW_ORDER = ("params", "gradients", "master", *_BUFFERS, *(name + "_scale" for name in _BUFFERS), "grad buffer",
              "staging", "grad_prev", "flat_grad", "FSDP2 gathered", "FSDP2 unit gradients", "FSDP2 reduce-scatter")


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
            kind = _fsdp_row_dtype(plan, item) or _row_dtype(item, name, state, item in ours, item in adamw)
            rows.append((f"  {item} ({kind})", ours_cell, cell(adamw.get(item))))
        rows.append(("  total", cell(plan.total("ours", where)), cell(plan.total("adamw", where))))
    return rows


def _fsdp_row_dtype(plan: MemoryPlan, item: str) -> Optional[str]:
    """The dtype of FSDP2's own rows (``param_dtype``'s, ``reduce_dtype``'s), or None for another row."""
    if not item.startswith("FSDP2 "):
        return None
    param, reduce = _policy_names(plan)
    return reduce if item == "FSDP2 reduce-scatter" else param


def _policy_names(plan: MemoryPlan) -> Tuple[str, str]:
    """The names of the dtypes of FSDP2's gathered parameters and reduce-scatter (:meth:`MemoryPlan.policy_dtypes`)."""
    param, reduce = plan.policy_dtypes()
    return DTYPE_NAMES[param], DTYPE_NAMES[reduce]


def unit_lines(plan: MemoryPlan) -> List[str]:
    """Under FSDP2 with the model known (:attr:`MemoryPlan.fsdp_units`): its units, each rank's buckets cut at them
    (ranks alike together; with many kinds of rank, rank 0's and those with the most buckets and the most padding),
    and what FSDP2's own rows of the table hold."""
    units = plan.fsdp_units
    if plan.fsdp < 2 or units is None:
        return []
    if units.blocks:
        what = (f"{units.blocks + 1} units: {units.blocks} blocks ({units.block_name}, found by {units.how}), each "
                "given fully_shard, then the root with the rest (embeddings, final norm, head)")
    else:
        what = f"1 unit: the whole model ({units.how})"
    said = [f"{what}; the optimizer cuts each rank's buckets at each unit (and at --bucket-numel):"]
    rows = list(plan.rank_buckets)
    if len(rows) > 4:
        rows = list(dict.fromkeys([rows[0], max(rows, key=lambda r: r.buckets), max(rows, key=lambda r: r.padding)]))
    for r in rows:
        ranks = f"rank {r.first}" if r.first == r.last else f"ranks {r.first}-{r.last}"
        said.append(f"{ranks}: {r.buckets} buckets, {r.numel:,} parameters, {r.padding:,} elements of padding"
                    + (f" (the flat buffers {r.padded_numel / r.numel:.3g}x as long)" if r.numel and r.padding > r.numel
                       else ""))
    if plan.device == "cuda":
        param, reduce = _policy_names(plan)
        said.append(f"FSDP2's own GPU memory, the FSDP2 rows above (in both columns), each at its largest (they peak "
                    f"at different moments: their sum is an upper bound): gathered ({param}, param_dtype), the root "
                    "unit, kept gathered from its forward to the end of backward, and two of the largest block (the "
                    f"one running and the next, prefetched); unit gradients ({param}), autograd's gradients of the "
                    f"root's and the largest block's parameters; reduce-scatter ({reduce}, reduce_dtype), the input "
                    "FSDP2 copies the largest unit's gradients into. A unit is gathered with each parameter padded "
                    f"to {plan.fsdp} x its shard's rows")
    out: List[str] = []
    for i, text in enumerate(said):
        first = "FSDP2 units      " if i == 0 else " " * 17
        out += textwrap.wrap(text, 120, initial_indent=first, subsequent_indent=" " * 19 if i else " " * 17)
    return out


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
        option = "gpu_fraction" if plan.placement == "host" else "placement"
        out.append(f"GPU state        {option}: {plan.gpu_tier_numel:,} parameters "
                   f"({plan.gpu_tier_numel / plan.numel:.0%}, the first buckets) keep their state on the GPU, updated")
        out.append("                 there by torch's fused AdamW; the GPU rows above include it")
    parked = plan.host.homes.get("parked", HomeCost())
    if parked.buckets:
        what = "elements of this rank's shards" if sharded else "parameters"  # (a home's numel: a rank's share)
        share = parked.numel / sum(c.numel for c in plan.host.homes.values())
        out.append(f"parked state     {parked.numel:,} {what} ({share:.0%}) parked on the host between steps, "
                   "stepped on the GPU: their state")
        out.append(f"                 ({format_bytes(parked.gpu_bytes)} in all) is on the GPU from its reload in "
                   "backward to its write-back, in memory")
        out.append("                 backward freed: not in the GPU rows above nor in the verdict below")
    if plan.device == "cuda" and plan.release_grads:
        out.append("gradients        release_grads=True: each .grad is dropped once its bucket is copied, so the GPU "
                   "holds at most")
        out.append("                 two buckets' gradients (clip with opt.clip_grad_norm_; no GradScaler)")
    elif plan.device == "cuda" and not plan.host.homes.get("host", HomeCost()).buckets:
        out.append("gradients        read on the GPU where autograd leaves them (no bucket is stepped on the host); "
                   "the .grad")
        out.append("                 tensors stay on the GPU as with AdamW")
    elif plan.device == "cuda":
        out.append("gradients        copied to the grad buffer during backward, bucket by bucket; the .grad tensors "
                   "stay on")
        out.append("                 the GPU as with AdamW, unless release_grads=True (then only buckets in flight)")
        if plan.dtype != torch.float32 and not sharded:
            out.append(f"                 the grad buffer also carries the updated {DTYPE_NAMES[plan.dtype]} parameters "
                       "back (no staging copy)")
    # (delayed_update: not sharded, not under FSDP2, not with a bucket stepped on the GPU)
    if plan.device == "cuda" and not sharded and plan.fsdp == 1 and set(plan.host.homes) <= {"host"}:
        copy = plan.host.padded_numel * plan.dtype.itemsize
        out += [f"uploads          with delayed_update: up to {format_bytes(copy)} more on the GPU "
                "during backward", "                 (the new parameters, copied up early, only where the GPU has "
                "room beyond gpu_margin_gib;", "                 given back at step(); none with "
                "uploads_in_backward=False; not in the verdict below)"]
    return out


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


def home_lines(homes: Mapping[str, HomeCost], rates: Any, source: str, indent: str = "") -> List[str]:
    """``homes`` as a table: per home its buckets, parameters, host RAM, GPU memory, bytes each way per step and the
    predicted time of the CPU kernel and of the copies by ``rates`` (``source``: where they come from, said under
    it)."""
    out = [f"{indent}{'home':<9}{'buckets':>8}{'params':>16}{'host RAM':>11}{'GPU':>11}{'up/step':>11}"
           f"{'down/step':>11}{'kernel ms':>11}{'up ms':>8}{'down ms':>9}"]
    for name in HOMES:
        c = homes.get(name)
        if c is None or not c.buckets:
            continue
        s = c.seconds(rates)
        gpu = format_bytes(c.gpu_bytes) + ("*" if name == "parked" and c.gpu_bytes else "")
        out.append(f"{indent}{name:<9}{c.buckets:>8}{c.numel:>16,}{format_bytes(c.host_bytes):>11}{gpu:>11}"
                   f"{format_bytes(c.up_bytes):>11}{format_bytes(c.down_bytes):>11}{s['kernel'] * 1e3:>11.1f}"
                   f"{s['up'] * 1e3:>8.1f}{s['down'] * 1e3:>9.1f}")
    if homes.get("parked") and homes["parked"].gpu_bytes:
        out.append(f"{indent}* parked: GPU memory from its reload in backward to its write-back after step() only")
    said = (f"rates: CPU kernel {rates.kernel / 1e9:.2f}G elements/s, pinned copies {rates.upload / 1e9:.1f} GB/s "
            f"up, {rates.download / 1e9:.1f} GB/s down; {source}")
    return out + textwrap.wrap(said, 120, initial_indent=indent, subsequent_indent=indent + "  ")


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
        dict: ``host_per_node`` (bytes), ``host_fits``, ``gpu_fits``, ``adamw_gpu_fits`` and, for a low-precision
        model, ``adamw_low_gpu_fits`` and ``adamw_fp32_master_gpu_fits`` (AdamW's two recipes:
        :meth:`MemoryPlan.adamw_recipes`, with FSDP2's own GPU bytes where the plan counts them:
        :meth:`MemoryPlan.fsdp_gpu_bytes`) (bool, or None when the capacity is unknown), ``gpu_left`` (bytes a GPU
        keeps for activations, FSDP2's gathered units where the plan does not count them, the CUDA context and the
        allocator with ours, or None).
    """
    host_node = plan.total("ours", "host") * nproc_per_node
    ours_gpu, adamw_gpu = plan.total("ours", "gpu"), plan.total("adamw", "gpu")
    known_gpu = gpu_bytes is not None and plan.device == "cuda"
    recipes = plan.adamw_recipes()
    return {
        "host_per_node": host_node,
        "host_fits": None if host_bytes is None else host_node <= host_bytes,
        "gpu_fits": ours_gpu <= gpu_bytes if known_gpu else None,
        "adamw_gpu_fits": adamw_gpu <= gpu_bytes if known_gpu else None,
        **{f"adamw_{key.replace(' ', '_')}_gpu_fits": b + plan.fsdp_gpu_bytes() <= gpu_bytes if known_gpu else None
           for key, b in recipes.items()},
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
    recipes = plan.adamw_recipes()
    if recipes:
        said = {"low": f"all {DTYPE_NAMES[plan.low_dtype()]}", "fp32 master": "with fp32 masters"}
        column = "low" if plan.dtype != torch.float32 else "fp32 master"
        other = "fp32 master" if column == "low" else "low"
        out[-1] += f" ({said[column]}, {recipes[column] / plan.numel:.4g} B/param);"
        out.append(f"                 torch.optim.AdamW {said[other]} ({recipes[other] / plan.numel:.4g} B/param) "
                   f"{yes[v['adamw_' + other.replace(' ', '_') + '_gpu_fits']]}")
    left = v["gpu_left"]
    if left is not None and left > 0:
        gathered = plan.fsdp > 1 and plan.fsdp_units is None
        out.append(f"                 with OffloadOptimizer {format_bytes(left)} per GPU remain for activations, "
                   + ("FSDP2's gathered units," if gathered else "the CUDA context and the allocator"))
        if gathered:
            out.append("                 the CUDA context and the allocator")
    return out


def plan_dict(plan: MemoryPlan, v: Dict[str, Optional[object]], nproc_per_node: int, gpu_bytes: Optional[int],
              host_bytes: Optional[int], rates: Tuple[Rates, str] = _ASSUMED) -> Dict[str, object]:
    """The plan and its verdicts as plain JSON-ready data (bytes as integers); ``homes`` with each home's predicted
    seconds per step by ``rates`` (the rates and where they come from)."""
    name = DTYPE_NAMES[plan.dtype]
    speed, source = rates
    return {
        "params": plan.model_numel or plan.numel, "params_per_rank": plan.numel, "fsdp": plan.fsdp,
        "dtype": name, "device": plan.device, "world_size": plan.world_size,
        "nproc_per_node": nproc_per_node, "release_grads": plan.release_grads,
        "state_dtype": DTYPE_NAMES[plan.state_dtype], "gpu_tier_params": plan.gpu_tier_numel,
        "per_rank": {"OffloadOptimizer": plan.ours, "torch.optim.AdamW": plan.adamw},
        "totals_per_rank": {which: {where: plan.total(key, where) for where in ("gpu", "host")}
                            for which, key in (("OffloadOptimizer", "ours"), ("torch.optim.AdamW", "adamw"))},
        "pinned_per_rank": plan.pinned,
        "param_dtype": _policy_names(plan)[0] if plan.fsdp > 1 else None,
        "reduce_dtype": _policy_names(plan)[1] if plan.fsdp > 1 else None,
        "adamw_recipes_per_rank": {key: {"dtype": "fp32" if key == "fp32 master" else DTYPE_NAMES[plan.low_dtype()],
                                         "bytes": b, "bytes_per_param": b / plan.numel}
                                   for key, b in plan.adamw_recipes().items()},
        "gathered_unit_bytes_per_param": plan.gathered_unit_bytes() if plan.fsdp > 1 else None,
        "fsdp_units": None if plan.fsdp < 2 or plan.fsdp_units is None else {
            "units": plan.fsdp_units.blocks + 1, "blocks": plan.fsdp_units.blocks,
            "block_class": plan.fsdp_units.block_name, "found_by": plan.fsdp_units.how, "rank": plan.fsdp_rank,
            "ranks": [{"first": r.first, "last": r.last, "buckets": r.buckets, "numel": r.numel, "padding": r.padding}
                      for r in plan.rank_buckets]},
        "not_counted": " ".join(line.strip() for line in leaves_out_lines(plan))[len("leaves out"):].strip(),
        "capacity": {"gpu_bytes": gpu_bytes, "host_available_bytes": host_bytes},
        "verdict": v,
        "placement": plan.placement,
        "homes_per_rank": {home: {**dataclasses.asdict(c), "seconds_per_step": c.seconds(speed)}
                           for home, c in plan.host.homes.items()},
        "rates": {"kernel_elements_per_s": speed.kernel, "upload_bytes_per_s": speed.upload,
                  "download_bytes_per_s": speed.download, "source": source},
    }



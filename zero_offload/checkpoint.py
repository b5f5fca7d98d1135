"""The optimizer state as users see it: ``opt.state`` entries in ``torch.optim.AdamW``'s format (views of the
buckets' host buffers), full state dicts loaded into the buffers in place, and the sharded state that
``torch.distributed.checkpoint`` saves and loads without gathering.

Every loader here works in two phases: a ``plan_*`` function validates everything and returns what to write,
raising ``ValueError`` before anything changed; an ``apply_*`` function then writes. The functions take the
optimizer's param groups, its buckets and its ``state`` mapping, never the optimizer itself.
"""

from __future__ import annotations

import dataclasses
from copy import deepcopy
from itertools import chain
from typing import Any, Callable, Dict, List, MutableMapping, Optional, Sequence, Tuple

import torch

from zero_offload.buckets import FlatBucket, memory_order_flat, view_like
from zero_offload.options import check_group, check_step

__all__ = ["STATE_KEYS", "LoadPlan", "add_compact_moments", "apply_load", "check_format", "apply_sharded_load", "expose",
           "full_state", "plan_load", "plan_sharded_load", "reexpose", "sharded_state_dict"]

STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")

Buckets = Sequence[Sequence[FlatBucket]]
State = MutableMapping[Any, Dict[str, Any]]


# ----------------------------------------------------------------------------------------- opt.state entries --
def expose(state: State, bucket: FlatBucket, indices: Sequence[int]) -> None:
    """Put the state entries of the bucket's parameters ``indices`` into ``state`` (views of the buffers), as
    AdamW creates its state at a parameter's first step. The one place entries are created."""
    for i in indices:
        state[bucket.params[i]] = bucket.state_entry(i)
        bucket.set_exposed(i, True)


def reexpose(state: State, buckets: Buckets, every: bool) -> None:
    """Point ``state`` back at the host buffers where something replaced its tensors (Lightning's restore moves
    optimizer state to the model's device with ``state[p][k] = v.to(device)``): those copies would make
    ``state_dict()`` stale and hold the state in GPU memory. ``every=False`` checks one parameter per bucket
    (such replacements are wholesale), which is cheap enough for every step."""
    for bucket in chain.from_iterable(buckets):
        if bucket.compact:
            continue  # its entries hold no moments; state_dict() builds them from the buffers
        for i, p in enumerate(bucket.params):
            if not bucket.exposed[i]:
                continue
            entry = state.get(p)
            if entry is None or entry.get("exp_avg") is not bucket.exp_avg_views[i] \
                    or entry.get("exp_avg_sq") is not bucket.exp_avg_sq_views[i]:
                expose(state, bucket, [j for j in range(len(bucket.params)) if bucket.exposed[j]])
                break
            if not every:
                break


# ------------------------------------------------------------------------------------------ param groups --
def merge_groups(groups: Sequence[Dict[str, Any]], saved: Sequence[Dict[str, Any]], what: str, *,
                 same_amsgrad: bool = False) -> List[Dict[str, Any]]:
    """The param groups after loading ``saved`` (a state dict's, already deep-copied) over ``groups``: the saved
    hyperparameters, with keys an older checkpoint lacks keeping their current value, and this optimizer's
    parameters. Validated like a group being added; ``same_amsgrad`` also refuses a change of ``amsgrad`` (a
    sharded load writes into the existing state layout)."""
    if len(groups) != len(saved):
        raise ValueError(f"{what} has a different number of parameter groups ({len(saved)}, this optimizer has "
                         f"{len(groups)})")
    out = []
    for gi, (g, sg) in enumerate(zip(groups, saved)):
        if len(g["params"]) != len(sg["params"]):
            raise ValueError(f"{what} contains a parameter group that doesn't match the size of optimizer's group "
                             f"(group {gi}: {len(sg['params'])} vs {len(g['params'])} params)")
        ng = {k: v for k, v in sg.items() if k != "params"}
        for k, v in g.items():
            ng.setdefault(k, v)
        ng["capturable"] = ng["differentiable"] = False  # not honoured here; a loaded AdamW group may carry them
        check_group(ng, where=f"{what}, param group {gi}")
        if same_amsgrad and bool(ng["amsgrad"]) != bool(g["amsgrad"]):
            raise ValueError(f"{what}, param group {gi}: amsgrad={ng['amsgrad']}, this optimizer has "
                             f"amsgrad={g['amsgrad']} (the state layout differs; build it with the same amsgrad)")
        ng["params"] = g["params"]
        out.append(ng)
    return out


def _where(buckets: Buckets) -> Dict[torch.Tensor, Tuple[int, FlatBucket, int]]:
    """Each parameter's (group, bucket, position in the bucket)."""
    return {p: (gi, bucket, i) for gi, group in enumerate(buckets) for bucket in group
            for i, p in enumerate(bucket.params)}


# --------------------------------------------------------------------------------------- full state dicts --
@dataclasses.dataclass
class LoadPlan:
    """A validated state dict: the new param groups and each parameter's entry (``step`` as a float)."""

    groups: List[Dict[str, Any]]
    entries: Dict[torch.Tensor, Dict[str, Any]]


def check_entry(entry: Any, p: torch.Tensor, key: Any, *, amsgrad: bool) -> Dict[str, Any]:
    """Validate one parameter's loaded state; returns it with ``step`` as a float."""
    where = f"loaded state for parameter id {key!r} (shape {tuple(p.shape)})"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is a {type(entry).__name__}, not a dict")
    unknown = set(entry) - set(STATE_KEYS)
    if unknown:
        raise ValueError(f"{where} has keys {sorted(map(str, unknown))} that are not Adam(W) state (expected "
                         f"{', '.join(STATE_KEYS)}): is it from another optimizer?")
    required = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    missing = [k for k in required if k not in entry]
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master"):
        if k not in entry:
            continue
        v = entry[k]
        if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.layout != torch.strided:
            raise ValueError(f"{where}: {k} must be a dense floating-point tensor, got {type(v).__name__}")
        if v.is_meta:
            raise ValueError(f"{where}: {k} is on the meta device: it has no values to load")
        if v.shape != p.shape:
            raise ValueError(f"{where}: {k} has shape {tuple(v.shape)}, the parameter has {tuple(p.shape)}: "
                             "is this state dict from another model?")
    out = dict(entry)
    out["step"] = check_step(entry["step"], where)
    return out


def check_format(state_dict: Any) -> None:
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups' (from Optimizer.state_dict())")


def plan_load(groups: Sequence[Dict[str, Any]], buckets: Buckets, state_dict: Any) -> LoadPlan:
    """Validate a full state dict (from this class, or ``torch.optim.AdamW``/``Adam``) against the optimizer."""
    check_format(state_dict)
    saved = deepcopy(state_dict["param_groups"])
    new_groups = merge_groups(groups, saved, "loaded state dict")
    id_map = dict(zip(chain.from_iterable(sg["params"] for sg in saved),
                      chain.from_iterable(g["params"] for g in groups)))
    where = _where(buckets)
    entries: Dict[torch.Tensor, Dict[str, Any]] = {}
    for key, entry in state_dict["state"].items():
        if key not in id_map:
            raise ValueError(f"loaded state dict has state for parameter id {key!r}, which none of its "
                             "param_groups lists")
        p = id_map[key]
        gi, bucket, _ = where[p]
        entries[p] = check_entry(entry, p, key, amsgrad=bool(new_groups[gi]["amsgrad"]))
        if bucket.state_dtype == torch.int8:
            for k in ("exp_avg_sq", "max_exp_avg_sq"):
                if k in entry and bool((entry[k] < 0).any()):
                    raise ValueError(f"loaded state for parameter id {key!r}: {k} has negative values, which a second "
                                     "moment cannot have (and 8-bit state cannot hold)")
    return LoadPlan(new_groups, entries)


def apply_load(state: State, buckets: Buckets, plan: LoadPlan) -> None:
    """Write a validated state dict into the buffers in place; parameters without an entry start fresh."""
    for bucket in chain.from_iterable(buckets):
        entries = [plan.entries.get(p) for p in bucket.params]
        if bucket.sharded:  # this rank's piece of each full entry
            bucket.load_entries(entries)
        else:
            _load_flat(bucket, entries)
        expose(state, bucket, [i for i, e in enumerate(entries) if e is not None])
    where = _where(buckets)
    for p in list(state.keys()):
        if isinstance(p, torch.Tensor) and p in where and p not in plan.entries:
            del state[p]


def _load_flat(bucket: FlatBucket, entries: Sequence[Optional[Dict[str, Any]]]) -> None:
    """Copy whole entries into an unsharded bucket: one batched copy, one batched zero."""
    dsts: List[torch.Tensor] = []
    srcs: List[torch.Tensor] = []
    zero: List[torch.Tensor] = []
    for i, entry in enumerate(entries):
        slots = bucket.state_slots(i)
        if bucket.compact:  # converted (quantised) parameter by parameter
            for name in slots:
                if name != "master":
                    bucket.load_moment(name, i, None if entry is None else entry.get(name))
            slots = {"master": slots["master"]} if "master" in slots else {}
        if entry is None:
            zero.extend(v for k, v in slots.items() if k != "master")
            bucket.reset_param(i)
            continue
        bucket.set_step(i, entry["step"])
        for name, slot in slots.items():
            if name in entry:
                dsts.append(slot)
                srcs.append(entry[name])
            elif name == "max_exp_avg_sq":
                zero.append(slot)
        if "master" in slots:
            bucket.master_loaded(i, "master" in entry)
    for d, s in zip(dsts, srcs):
        d.copy_(s)
    if zero:
        torch._foreach_zero_(zero)


def full_state(groups: Sequence[Dict[str, Any]], buckets: Buckets,
               all_gather: Callable[[torch.Tensor, torch.Tensor, str], None]) -> Dict[int, Dict[str, torch.Tensor]]:
    """Sharded buckets' state in ``torch.optim.AdamW``'s format (parameter-shaped), gathered bucket by bucket
    onto every rank with ``all_gather(out, shard, what)`` (a collective); keyed by the parameter's index over all
    groups, as ``Optimizer.state_dict()`` packs it."""
    index = _positions(groups)
    out: Dict[int, Dict[str, torch.Tensor]] = {}
    for bucket in chain.from_iterable(buckets):
        if not any(bucket.exposed):  # the same on every rank: exposure follows the agreed presence
            continue
        names = list(bucket.state_slots(0, master=bucket.low_precision)) if bucket.params else []
        full = {}
        for name in names:
            full[name] = torch.empty(bucket.full.padded_numel, dtype=torch.float32)
            # Compact moments are converted one shard of one bucket at a time (a temporary of the shard's size).
            mine = bucket.master if name == "master" else bucket.moment_fp32(name)
            all_gather(full[name], mine, f"state '{name}' of {bucket.where}")
        for i, p in enumerate(bucket.params):
            if bucket.exposed[i]:
                entry = {"step": bucket.steps[i].clone()}
                entry.update((n, view_like(full[n], bucket.full.offsets[i], p)) for n in names)
                out[index[id(p)]] = entry
    return out


def add_compact_moments(packed: Dict[int, Dict[str, Any]], groups: Sequence[Dict[str, Any]], buckets: Buckets
                        ) -> None:
    """Complete the entries ``Optimizer.state_dict()`` packed (keyed by parameter index) for unsharded buckets
    with compact state: fp32 moments, new tensors, converted one bucket at a time. They cost 4 bytes per element
    and moment for as long as the state dict is kept; nothing else is allocated. The entries are replaced, never
    edited: they are the optimizer's own ``state`` dicts."""
    index = _positions(groups)
    for bucket in chain.from_iterable(buckets):
        if not bucket.compact or bucket.sharded or not any(bucket.exposed):
            continue
        names = [n for n in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if getattr(bucket, n) is not None]
        full = {n: bucket.moment_fp32(n) for n in names}
        for i, p in enumerate(bucket.params):
            k = index[id(p)]
            if bucket.exposed[i] and k in packed:
                old = packed[k]
                moments = {n: view_like(full[n], bucket.layout.offsets[i], p) for n in names}
                packed[k] = {"step": old["step"], **moments, **{n: v for n, v in old.items() if n not in moments}}


# ----------------------------------------------------------------------------- torch.distributed.checkpoint --
def _state_pieces(bucket: FlatBucket, i: int) -> Dict[str, torch.Tensor]:
    """Parameter ``i``'s state tensors that this rank holds, 1-D in slot order (flat ranges of the buffers, so that
    loading into them writes the optimizer's state in place)."""
    slots = bucket.state_slots(i, master=bucket.low_precision)
    return {name: memory_order_flat(slot) for name, slot in slots.items()}


def _sharded_tensor(local: torch.Tensor, bucket: FlatBucket, i: int, process_group: Any):
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    shard = bucket.shard
    numel = shard.full.numels[i]
    pieces = {r: (start, n) for r, start, n in shard.pieces_of(i)}
    # A rank that owns nothing of this parameter still gets a shard, empty, at the end: DCP's loader drops a
    # ShardedTensor without local shards from the rank's plan and then reports its key missing.
    metas = [ShardMetadata(shard_offsets=[pieces.get(r, (numel, 0))[0]], shard_sizes=[pieces.get(r, (numel, 0))[1]],
                           placement=f"rank:{r}/cpu") for r in range(shard.world)]
    mine = [Shard(local, m) for m in metas if m.placement.rank() == shard.rank]
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size([numel]), tensor_properties=props)
    # Global metadata is known from the layout on every rank, so no collective is needed to build it.
    return ShardedTensor._init_from_local_shards_and_global_metadata(mine, meta, process_group=process_group)


def _positions(groups: Sequence[Dict[str, Any]]) -> Dict[int, int]:
    """Each parameter's index over all groups, as ``Optimizer.state_dict()`` numbers them."""
    return {id(p): k for k, p in enumerate(chain.from_iterable(g["params"] for g in groups))}


def sharded_state_dict(groups: Sequence[Dict[str, Any]], buckets: Buckets, process_group: Any = None
                       ) -> Dict[str, Any]:
    """See :meth:`zero_offload.OffloadOptimizer.sharded_state_dict`."""
    compact = next((b for b in chain.from_iterable(buckets) if b.compact), None)
    if compact is not None:
        raise RuntimeError(f"sharded_state_dict() hands out the live state buffers for torch.distributed.checkpoint "
                           f"to save and load in place, which needs fp32 moments; this optimizer keeps them as "
                           f"{compact.state_dtype} (state_dtype). Use state_dict() / load_state_dict() (fp32 moments, "
                           f"converted a bucket at a time), or state_dtype=torch.float32.")
    position = _positions(groups)
    state: Dict[str, Dict[str, Any]] = {}
    out_groups = []
    for group in groups:
        out_groups.append({**{k: deepcopy(v) for k, v in group.items() if k != "params"},
                           "params": [position[id(p)] for p in group["params"]]})
    for bucket in chain.from_iterable(buckets):
        for i, p in enumerate(bucket.params):
            entry: Dict[str, Any] = {"step": bucket.steps[i].clone()}
            for name, local in _state_pieces(bucket, i).items():
                if bucket.sharded and bucket.shard.full.numels[i]:
                    entry[name] = _sharded_tensor(local, bucket, i, process_group)
                else:
                    entry[name] = local  # the whole parameter: an ordinary tensor
            state[str(position[id(p)])] = entry
    return {"state": state, "param_groups": out_groups}


def plan_sharded_load(groups: Sequence[Dict[str, Any]], buckets: Buckets, state_dict: Any
                      ) -> Tuple[List[Dict[str, Any]], Dict[torch.Tensor, float]]:
    """Validate a :func:`sharded_state_dict` filled by ``dcp.load``: the new param groups and each parameter's step."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("load_sharded_state_dict expects the dict from sharded_state_dict(), filled by "
                         "torch.distributed.checkpoint.load")
    what = "loaded sharded state dict"
    new_groups = merge_groups(groups, state_dict["param_groups"], what, same_amsgrad=True)
    position = _positions(groups)
    steps: Dict[torch.Tensor, float] = {}
    for p in chain.from_iterable(g["params"] for g in groups):
        key = str(position[id(p)])
        entry = state_dict["state"].get(key)
        if not isinstance(entry, dict) or "step" not in entry:
            raise ValueError(f"{what} has no state for parameter {key}")
        steps[p] = check_step(entry["step"], f"{what}, parameter {key}")
    return new_groups, steps


def apply_sharded_load(state: State, buckets: Buckets, steps: Dict[torch.Tensor, float]) -> None:
    """Apply the validated step counts; ``dcp.load`` already wrote moments and masters into the buffers."""
    for bucket in chain.from_iterable(buckets):
        for i, p in enumerate(bucket.params):
            step = steps[p]
            bucket.set_step(i, step)
            if step > 0:
                expose(state, bucket, [i])
            else:
                bucket.set_exposed(i, False)
                state.pop(p, None)
            # A master loaded with the state is kept while the parameter still rounds from it (see
            # FlatBucket.refresh_masters); a parameter never stepped takes its master from the parameter.
            bucket.master_loaded(i, step > 0 and bucket.low_precision)

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
from typing import Any, Callable, Dict, List, MutableMapping, Optional, Sequence, Set, Tuple

import torch

from zero_offload.buckets import FlatBucket, memory_order_flat, view_like
from zero_offload.options import check_group, check_step

__all__ = ["STATE_KEYS", "Ahead", "LoadPlan", "ahead_entries", "apply_load", "check_format", "apply_sharded_load",
           "expose", "full_state", "plan_load", "plan_sharded_load", "reexpose", "sharded_state_dict"]

# "param": the value a parameter takes when the update still pending at saving lands (see ``Ahead``).
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master", "param")

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


# ---------------------------------------------------------------------------- a pending (delayed) update --
@dataclasses.dataclass
class Ahead:
    """A bucket's state after the update still pending (``delayed_update``), which saving describes without applying
    it: the parameters ``indices`` it updates and, where the buffers do not hold that state yet, copies of them
    (``steps``, and flat buffers by name: ``master``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``,
    ``staging``). ``flat`` None: the buffers hold it already (the CUDA path's worker wrote them)."""

    indices: Set[int]
    steps: Optional[torch.Tensor] = None
    flat: Optional[Dict[str, torch.Tensor]] = None


def _entry_tensors(bucket: FlatBucket, i: int, after: Optional[Ahead], param: bool) -> Dict[str, torch.Tensor]:
    """Parameter ``i``'s state tensors, parameter-shaped: views of the buffers, or of ``after``'s copies where it
    has them for ``i``; with ``param``, also the parameter's value (see :func:`_param_value`)."""
    slots = bucket.state_slots(i, master=bucket.low_precision)
    pending = after is not None and i in after.indices
    if pending and after.flat is not None:
        p, offset = bucket.params[i], bucket.layout.offsets[i]
        slots = {name: view_like(after.flat[name], offset, p) for name in slots}
    if param:
        slots["param"] = _param_value(bucket, i, after if pending else None)
    return slots


def _param_value(bucket: FlatBucket, i: int, after: Optional[Ahead]) -> torch.Tensor:
    """Parameter ``i``'s value on the host, after the pending update ``after`` where given: its slot (the
    parameter's own storage on the CPU; on CUDA, what was or will be uploaded), else a copy of the parameter."""
    if after is not None and after.flat is not None:
        flat = after.flat["staging" if bucket.low_precision else "master"]
        return view_like(flat, bucket.layout.offsets[i], bucket.params[i])
    slot = (bucket.staging_views if bucket.low_precision else bucket.master_views)[i]
    if bucket.on_cpu or after is not None or bucket.versions[i] == bucket.params[i]._version:
        return slot
    return bucket.params[i].detach().to("cpu")  # changed since the optimizer last wrote it, or never written


def ahead_entries(groups: Sequence[Dict[str, Any]], buckets: Buckets, ahead: Dict[int, Ahead]
                  ) -> Dict[int, Dict[str, torch.Tensor]]:
    """The state entries of the parameters a pending update changes, as that update will leave them, with
    ``param`` (the parameter's value after it: the model's parameters are one step behind), keyed as
    ``Optimizer.state_dict()`` numbers parameters. Copies where ``ahead`` computed them, else views."""
    index = _positions(groups)
    out: Dict[int, Dict[str, torch.Tensor]] = {}
    for bucket in chain.from_iterable(buckets):
        after = ahead.get(id(bucket))
        for i in after.indices if after is not None else ():
            # The step is a view like the other tensors where they are views (as state_dict() gives them).
            entry = {"step": bucket.steps[i] if after.flat is None else after.steps[i].clone()}
            entry.update(_entry_tensors(bucket, i, after, param=True))
            out[index[id(bucket.params[i])]] = entry
    return out


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
    for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master", "param"):
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
        entries[p] = check_entry(entry, p, key, amsgrad=bool(new_groups[where[p][0]]["amsgrad"]))
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
        _install_params(bucket, [None if e is None else e.get("param") for e in entries])
    where = _where(buckets)
    for p in list(state.keys()):
        if isinstance(p, torch.Tensor) and p in where and p not in plan.entries:
            del state[p]


def _install_params(bucket: FlatBucket, values: Sequence[Optional[torch.Tensor]]) -> None:
    """A checkpoint saved with a delayed update pending holds each parameter's value after it (``param``; the
    model's own checkpoint is one step behind): written into the parameter, so the state and the parameters
    agree. A separate master then stays, as the parameter rounds from it (or is taken from it, fp32)."""
    with torch.no_grad():
        for p, value in zip(bucket.params, values):
            if value is not None:
                p.copy_(value)


def _load_flat(bucket: FlatBucket, entries: Sequence[Optional[Dict[str, Any]]]) -> None:
    """Copy whole entries into an unsharded bucket: one batched copy, one batched zero."""
    dsts: List[torch.Tensor] = []
    srcs: List[torch.Tensor] = []
    zero: List[torch.Tensor] = []
    for i, entry in enumerate(entries):
        slots = bucket.state_slots(i)
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
            all_gather(full[name], getattr(bucket, name), f"state '{name}' of {bucket.where}")
        for i, p in enumerate(bucket.params):
            if bucket.exposed[i]:
                entry = {"step": bucket.steps[i].clone()}
                entry.update((n, view_like(full[n], bucket.full.offsets[i], p)) for n in names)
                out[index[id(p)]] = entry
    return out


# ----------------------------------------------------------------------------- torch.distributed.checkpoint --
def _state_pieces(bucket: FlatBucket, i: int, after: Optional[Ahead], param: bool) -> Dict[str, torch.Tensor]:
    """Parameter ``i``'s state tensors that this rank holds, 1-D in slot order (flat ranges of the buffers, so that
    loading into them writes the optimizer's state in place; of ``after``'s copies where a pending update is)."""
    return {name: memory_order_flat(t) for name, t in _entry_tensors(bucket, i, after, param).items()}


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


def sharded_state_dict(groups: Sequence[Dict[str, Any]], buckets: Buckets, process_group: Any = None,
                       ahead: Optional[Dict[int, Ahead]] = None, param: bool = False) -> Dict[str, Any]:
    """See :meth:`zero_offload.OffloadOptimizer.sharded_state_dict`. ``ahead``: a pending update's state, given
    instead of the buffers'; ``param``: each parameter's value too (``delayed_update``, whose parameters can be a
    step behind the state)."""
    ahead = ahead or {}
    position = _positions(groups)
    state: Dict[str, Dict[str, Any]] = {}
    out_groups = []
    for group in groups:
        out_groups.append({**{k: deepcopy(v) for k, v in group.items() if k != "params"},
                           "params": [position[id(p)] for p in group["params"]]})
    for bucket in chain.from_iterable(buckets):
        after = ahead.get(id(bucket))
        for i, p in enumerate(bucket.params):
            copied = after is not None and after.flat is not None and i in after.indices
            entry: Dict[str, Any] = {"step": (after.steps if copied else bucket.steps)[i].clone()}
            for name, local in _state_pieces(bucket, i, after, param).items():
                if bucket.sharded and bucket.shard.full.numels[i]:
                    entry[name] = _sharded_tensor(local, bucket, i, process_group)
                else:
                    entry[name] = local  # the whole parameter: an ordinary tensor
            state[str(position[id(p)])] = entry
    return {"state": state, "param_groups": out_groups}


def _copy_in(bucket: FlatBucket, tensors: Dict[torch.Tensor, Dict[str, Any]]) -> None:
    """Where ``dcp.load`` wrote into copies, not the buffers (the dict was made while a delayed update was pending,
    of which it shows the result), copy them into the buffers; and each ``param`` into its parameter, where it is
    not the parameter's own storage."""
    values: List[Optional[torch.Tensor]] = []
    for i, p in enumerate(bucket.params):
        live = _state_pieces(bucket, i, None, param=False)
        for name, t in tensors[p].items():
            if name in live and t.data_ptr() != live[name].data_ptr():
                live[name].copy_(t)
        value = tensors[p].get("param")
        values.append(None if value is None or value.data_ptr() == p.data_ptr() else view_like(value, 0, p))
    _install_params(bucket, values)


def plan_sharded_load(groups: Sequence[Dict[str, Any]], buckets: Buckets, state_dict: Any, param: bool = False
                      ) -> Tuple[List[Dict[str, Any]], Dict[torch.Tensor, float], Dict[torch.Tensor, Dict[str, Any]]]:
    """Validate a :func:`sharded_state_dict` filled by ``dcp.load``: the new param groups, each parameter's step,
    and the tensors ``dcp.load`` wrote for each parameter of an unsharded bucket (with ``param``, its value)."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("load_sharded_state_dict expects the dict from sharded_state_dict(), filled by "
                         "torch.distributed.checkpoint.load")
    what = "loaded sharded state dict"
    new_groups = merge_groups(groups, state_dict["param_groups"], what, same_amsgrad=True)
    position = _positions(groups)
    where = _where(buckets)
    steps: Dict[torch.Tensor, float] = {}
    tensors: Dict[torch.Tensor, Dict[str, Any]] = {}
    for p in chain.from_iterable(g["params"] for g in groups):
        key = str(position[id(p)])
        entry = state_dict["state"].get(key)
        if not isinstance(entry, dict) or "step" not in entry:
            raise ValueError(f"{what} has no state for parameter {key}")
        steps[p] = check_step(entry["step"], f"{what}, parameter {key}")
        _, bucket, i = where[p]
        if not bucket.sharded:
            names = list(_entry_tensors(bucket, i, None, param))
            bad = [n for n in names if not isinstance(entry.get(n), torch.Tensor) or entry[n].dim() != 1
                   or entry[n].numel() != p.numel()]
            if bad:
                raise ValueError(f"{what}, parameter {key}: {bad} missing or not the 1-D tensors sharded_state_dict() "
                                 "made")
            tensors[p] = {n: entry[n] for n in names}
    return new_groups, steps, tensors


def apply_sharded_load(state: State, buckets: Buckets, steps: Dict[torch.Tensor, float],
                       tensors: Optional[Dict[torch.Tensor, Dict[str, Any]]] = None) -> None:
    """Apply the validated step counts; ``dcp.load`` already wrote moments and masters into the buffers, except
    for the ``tensors`` that are not views of them (see :func:`_copy_in`)."""
    for bucket in chain.from_iterable(buckets):
        if tensors and not bucket.sharded:
            _copy_in(bucket, tensors)
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

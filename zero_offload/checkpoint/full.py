"""Full state dicts: ``state_dict()``'s (gathered, compact moments decoded to fp32, the state a pending delayed
update will leave) and ``load_state_dict()``'s, loaded into the buffers in place. Every loader works in two phases:
a ``plan_*`` function validates everything and returns what to write, raising ``ValueError`` before anything
changed; an ``apply_*`` function then writes. The functions take the optimizer's param groups, its buckets and its
``state`` mapping, never the optimizer itself."""
from __future__ import annotations

import dataclasses
from copy import deepcopy
from itertools import chain
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Set, Tuple

import torch

from zero_offload import fsdp2
from zero_offload.buckets import FlatBucket
from zero_offload.rules.base import Rule, StateBuffer
from zero_offload.state.layout import view_like
from zero_offload.state.store import STEP_DTYPES
from zero_offload.checkpoint.entries import (Buckets, State, _entry_step, _optional, _put, check_compact_moment,
                                              check_param_lists, expose, foreign, state_keys, step_entry, typo_hint,
                                              unkept)

__all__ = ["Ahead", "LoadPlan", "add_compact_moments", "ahead_entries", "apply_load", "check_entry", "check_format",
           "empty_entries", "full_state", "merge_groups", "plan_load"]


def _positions(groups: Sequence[Dict[str, Any]]) -> Dict[int, int]:
    """Each parameter's index over all groups, as ``Optimizer.state_dict()`` numbers them."""
    return {id(p): k for k, p in enumerate(chain.from_iterable(g["params"] for g in groups))}


# ---------------------------------------------------------------------------- a pending (delayed) update --
@dataclasses.dataclass
class Ahead:
    """A bucket's state after the update still pending (``delayed_update``), which saving describes without applying
    it: the parameters ``indices`` it updates and, where the buffers do not hold that state yet, copies of them
    (``steps``, and flat buffers by name: ``master``, the rule's buffers, ``staging``). ``flat`` None: the buffers hold it already (the CUDA path's worker wrote them)."""

    indices: Set[int]
    steps: Optional[torch.Tensor] = None
    flat: Optional[Dict[str, torch.Tensor]] = None
    holds: Tuple[str, ...] = ()  # the optional buffers (amsgrad's) the pending update's group uses


def _entry_tensors(bucket: FlatBucket, i: int, after: Optional[Ahead], param: bool) -> Dict[str, torch.Tensor]:
    """Parameter ``i``'s state tensors, parameter-shaped: views of the buffers, or of ``after``'s copies where it
    has them for ``i``; with ``param``, also the parameter's value (see :func:`_param_value`)."""
    slots = bucket.home.slots(i, master=bucket.low_precision)
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
    slot = bucket.upload_views[i]
    if bucket.resident or after is not None or bucket.versions[i] == bucket.owners[i]._version:
        return slot
    return bucket.params[i].detach().to("cpu")  # changed since the optimizer last wrote it, or never written


def ahead_entries(groups: Sequence[Dict[str, Any]], buckets: Buckets, ahead: Dict[FlatBucket, Ahead]
                  ) -> Dict[int, Dict[str, torch.Tensor]]:
    """The state entries of the parameters a pending update changes, as that update will leave them, with
    ``param`` (the parameter's value after it: the model's parameters are one step behind), keyed as
    ``Optimizer.state_dict()`` numbers parameters. Copies where ``ahead`` computed them, else views."""
    index = _positions(groups)
    out: Dict[int, Dict[str, torch.Tensor]] = {}
    for bucket in chain.from_iterable(buckets):
        after = ahead.get(bucket)
        # Compact moments in the buffers (the worker wrote them) are converted, as state_dict() does.
        fp32 = ({n: bucket.home.fp32(n) for n in bucket.home.names}
                if after is not None and after.flat is None and bucket.compact else {})
        for i in after.indices if after is not None else ():
            p = bucket.params[i]
            key = bucket.owners[i]
            # The step is a view like the other tensors where they are views (as state_dict() gives them).
            entry = step_entry(bucket, bucket.steps[i] if after.flat is None else after.steps[i].clone())
            entry.update(_entry_tensors(bucket, i, after, param=True))
            entry.update((n, view_like(t, bucket.layout.offsets[i], p)) for n, t in fp32.items())
            # (the optional buffers the entry holds after that update: those it held, and those the update uses)
            shown = bucket.home.shows(i, entry)
            out[index[id(key)]] = {n: t for n, t in entry.items() if n in shown or n in after.holds}
    return out


# ------------------------------------------------------------------------------------------ param groups --
def merge_groups(groups: Sequence[Dict[str, Any]], saved: Sequence[Dict[str, Any]], what: str, rule: Rule, *,
                 same_amsgrad: bool = False, defaults: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """The param groups after loading ``saved`` (a state dict's, already deep-copied) over ``groups``: the saved
    hyperparameters, with flags an older checkpoint lacks set as the rule's optimizer sets them (its
    ``loaded_defaults``: a missing ``maximize`` is False, not the value this optimizer was built with) and other
    missing keys keeping
    their current value, and this optimizer's
    parameters. Validated like a group being added; ``same_amsgrad`` also refuses a change of ``amsgrad`` (a
    sharded load writes into the existing state layout). ``defaults``: the optimizer's, which decide the settings
    a loaded group takes whatever it says (:meth:`~zero_offload.rules.base.Rule.forced_on_load`: AdamW's
    decoupled weight decay)."""
    forced = rule.forced_on_load(defaults or {})
    if len(groups) != len(saved):
        raise ValueError(f"{what} has a different number of parameter groups ({len(saved)}, this optimizer has "
                         f"{len(groups)})")
    out = []
    for gi, (g, sg) in enumerate(zip(groups, saved)):
        if len(g["params"]) != len(sg["params"]):
            raise ValueError(f"{what} contains a parameter group that doesn't match the size of optimizer's group "
                             f"(group {gi}: {len(sg['params'])} vs {len(g['params'])} params)")
        ng = {**rule.loaded_defaults, **{k: v for k, v in sg.items() if k != "params"}}
        for k, v in g.items():
            ng.setdefault(k, v)
        ng.update((flag, False) for flag in rule.cleared_flags)
        ng.update(forced)
        rule.check(ng, where=f"{what}, param group {gi}")
        for switch in [b.switch for b in rule.buffers if b.switch] if same_amsgrad else ():
            if bool(ng[switch]) != bool(g[switch]):
                raise ValueError(f"{what}, param group {gi}: {switch}={ng[switch]}, this optimizer has "
                                 f"{switch}={g[switch]} (the state layout differs; build it with the same {switch})")
        ng["params"] = g["params"]
        out.append(ng)
    return out


def _where(buckets: Buckets) -> Dict[torch.Tensor, Tuple[int, FlatBucket, int]]:
    """Each parameter's (group, bucket, position in the bucket)."""
    return {p: (gi, bucket, i) for gi, group in enumerate(buckets) for bucket in group
            for i, p in enumerate(bucket.owners)}


# --------------------------------------------------------------------------------------- full state dicts --
@dataclasses.dataclass
class LoadPlan:
    """A validated state dict: the new param groups, each parameter's entry (``step`` as a float; an empty one
    stays empty: the parameter starts fresh, its entry shown as ``{}``, as AdamW loads it), and the entries
    keyed by no parameter id (``extras``, a hook's ``opt.state["epoch"]``: put back as they are, as AdamW does)."""

    groups: List[Dict[str, Any]]
    entries: Dict[torch.Tensor, Dict[str, Any]]
    extras: Dict[Any, Any] = dataclasses.field(default_factory=dict)
    # The dtype each loaded step keeps in AdamW (see :func:`_kept_step_dtype`), by parameter.
    step_dtypes: Dict[torch.Tensor, torch.dtype] = dataclasses.field(default_factory=dict)


def check_entry(entry: Any, p: torch.Tensor, key: Any, *, rule: Rule, needed: Sequence[StateBuffer],
                outside: Collection[Any] = (), unkept_note: str = "") -> Dict[str, Any]:
    """Validate one parameter's loaded state for ``rule``, whose group needs the buffers ``needed``; returns it
    with ``step`` as a float. ``outside``: the entry's keys that are a wrapper's own, which may stand beside the
    rule's whole state (see :func:`~zero_offload.checkpoint.entries.foreign`); any other key is refused, its message
    ending with ``unkept_note`` (where the bucket keeps no wrapper's keys: sharded)."""
    where = f"loaded state for parameter id {key!r} (shape {tuple(p.shape)})"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is a {type(entry).__name__}, not a dict")
    keys = state_keys(rule)
    unknown = set(entry) - set(keys)
    whole = all(k in entry for k in (rule.step_key, *(b.name for b in needed)) if k is not None)
    strange = unknown - set(outside) if whole else unknown
    if strange:
        raise ValueError(f"{where} has keys {sorted(map(str, strange))} that are not {rule.name} state (expected "
                         f"{', '.join(k for k in keys if k is not None)}): is it from another optimizer?"
                         f"{typo_hint(strange, rule)}{unkept_note}")
    # (a buffer of a shape of its own, :class:`StateShape`, may have no tensor for this parameter: Adafactor's
    # ``variance`` for a matrix)
    shapes = {b.name: b.shape_for(p.shape) for b in rule.buffers}
    absent = [k for k in entry if k in shapes and shapes[k] is None]
    if absent:
        raise ValueError(f"{where} has {absent}, which {rule.name} keeps for no parameter of {p.dim()} dimensions: "
                         "is this state dict from another model?")
    required = [k for k in (rule.step_key,) if k is not None] + [b.name for b in needed if shapes[b.name] is not None]
    missing = [k for k in required if k not in entry]
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    for k in keys[1:]:
        if k not in entry:
            continue
        v = entry[k]
        if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.layout != torch.strided:
            raise ValueError(f"{where}: {k} must be a dense floating-point tensor, got {type(v).__name__}")
        if v.is_meta:
            raise ValueError(f"{where}: {k} is on the meta device: it has no values to load")
        expected = shapes.get(k) or p.shape
        if v.shape != expected:
            what = "the parameter has" if expected == p.shape else f"{rule.name} keeps"
            raise ValueError(f"{where}: {k} has shape {tuple(v.shape)}, {what} {tuple(expected)}: "
                             "is this state dict from another model?")
    return {**entry, "step": _entry_step(rule.step_key, entry, where)}


def _detached(v: Any) -> Any:
    return v.detach() if isinstance(v, torch.Tensor) else v


def check_format(state_dict: Any) -> None:
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups' (from Optimizer.state_dict())")


def plan_load(groups: Sequence[Dict[str, Any]], buckets: Buckets, state_dict: Any, rule: Rule,
              local_value: Callable[[Any, torch.Tensor], Any], defaults: Optional[Dict[str, Any]] = None) -> LoadPlan:
    """Validate a full state dict (from this class, or the rule's optimizer: ``torch.optim.AdamW``/``Adam``, ...)
    against the optimizer; ``local_value(value, param)``: the part of a loaded value this rank holds (its
    topology's); ``defaults``: the optimizer's (see :func:`merge_groups`)."""
    check_format(state_dict)
    check_param_lists(groups, buckets)
    saved = deepcopy(state_dict["param_groups"])
    new_groups = merge_groups(groups, saved, "loaded state dict", rule, defaults=defaults)
    id_map = dict(zip(chain.from_iterable(sg["params"] for sg in saved),
                      chain.from_iterable(g["params"] for g in groups)))
    where = _where(buckets)
    saved_group = {key: sg for sg in saved for key in sg["params"]}
    entries: Dict[torch.Tensor, Dict[str, Any]] = {}
    step_dtypes: Dict[torch.Tensor, torch.dtype] = {}
    extras: Dict[Any, Any] = {}
    needed: Dict[int, Sequence[StateBuffer]] = {}  # by group: the buffers its hyperparameters need
    for key, entry in state_dict["state"].items():
        if key not in id_map and not isinstance(key, int):
            extras[key] = entry  # not a parameter's: Optimizer.state_dict() numbers parameters with ints
            continue
        if key not in id_map:
            raise ValueError(f"loaded state dict has state for parameter id {key!r}, which none of its "
                             "param_groups lists")
        p = id_map[key]
        if isinstance(entry, dict) and not entry:
            entries[p] = {}  # (fresh state, its entry shown empty: AdamW's after a mere read of opt.state[p])
            continue
        gi, bucket, _ = where[p]
        if gi not in needed:
            needed[gi] = bucket.rule.buffers_for(new_groups[gi])
        outside = foreign(entry, bucket) if isinstance(entry, dict) else {}  # (else refused below, named)
        entries[p] = check_entry(entry, p, key, rule=bucket.rule, needed=needed[gi], outside=outside,
                                 unkept_note=unkept(bucket))
        step_dtypes[p] = _kept_step_dtype(entry.get(bucket.rule.step_key), saved_group[key])
        named = f"loaded state for parameter id {key!r} (shape {tuple(p.shape)})"
        try:  # (each rank loads its own part of the values; before any op on a DTensor, which gives it this rank's
            # mesh coordinate in place of the one it was saved at). Values only, as AdamW loads them: a tensor that
            # requires grad must not pull a host buffer into autograd.
            entries[p] = {k: v if k == "step" or k in outside else _detached(local_value(v, p))
                          for k, v in entries[p].items()}
        except ValueError as exc:
            raise ValueError(f"{named}: {exc}") from None
        # (a wrapper's tensors cast to the parameter's dtype and device, as torch.optim.Optimizer loads them)
        entries[p].update((k, v.to(dtype=p.dtype, device=p.device)) for k, v in outside.items()
                          if isinstance(v, torch.Tensor))
        for buf in bucket.rule.buffers:
            if buf.name in entry:
                check_compact_moment(bucket.state_dtype, buf, entry[buf.name], named)
    return LoadPlan(new_groups, entries, extras, step_dtypes)


def _kept_step_dtype(step: Any, saved_group: Dict[str, Any]) -> torch.dtype:
    """The dtype a loaded step keeps: torch's loader keeps a step tensor as it is, unless its saved group is
    ``fused`` or ``capturable`` (float32 then; ``_process_value_according_to_param_policy``), and AdamW counts on
    in it. float32 for a step that is no tensor (torch keeps the number) or is in a dtype that cannot hold every
    count (bf16, fp16, narrow integers)."""
    if not isinstance(step, torch.Tensor) or saved_group.get("fused") or saved_group.get("capturable"):
        return torch.float32
    return step.dtype if step.dtype in STEP_DTYPES else torch.float32


def _bucket_step_dtype(bucket: FlatBucket, plan: LoadPlan) -> torch.dtype:
    """The dtype of a bucket's step counts after a load: the one its loaded steps keep where they all agree (its
    counts are one tensor; a parameter loaded without state, that the bucket steps later, counts in it too, where
    AdamW's fresh state is float32); else float32."""
    kept = {plan.step_dtypes[p] for p in bucket.owners if p in plan.step_dtypes}
    return kept.pop() if len(kept) == 1 else torch.float32


def apply_load(state: State, buckets: Buckets, plan: LoadPlan) -> None:
    """Write a validated state dict into the buffers in place; parameters without an entry start fresh."""
    for bucket in chain.from_iterable(buckets):
        entries = [plan.entries.get(p) or None for p in bucket.owners]  # (an empty entry: fresh state)
        bucket.home.count_steps_in(_bucket_step_dtype(bucket, plan))  # (before the steps are written)
        if bucket.sharded:  # this rank's piece of each full entry
            bucket.home.load_pieces(entries)
        else:
            _load_flat(bucket, entries)
        loaded = [i for i, e in enumerate(entries) if e is not None]
        for i in loaded:
            bucket.home.hold_only(i, list(entries[i]))  # (an entry holds amsgrad's buffer as loaded, as AdamW's)
        expose(state, bucket, loaded, keep_foreign=False)
        for p in bucket.owners:
            if plan.entries.get(p) == {}:
                _put(state, p, {})
        for i in loaded:  # (the loaded entry's keys that are none of the rule's, beside its state)
            dict.update(dict.__getitem__(state, bucket.owners[i]), foreign(entries[i], bucket))
        _install_params(bucket, [None if e is None else e.get("param") for e in entries])
    where = _where(buckets)
    for p in list(state.keys()):
        if (p in where and p not in plan.entries) if isinstance(p, torch.Tensor) else p not in plan.extras:
            del state[p]
    state.update(plan.extras)


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
        slots = bucket.home.slots(i)
        if bucket.compact:  # converted (quantised) parameter by parameter
            for name in slots:
                if name != "master":
                    bucket.home.load(name, i, None if entry is None else entry.get(name))
            slots = {"master": slots["master"]} if "master" in slots else {}
        if entry is None:
            zero.extend(v for k, v in slots.items() if k != "master")
            bucket.home.reset(i)
            continue
        bucket.home.set_step(i, entry["step"])
        for name, slot in slots.items():
            if name in entry:
                dsts.append(slot)
                srcs.append(entry[name])
            elif _optional(bucket, name):
                zero.append(slot)
        if "master" in slots:
            bucket.home.loaded(i, "master" in entry)
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
        names = list(bucket.home.slots(0, master=bucket.low_precision)) if bucket.params else []
        full = {}
        for name in names:
            full[name] = torch.empty(bucket.full.padded_numel, dtype=torch.float32)
            # Compact moments are converted one shard of one bucket at a time (a temporary of the shard's size).
            mine = bucket.home.fp32(name)
            all_gather(full[name], mine, f"state '{name}' of {bucket.where}")
        for i, p in enumerate(bucket.params):
            if bucket.exposed[i]:
                entry = step_entry(bucket, bucket.steps[i].clone())
                entry.update((n, view_like(full[n], bucket.full.offsets[i], p)) for n in names)
                out[index[id(p)]] = bucket.home.shows(i, entry)
    return out


def empty_entries(groups: Sequence[Dict[str, Any]], state: State) -> Dict[int, Dict[str, Any]]:
    """The parameters whose ``opt.state`` entry is empty (read before their first step, or emptied), keyed as
    ``Optimizer.state_dict()`` numbers them: ``{}`` each, as AdamW's state dict lists them. (Local: what this rank's
    ``opt.state`` holds.)"""
    index = _positions(groups)
    return {index[id(p)]: {} for p, entry in dict.items(state)
            if isinstance(p, torch.Tensor) and not entry and id(p) in index}


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
        names = bucket.home.names
        full = {n: bucket.home.fp32(n) for n in names}
        for i, (p, owner) in enumerate(zip(bucket.params, bucket.owners)):
            k = index[id(owner)]
            if bucket.exposed[i] and k in packed:
                old = packed[k]
                moments = bucket.home.shows(i, {n: view_like(full[n], bucket.layout.offsets[i], p) for n in names})
                if bucket.fsdp:
                    moments = {n: fsdp2.wrap(v, owner) for n, v in moments.items()}
                step = {} if bucket.rule.step_key is None else {"step": old["step"]}  # (Lion: none, see expose)
                packed[k] = {**step, **moments, **{n: v for n, v in old.items() if n not in moments and n != "step"}}



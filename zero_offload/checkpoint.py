"""The optimizer state and param groups as users see them: ``opt.state`` entries in ``torch.optim.AdamW``'s format
(views of the buckets' host buffers) and the edits users make to them, full state dicts loaded into the buffers in
place, and the sharded state that ``torch.distributed.checkpoint`` saves and loads without gathering.

Every loader here works in two phases: a ``plan_*`` function validates everything and returns what to write,
raising ``ValueError`` before anything changed; an ``apply_*`` function then writes. The functions take the
optimizer's param groups, its buckets and its ``state`` mapping, never the optimizer itself.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict
from copy import deepcopy
from itertools import chain
from typing import Any, Callable, Dict, List, MutableMapping, Optional, Sequence, Set, Tuple

import torch

from zero_offload.buckets import FlatBucket
from zero_offload.rules.base import Rule, StateBuffer
from zero_offload.state.layout import memory_order_flat, view_like
from zero_offload.options import check_step

__all__ = ["Ahead", "FlatPiece", "LoadPlan", "ParamList", "StateEntry", "StateMap",
           "add_compact_moments", "ahead_entries", "apply_load", "apply_sharded_load", "check_compact_moment",
           "check_format", "check_param_lists", "expose", "full_state", "plan_load", "plan_sharded_load",
           "sharded_state_dict", "sync_state"]

DTYPE_LABELS = {torch.bfloat16: "bf16", torch.int8: "8-bit"}


def state_keys(rule: Rule) -> Tuple[str, ...]:
    """The keys a state entry may have: the step, the rule's buffers, a separate ``master``, and ``param`` (the
    value a parameter takes when the update still pending at saving lands, see ``Ahead``)."""
    return (rule.step_key, *(b.name for b in rule.buffers), "master", "param")


def step_entry(bucket: FlatBucket, step: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The step count as a state entry shows it: ``{"step": step}``, nothing for a rule whose format has none
    (Lion, SGD), which still counts steps inside (runs are cut by step count)."""
    return {} if bucket.rule.step_key is None else {bucket.rule.step_key: step}


def _entry_step(key: Optional[str], entry: Dict[str, Any], where: str, current: float = 0.0) -> float:
    """The step count of a validated entry: its ``key``, or, for a rule whose format has none, the count so far
    (at least 1: an entry is the state of a parameter that has been stepped)."""
    if key is None or key not in entry:
        return max(float(current), 1.0)
    return check_step(entry[key], where)


def _listed(names: Sequence[str]) -> str:
    """``a, b and c``."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"

Buckets = Sequence[Sequence[FlatBucket]]
State = MutableMapping[Any, Dict[str, Any]]


# ------------------------------------------------------------------------------ containers that note edits --
# The buffers are laid out for the parameters a group had when it was added, and the state entries are views of
# them, so an edit of either must be noticed at the next step(). Checking every entry or every parameter each step
# costs O(parameters) of slow Tensor hashing; these containers instead raise a flag when edited, so the check is
# one attribute read per group, and the O(parameters) work runs only after an edit.
class _Flag:
    __slots__ = ("changed",)

    def __init__(self) -> None:
        self.changed = False


def _noting(cls: type, base: type, names: Sequence[str]) -> type:
    """Give ``cls`` the mutating methods ``names`` of ``base``, each raising the instance's flag first."""
    for name in names:
        def noted(self, *args, __method=getattr(base, name), **kwargs):
            self.flag.changed = True
            return __method(self, *args, **kwargs)

        noted.__name__ = name
        setattr(cls, name, noted)
    return cls


class ParamList(list):
    """A param group's ``params``: a list that notes being edited (see :func:`check_param_lists`)."""

    __slots__ = ("flag",)

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.flag = _Flag()
        super().__init__(params)

    def __reduce__(self):
        return list, (list(self),)  # pickles and copies are plain lists


_noting(ParamList, list, ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop",
                          "remove", "clear", "sort", "reverse"))
_DICT_MUTATORS = ("__setitem__", "__delitem__", "__ior__", "clear", "pop", "popitem", "setdefault", "update")


class StateEntry(dict):
    """One parameter's ``opt.state`` entry (AdamW's dict), raising its :class:`StateMap`'s flag when edited."""

    __slots__ = ("flag",)

    def __init__(self, items: Dict[str, Any], flag: _Flag) -> None:
        self.flag = flag  # the map's flag, not the map: no reference cycle keeps the buffers alive
        super().__init__(items)

    def __reduce__(self):
        return dict, (dict(self),)


class StateMap(defaultdict):
    """``opt.state``: AdamW's ``defaultdict(dict)``, raising a flag when it or one of its entries is edited."""

    def __init__(self, *args: Any) -> None:
        self.flag = _Flag()
        super().__init__(*args)

    def put(self, p: torch.Tensor, entry: Dict[str, Any]) -> None:
        """The optimizer's own write of an entry: not an edit."""
        dict.__setitem__(self, p, StateEntry(entry, self.flag))

    def __reduce__(self):
        return defaultdict, (dict,), None, None, iter((k, dict(v)) for k, v in self.items())


_noting(StateEntry, dict, _DICT_MUTATORS)
_noting(StateMap, defaultdict, _DICT_MUTATORS)


def check_param_lists(groups: Sequence[Dict[str, Any]], buckets: Buckets) -> None:
    """Refuse param groups whose ``params`` were edited (replaced, appended to, reordered) or added to
    ``param_groups`` directly since the buckets were laid out: the step would train the tensors it was built
    with, not those listed. One attribute read per group unless something was edited."""
    if len(groups) != len(buckets):
        raise RuntimeError(
            f"OffloadOptimizer: param_groups holds {len(groups)} groups, but {len(buckets)} were added through the "
            "constructor or add_param_group: the host buffers are laid out per group when it is added. Add a group "
            "with add_param_group; to drop one, build a new optimizer.")
    for gi, group in enumerate(groups):
        params = group["params"]
        if type(params) is ParamList and not params.flag.changed:
            continue
        built = [None] * sum(len(b.params) for b in buckets[gi])
        for bucket in buckets[gi]:
            for k, p in zip(bucket.full.indices, bucket.params):
                built[k] = p
        if len(params) == len(built) and all(map(operator.is_, params, built)):
            group["params"] = ParamList(built)  # the same parameters (e.g. copied into a new list)
            continue
        raise RuntimeError(
            f"OffloadOptimizer: param group {gi}'s 'params' was edited after the group was added ({len(params)} "
            f"parameters listed, {len(built)} laid out in the host buffers), so step() would train other tensors "
            "than those listed; nothing was updated. Add new parameters with add_param_group, or build a new "
            "optimizer over the new parameter list (load_state_dict carries the state of those that stay); to go "
            "on with this one, restore the list.")


# ----------------------------------------------------------------------------------------- opt.state entries --
def _put(state: State, p: torch.Tensor, entry: Dict[str, Any]) -> None:
    if type(state) is StateMap:
        state.put(p, entry)
    else:
        state[p] = entry


def expose(state: State, bucket: FlatBucket, indices: Sequence[int]) -> None:
    """Put the state entries of the bucket's parameters ``indices`` into ``state`` (views of the buffers), as
    AdamW creates its state at a parameter's first step. The one place entries are created."""
    for i in indices:
        entry = bucket.views.entry(i)
        if entry:  # (SGD without momentum keeps no state: no entry, as in torch)
            _put(state, bucket.params[i], entry)
            bucket.views.set_exposed(i, True)


def _same_memory(a: Any, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype \
        and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()


def _check_edit(entry: Any, bucket: FlatBucket, i: int) -> Dict[str, Any]:
    """Validate an ``opt.state`` entry a user wrote for the bucket's parameter ``i``; returns it with ``step`` as a
    float. As AdamW, a non-empty entry must hold the whole state; its tensors are copied into the buffers."""
    where = f"opt.state entry of a parameter of shape {tuple(bucket.shapes[i])} ({bucket.where})"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is a {type(entry).__name__}, not a dict")
    slots = bucket.views.slots(i)
    steps = [] if bucket.views.step_key is None else [bucket.views.step_key]
    unknown = set(entry) - {*steps, *slots}
    # Compact state's entries show no buffers of the rule (see StateViews.entry): an edit may leave them out.
    needs = [*steps, *(b.name for b in bucket.rule.buffers if not b.optional)]
    missing = set(steps) - set(entry) if bucket.compact else set(needs) - set(entry)
    if unknown or missing:
        raise ValueError(f"{where} has keys {sorted(map(str, entry))}: it needs {_listed(needs)}, and "
                         f"may hold {', '.join(k for k in slots if k not in needs)}")
    for name, v in entry.items():
        if name != "step" and (not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.is_meta
                               or v.shape != slots[name].shape):
            raise ValueError(f"{where}: {name} must be a floating-point tensor of shape {tuple(slots[name].shape)} "
                             f"holding values, got {v!r:.80}")
        if name in bucket.store.declared:
            check_compact_moment(bucket.state_dtype, bucket.store.declared[name], v, where)
    # Values only (see check_entry): detached, so a user's tensor that requires grad leaves autograd out of it.
    return {**{k: v.detach() for k, v in entry.items() if k not in steps},
            "step": _entry_step(bucket.views.step_key, entry, where, float(bucket.steps[i]))}


def _apply_edit(bucket: FlatBucket, i: int, entry: Optional[Dict[str, Any]]) -> None:
    """Write a validated edit into the buffers: ``None`` starts the parameter afresh, as AdamW's next step does for
    a missing or empty entry (zero moments, step 1 next); an entry's tensors are copied in."""
    slots = bucket.views.slots(i)
    if bucket.compact:  # moments converted (quantised) through the bucket; left as they are where not given
        for name in [n for n in slots if n != "master" and (entry is None or n in entry)]:
            bucket.views.load(name, i, None if entry is None else entry[name])
        slots = {k: v for k, v in slots.items() if k == "master"}
    if entry is None:
        for name, slot in slots.items():
            if name != "master":
                slot.zero_()
        bucket.views.reset(i)
        return
    bucket.views.set_step(i, entry["step"])
    for name, slot in slots.items():
        if name in entry:
            if not _same_memory(entry[name], slot):
                slot.copy_(entry[name])
        elif _optional(bucket, name):
            slot.zero_()
    if "master" in entry:
        bucket.masters.loaded(i, True)
    elif bucket.low_precision:
        bucket.masters.loaded(i, False)  # AdamW's state has no master: take it from the parameter


def _optional(bucket: FlatBucket, name: str) -> bool:
    """Whether ``name`` is an optional buffer of the bucket's rule (amsgrad's: zeroed where an entry lacks it)."""
    buf = bucket.store.declared.get(name)
    return buf is not None and buf.optional


def sync_state(state: State, buckets: Buckets, settle: Callable[[], None]) -> "StateMap":
    """``opt.state`` after the user's edits since the last call took effect as they would in AdamW: a removed or
    emptied entry (``opt.state.clear()``, ``del opt.state[p]``, ``opt.state[p] = {}``, a new ``opt.state``)
    restarts its parameter (moments zeroed, step 1 next); tensors or steps put into an entry are copied into the
    buffers, and the entry points at the buffers again. Everything is validated before anything is written
    (``ValueError``). ``settle`` runs first when there is something to do: an update still pending belongs to the
    state before the edit. O(1) when nothing was edited."""
    if type(state) is StateMap and not state.flag.changed:
        return state
    settle()
    edits: List[Tuple[FlatBucket, int, Optional[Dict[str, Any]]]] = []
    for bucket in chain.from_iterable(buckets):
        for i, p in enumerate(bucket.params):
            entry = state.get(p)
            if not entry:
                if bucket.exposed[i] or entry is not None:  # (an empty entry goes: state_dict() would list it)
                    edits.append((bucket, i, None))
            elif not (bucket.exposed[i] and _unchanged(entry, bucket, i)):
                edits.append((bucket, i, _check_edit(entry, bucket, i)))
    out = state if type(state) is StateMap else StateMap(dict, state)
    for bucket, i, entry in edits:
        if entry is None:
            dict.pop(out, bucket.params[i], None)
            if not bucket.exposed[i]:
                continue
        _apply_edit(bucket, i, entry)
    for bucket in chain.from_iterable(buckets):
        expose(out, bucket, [i for i in range(len(bucket.params)) if bucket.exposed[i] or out.get(bucket.params[i])])
    out.flag.changed = False
    return out


def _unchanged(entry: Dict[str, Any], bucket: FlatBucket, i: int) -> bool:
    """Whether an entry still is exactly what :func:`expose` put there (its tensors the buffers' views)."""
    mine = bucket.views.entry(i)
    return entry.keys() == mine.keys() and all(_same_memory(entry[k], v) for k, v in mine.items())


# ---------------------------------------------------------------------------- a pending (delayed) update --
@dataclasses.dataclass
class Ahead:
    """A bucket's state after the update still pending (``delayed_update``), which saving describes without applying
    it: the parameters ``indices`` it updates and, where the buffers do not hold that state yet, copies of them
    (``steps``, and flat buffers by name: ``master``, the rule's buffers, ``staging``). ``flat`` None: the buffers hold it already (the CUDA path's worker wrote them)."""

    indices: Set[int]
    steps: Optional[torch.Tensor] = None
    flat: Optional[Dict[str, torch.Tensor]] = None


def _entry_tensors(bucket: FlatBucket, i: int, after: Optional[Ahead], param: bool) -> Dict[str, torch.Tensor]:
    """Parameter ``i``'s state tensors, parameter-shaped: views of the buffers, or of ``after``'s copies where it
    has them for ``i``; with ``param``, also the parameter's value (see :func:`_param_value`)."""
    slots = bucket.views.slots(i, master=bucket.low_precision)
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
        # Compact moments in the buffers (the worker wrote them) are converted, as state_dict() does.
        fp32 = ({n: bucket.views.fp32(n) for n in bucket.store.names}
                if after is not None and after.flat is None and bucket.compact else {})
        for i in after.indices if after is not None else ():
            p = bucket.params[i]
            # The step is a view like the other tensors where they are views (as state_dict() gives them).
            entry = step_entry(bucket, bucket.steps[i] if after.flat is None else after.steps[i].clone())
            entry.update(_entry_tensors(bucket, i, after, param=True))
            entry.update((n, view_like(t, bucket.layout.offsets[i], p)) for n, t in fp32.items())
            out[index[id(p)]] = entry
    return out


# ------------------------------------------------------------------------------------------ param groups --
def merge_groups(groups: Sequence[Dict[str, Any]], saved: Sequence[Dict[str, Any]], what: str, rule: Rule, *,
                 same_amsgrad: bool = False) -> List[Dict[str, Any]]:
    """The param groups after loading ``saved`` (a state dict's, already deep-copied) over ``groups``: the saved
    hyperparameters, with flags an older checkpoint lacks set as the rule's optimizer sets them (its
    ``loaded_defaults``: a missing ``maximize`` is False, not the value this optimizer was built with) and other
    missing keys keeping
    their current value, and this optimizer's
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
        ng = {**rule.loaded_defaults, **{k: v for k, v in sg.items() if k != "params"}}
        for k, v in g.items():
            ng.setdefault(k, v)
        ng.update((flag, False) for flag in rule.cleared_flags)
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
            for i, p in enumerate(bucket.params)}


# --------------------------------------------------------------------------------------- full state dicts --
@dataclasses.dataclass
class LoadPlan:
    """A validated state dict: the new param groups, each parameter's entry (``step`` as a float), and the entries
    keyed by no parameter id (``extras``, a hook's ``opt.state["epoch"]``: put back as they are, as AdamW does)."""

    groups: List[Dict[str, Any]]
    entries: Dict[torch.Tensor, Dict[str, Any]]
    extras: Dict[Any, Any] = dataclasses.field(default_factory=dict)


def check_entry(entry: Any, p: torch.Tensor, key: Any, *, rule: Rule, needed: Sequence[StateBuffer]
                ) -> Dict[str, Any]:
    """Validate one parameter's loaded state for ``rule``, whose group needs the buffers ``needed``; returns it
    with ``step`` as a float."""
    where = f"loaded state for parameter id {key!r} (shape {tuple(p.shape)})"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is a {type(entry).__name__}, not a dict")
    keys = state_keys(rule)
    unknown = set(entry) - set(keys)
    if unknown:
        raise ValueError(f"{where} has keys {sorted(map(str, unknown))} that are not {rule.name} state (expected "
                         f"{', '.join(keys)}): is it from another optimizer?")
    required = [k for k in (rule.step_key,) if k is not None] + [b.name for b in needed]
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
        if v.shape != p.shape:
            raise ValueError(f"{where}: {k} has shape {tuple(v.shape)}, the parameter has {tuple(p.shape)}: "
                             "is this state dict from another model?")
    # Values only, as AdamW loads them: a tensor that requires grad must not pull a host buffer into autograd.
    out = {k: v.detach() if isinstance(v, torch.Tensor) and k != "step" else v for k, v in entry.items()}
    out["step"] = _entry_step(rule.step_key, entry, where)
    return out


def check_compact_moment(state_dtype: torch.dtype, buf: StateBuffer, value: torch.Tensor, where: str) -> None:
    """What compact state refuses where a moment enters it (a load, an ``opt.state`` edit), naming ``where`` and
    the value: a negative second moment (AdamW's next step would take its square root: NaN parameters), and for
    8-bit state an inf or NaN, which its codes cannot hold as AdamW holds it (an element shares its block's scale;
    the kernel keeps a moment that turns non-finite only as a NaN marker, and an inf second moment, which leaves
    AdamW's parameter finite, would turn it NaN). fp32 state takes anything, as AdamW does; bf16 holds inf and NaN
    per element."""
    if state_dtype == torch.float32 or not buf.compactable:
        return
    name = buf.name
    if not buf.signed and bool((value < 0).any()):
        raise ValueError(f"{where}: {name} has a negative value ({float(value[value < 0].min()):g}), which a second "
                         f"moment cannot have; {DTYPE_LABELS[state_dtype]} state refuses it")
    if state_dtype == torch.int8 and not bool(torch.isfinite(value).all()):
        bad = value[~torch.isfinite(value)].view(-1)[0]
        raise ValueError(f"{where}: {name} holds a non-finite value ({float(bad)}), which 8-bit state cannot hold "
                         "(its elements share their 64-element block's scale); load it into fp32 or bf16 state, or "
                         "repair the checkpoint")


def check_format(state_dict: Any) -> None:
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups' (from Optimizer.state_dict())")


def plan_load(groups: Sequence[Dict[str, Any]], buckets: Buckets, state_dict: Any, rule: Rule) -> LoadPlan:
    """Validate a full state dict (from this class, or the rule's optimizer: ``torch.optim.AdamW``/``Adam``, ...)
    against the optimizer."""
    check_format(state_dict)
    check_param_lists(groups, buckets)
    saved = deepcopy(state_dict["param_groups"])
    new_groups = merge_groups(groups, saved, "loaded state dict", rule)
    id_map = dict(zip(chain.from_iterable(sg["params"] for sg in saved),
                      chain.from_iterable(g["params"] for g in groups)))
    where = _where(buckets)
    entries: Dict[torch.Tensor, Dict[str, Any]] = {}
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
        gi, bucket, _ = where[p]
        if gi not in needed:
            needed[gi] = bucket.rule.buffers_for(new_groups[gi])
        entries[p] = check_entry(entry, p, key, rule=bucket.rule, needed=needed[gi])
        for buf in bucket.rule.buffers:
            if buf.name in entry:
                check_compact_moment(bucket.state_dtype, buf, entry[buf.name],
                                     f"loaded state for parameter id {key!r} (shape {tuple(p.shape)})")
    return LoadPlan(new_groups, entries, extras)


def apply_load(state: State, buckets: Buckets, plan: LoadPlan) -> None:
    """Write a validated state dict into the buffers in place; parameters without an entry start fresh."""
    for bucket in chain.from_iterable(buckets):
        entries = [plan.entries.get(p) for p in bucket.params]
        if bucket.sharded:  # this rank's piece of each full entry
            bucket.views.load_pieces(entries)
        else:
            _load_flat(bucket, entries)
        expose(state, bucket, [i for i, e in enumerate(entries) if e is not None])
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
        slots = bucket.views.slots(i)
        if bucket.compact:  # converted (quantised) parameter by parameter
            for name in slots:
                if name != "master":
                    bucket.views.load(name, i, None if entry is None else entry.get(name))
            slots = {"master": slots["master"]} if "master" in slots else {}
        if entry is None:
            zero.extend(v for k, v in slots.items() if k != "master")
            bucket.views.reset(i)
            continue
        bucket.views.set_step(i, entry["step"])
        for name, slot in slots.items():
            if name in entry:
                dsts.append(slot)
                srcs.append(entry[name])
            elif _optional(bucket, name):
                zero.append(slot)
        if "master" in slots:
            bucket.masters.loaded(i, "master" in entry)
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
        names = list(bucket.views.slots(0, master=bucket.low_precision)) if bucket.params else []
        full = {}
        for name in names:
            full[name] = torch.empty(bucket.full.padded_numel, dtype=torch.float32)
            # Compact moments are converted one shard of one bucket at a time (a temporary of the shard's size).
            mine = bucket.master if name == "master" else bucket.views.fp32(name)
            all_gather(full[name], mine, f"state '{name}' of {bucket.where}")
        for i, p in enumerate(bucket.params):
            if bucket.exposed[i]:
                entry = step_entry(bucket, bucket.steps[i].clone())
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
        names = bucket.store.names
        full = {n: bucket.views.fp32(n) for n in names}
        for i, p in enumerate(bucket.params):
            k = index[id(p)]
            if bucket.exposed[i] and k in packed:
                old = packed[k]
                moments = {n: view_like(full[n], bucket.layout.offsets[i], p) for n in names}
                step = {} if bucket.rule.step_key is None else {"step": old["step"]}  # (Lion: none, see expose)
                packed[k] = {**step, **moments, **{n: v for n, v in old.items() if n not in moments and n != "step"}}


# ----------------------------------------------------------------------------- torch.distributed.checkpoint --
def _state_pieces(bucket: FlatBucket, i: int, after: Optional[Ahead], param: bool) -> Dict[str, torch.Tensor]:
    """Parameter ``i``'s state tensors that this rank holds, 1-D in slot order (flat ranges of the buffers, so that
    loading into them writes the optimizer's state in place; of ``after``'s copies where a pending update is)."""
    return {name: memory_order_flat(t) for name, t in _entry_tensors(bucket, i, after, param).items()}


class FlatPiece(torch.Tensor):
    """A parameter's flattened state tensor (``numel`` elements) as ``torch.distributed.checkpoint`` sees it, of which
    this rank holds the contiguous range ``[start, start + local.numel())``, ``local`` being a view of the host
    buffers (so ``dcp.load`` writes the state in place).

    DCP's own sharded types cannot say this: a DTensor's shards are ``torch.chunk``'s even split, and our pieces are
    arbitrary ranges (where a bucket's shard boundaries fall in each parameter); ``ShardedTensor`` is deprecated.
    So this implements the protocol DCP's planners ask of a sharded tensor (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``, which DTensor implements too), writing the same checkpoint
    format as the ``ShardedTensor`` it replaces (one 1-D chunk per rank that holds a piece): checkpoints of either
    load with the other, resharded to any number of ranks. It is a tensor without storage of its own: anything but
    handing it to ``dcp.save``/``dcp.load`` raises.
    """

    local: torch.Tensor
    start: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, start: int, numel: int) -> "FlatPiece":
        piece = torch.Tensor._make_wrapper_subclass(cls, (numel,), dtype=local.dtype, device=local.device)
        piece.local, piece.start = local, start
        return piece

    def __init__(self, local: torch.Tensor, start: int, numel: int) -> None:
        super().__init__()

    def _chunks(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        if self.local.numel() == 0:  # this rank holds nothing of the parameter: nothing to write or read
            return []
        return [ChunkStorageMetadata(offsets=torch.Size([self.start]), sizes=self.local.size())]

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties(dtype=self.dtype, pin_memory=False)
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=props, size=self.size()))
                for chunk in self._chunks()]

    def __create_chunk_list__(self) -> list:
        return self._chunks()

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        if index.offset is not None and tuple(index.offset) != (self.start,):
            raise ValueError(f"{index.fqn}: this rank holds the piece at offset {self.start}, not {index.offset}")
        return self.local

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{func} on a FlatPiece of sharded_state_dict(): it is only for torch.distributed.checkpoint "
                        "(its local piece is .local)")

    def __repr__(self) -> str:
        return f"FlatPiece(numel={self.numel()}, start={self.start}, local={self.local.numel()} elements)"


def _positions(groups: Sequence[Dict[str, Any]]) -> Dict[int, int]:
    """Each parameter's index over all groups, as ``Optimizer.state_dict()`` numbers them."""
    return {id(p): k for k, p in enumerate(chain.from_iterable(g["params"] for g in groups))}


def sharded_state_dict(groups: Sequence[Dict[str, Any]], buckets: Buckets,
                       ahead: Optional[Dict[int, Ahead]] = None, param: bool = False) -> Dict[str, Any]:
    """See :meth:`zero_offload.OffloadOptimizer.sharded_state_dict`. ``ahead``: a pending update's state, given
    instead of the buffers'; ``param``: each parameter's value too (``delayed_update``, whose parameters can be a
    step behind the state)."""
    ahead = ahead or {}
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
        after = ahead.get(id(bucket))
        for i, p in enumerate(bucket.params):
            copied = after is not None and after.flat is not None and i in after.indices
            entry: Dict[str, Any] = {"step": (after.steps if copied else bucket.steps)[i].clone()}
            for name, local in _state_pieces(bucket, i, after, param).items():
                if bucket.sharded and bucket.shard.full.numels[i]:
                    entry[name] = FlatPiece(local, bucket.shard.piece_src[i], bucket.shard.full.numels[i])
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


def plan_sharded_load(groups: Sequence[Dict[str, Any]], buckets: Buckets, state_dict: Any, rule: Rule,
                      param: bool = False) -> Tuple[List[Dict[str, Any]], Dict[torch.Tensor, float], Dict[torch.Tensor, Dict[str, Any]]]:
    """Validate a :func:`sharded_state_dict` filled by ``dcp.load``: the new param groups, each parameter's step,
    and the tensors ``dcp.load`` wrote for each parameter of an unsharded bucket (with ``param``, its value)."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("load_sharded_state_dict expects the dict from sharded_state_dict(), filled by "
                         "torch.distributed.checkpoint.load")
    what = "loaded sharded state dict"
    check_param_lists(groups, buckets)
    new_groups = merge_groups(groups, state_dict["param_groups"], what, rule, same_amsgrad=True)
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
            bucket.views.set_step(i, step)
            if step > 0:
                expose(state, bucket, [i])
            else:
                bucket.views.set_exposed(i, False)
                state.pop(p, None)
            # A master loaded with the state is kept while the parameter still rounds from it (see
            # Masters.refresh); a parameter never stepped takes its master from the parameter.
            bucket.masters.loaded(i, step > 0 and bucket.low_precision)

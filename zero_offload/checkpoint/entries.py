"""``opt.state`` as users see it: entries in the wrapped optimizer's format (views of the buckets' host buffers),
the containers that notice a user's edits of them or of a group's ``params``, and those edits applied to the
buffers as they would take effect in AdamW. :func:`expose` is the one place entries are created (the step calls
it for a parameter's first update)."""
from __future__ import annotations

import difflib
import operator
import weakref
from collections import defaultdict
from itertools import chain
from typing import Any, Callable, Dict, List, MutableMapping, Optional, Sequence, Tuple

import torch

from zero_offload import fsdp2
from zero_offload.buckets import FlatBucket
from zero_offload.rules.base import Rule, StateBuffer
from zero_offload.options import check_step, prefixed

__all__ = ["Buckets", "ParamList", "State", "StateEntry", "StateMap", "check_compact_moment", "check_param_lists",
           "expose", "foreign", "misspelt", "state_keys", "typo_hint", "unkept", "step_entry", "sync_state"]

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
# The part of a value given for a parameter that this rank holds (its topology's ``local_value``).
LocalValue = Callable[[Any, torch.Tensor], Any]
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
    """``opt.state``: AdamW's ``defaultdict(dict)``, raising a flag when it or one of its entries is edited. While
    ``landing`` is set (a weak reference to what waits for state still on its way to the host: a parked bucket's
    write-back after ``step()``), the first read through it (``[]``, ``get``, ``items``, ``values``) waits first."""

    def __init__(self, *args: Any) -> None:
        self.flag = _Flag()
        self.landing: Optional[weakref.WeakMethod] = None
        super().__init__(*args)

    def _landed(self) -> None:
        landing, self.landing = self.landing, None
        wait = None if landing is None else landing()
        if wait is not None:
            wait()

    def put(self, p: torch.Tensor, entry: Dict[str, Any]) -> None:
        """The optimizer's own write of an entry: not an edit."""
        dict.__setitem__(self, p, StateEntry(entry, self.flag))

    def __reduce__(self):
        return defaultdict, (dict,), None, None, iter((k, dict(v)) for k, v in self.items())


_noting(StateEntry, dict, _DICT_MUTATORS)
_noting(StateMap, defaultdict, _DICT_MUTATORS)


def _landing_first(cls: type, names: Sequence[str]) -> None:
    """Give ``cls`` the reading methods ``names`` of ``defaultdict``, each waiting for ``landing`` first."""
    for name in names:
        def read(self, *args, __method=getattr(defaultdict, name)):
            if self.landing is not None:
                self._landed()
            return __method(self, *args)

        read.__name__ = name
        setattr(cls, name, read)


_landing_first(StateMap, ("__getitem__", "get", "items", "values"))


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
            for k, p in zip(bucket.full.indices, bucket.owners):
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


def expose(state: State, bucket: FlatBucket, indices: Sequence[int], keep_foreign: bool = True) -> None:
    """Put the state entries of the bucket's parameters ``indices`` into ``state`` (views of the buffers), as
    AdamW creates its state at a parameter's first step. The one place entries are created. With
    ``keep_foreign``, the keys of the entry there now that are none of the rule's stay in the new one (see
    :func:`foreign`)."""
    for i in indices:
        entry = bucket.home.entry(i)
        if entry:  # (SGD without momentum keeps no state: no entry, as in torch)
            p = bucket.owners[i]
            old = dict.get(state, p) if keep_foreign else None  # (a plain read: no wait for state landing)
            _put(state, p, {**entry, **foreign(old, bucket)} if old else entry)
            bucket.home.set_exposed(i, True)


def foreign(entry: Dict[str, Any], bucket: FlatBucket) -> Dict[str, Any]:
    """The items of a parameter's entry whose keys are none of the rule's state: a wrapper's own, kept beside the
    state as AdamW keeps them (timm's ``Lookahead`` keeps its slow weights in its base optimizer's entries); carried
    by ``state_dict()`` and ``load_state_dict()``. Only where the bucket is whole in this process: a sharded or FSDP2
    bucket's state dict is made from the buffers, so there such keys are refused (nothing is foreign)."""
    if bucket.sharded or bucket.fsdp:
        return {}
    known = _known(bucket.rule)
    return {k: v for k, v in entry.items() if k not in known and misspelt(k, known) is None}


def unkept(bucket: FlatBucket) -> str:
    """What a refused unknown key is told where the bucket keeps no wrapper's keys (see :func:`foreign`)."""
    return (" (keys of a wrapper's own are kept only where the bucket is in one process, not sharded over ranks)"
            if bucket.sharded or bucket.fsdp else "")


def _known(rule: Rule) -> List[str]:
    """The keys of ``rule``'s state entries (``step`` for every rule: a step count is kept, shown or not)."""
    return ["step", *(k for k in state_keys(rule) if k is not None)]


def misspelt(key: Any, known: Sequence[str]) -> Optional[str]:
    """The one of ``known`` that ``key``, none of them, reads as a misspelling of (``steps``, ``Step``, a buffer's
    name with a letter more, less or other), else None. Such a key is refused, never kept as a wrapper's own: an edit meant for the state that
    would otherwise be dropped without a word. A wrapper's keys are its own words (``lookahead_slow_buff``)."""
    if not isinstance(key, str) or key in known:
        return None
    lowered = {k.lower(): k for k in known}
    close = difflib.get_close_matches(key.lower(), lowered, n=1, cutoff=0.8)
    return lowered[close[0]] if close else None


def typo_hint(keys: Any, rule: Rule) -> str:
    """`` (did you mean ...?)`` for those of ``keys`` that read as misspellings of ``rule``'s keys, else empty."""
    known = _known(rule)
    hints = [f"{k!r}: did you mean {m!r}?" for k in keys for m in [misspelt(k, known)] if m is not None]
    return f" ({'; '.join(hints)})" if hints else ""


def _reserved_hint(keys: Any, bucket: FlatBucket, i: int) -> str:
    """``; 'master' is reserved: ...`` for those of ``keys`` (refused in an edit of parameter ``i``'s entry) that
    are the optimizer's own words, kept for what it may show there, so never a wrapper's (see :func:`foreign`)."""
    rule, why = bucket.rule, []
    for key in sorted(k for k in keys if k in _known(rule)):
        if key == "master":
            dtype = bucket.params[i].dtype
            what = "the fp32 master weights of a bf16/fp16 parameter" + (
                f" (this parameter is {dtype}, its own master: its entry has none)" if dtype == torch.float32 else "")
        elif key == "param":
            what = ("a parameter's value after the update still pending when a state dict was saved (delayed_update): "
                    "load_state_dict() takes it from a saved entry; opt.state never holds it")
        elif key == rule.step_key or key == "step":
            what = f"the step count, which {rule.name}'s state counts inside and does not show"
        else:
            buf = next((b for b in rule.buffers if b.name == key), None)
            switch = "" if buf is None or not buf.switch else (
                f" (kept with {buf.switch}=True, which this parameter's group has off)")
            what = f"{rule.name}'s state, which this parameter's entry does not hold{switch}"
        why.append(f"{key!r} is reserved for {what}")
    return f"; {'; '.join(why)}" if why else ""


def _same_memory(a: Any, b: torch.Tensor) -> bool:
    a, b = _local(a), _local(b)
    return isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype \
        and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()


def _local(t: Any) -> Any:
    """A DTensor entry's local tensor (FSDP2: entries are DTensors over the buffers' views); anything else as it
    is."""
    return t.to_local() if fsdp2.is_dtensor(t) else t


def _check_edit(entry: Any, bucket: FlatBucket, i: int, local_value: LocalValue) -> Dict[str, Any]:
    """Validate an ``opt.state`` entry a user wrote for the bucket's parameter ``i`` (``local_value``: see
    :func:`sync_state`); returns it with ``step`` as a float. As AdamW, a non-empty entry must hold the whole state;
    its tensors are copied into the buffers."""
    where = f"opt.state entry of a parameter of shape {tuple(bucket.shapes[i])} ({bucket.where})"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is a {type(entry).__name__}, not a dict")
    slots = bucket.home.slots(i)
    steps = [] if bucket.home.step_key is None else [bucket.home.step_key]
    given, entry = entry, {k: v for k, v in entry.items() if k not in foreign(entry, bucket)}  # (those stay as given)
    unknown = set(entry) - {*steps, *slots}
    # Compact state's entries show no buffers of the rule (see StateViews.entry): an edit may leave them out.
    needs = [*steps, *(b.name for b in bucket.rule.buffers if not b.optional and (b.name in slots or bucket.compact))]
    missing = set(steps) - set(entry) if bucket.compact else set(needs) - set(entry)
    if unknown or missing:
        shared = unkept(bucket) if unknown - set(_known(bucket.rule)) else ""
        optional = [k for k in slots if k not in needs]
        may = f", and may hold {_listed(optional)}" if optional else ""
        raise ValueError(f"{where} has keys {sorted(map(str, given))}: it needs {_listed(needs)}{may}"
                         f"{_reserved_hint(unknown, bucket, i)}{shared}{typo_hint(unknown, bucket.rule)}")
    with prefixed(where):  # (FSDP2: a DTensor, or the parameter's full tensor: this rank's shard of it)
        entry = {k: v if k == "step" else local_value(v, bucket.owners[i]) for k, v in entry.items()}
    for name, v in entry.items():
        if name != "step" and (not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.is_meta
                               or v.shape != slots[name].shape):
            raise ValueError(f"{where}: {name} must be a floating-point tensor of shape {tuple(slots[name].shape)} "
                             f"holding values, got {v!r:.80}")
        if name in bucket.home.declared:
            check_compact_moment(bucket.state_dtype, bucket.home.declared[name], v, where)
    # Values only (see check_entry): detached, so a user's tensor that requires grad leaves autograd out of it.
    return {**{k: v.detach() for k, v in entry.items() if k not in steps},
            "step": _entry_step(bucket.home.step_key, entry, where, float(bucket.steps[i]))}


def _apply_edit(bucket: FlatBucket, i: int, entry: Optional[Dict[str, Any]]) -> None:
    """Write a validated edit into the buffers: ``None`` starts the parameter afresh, as AdamW's next step does for
    a missing or empty entry (zero moments, step 1 next); an entry's tensors are copied in."""
    slots = bucket.home.slots(i)
    if bucket.compact:  # moments converted (quantised) through the bucket; left as they are where not given
        for name in [n for n in slots if n != "master" and (entry is None or n in entry)]:
            bucket.home.load(name, i, None if entry is None else entry[name])
        slots = {k: v for k, v in slots.items() if k == "master"}
    if entry is None:
        for name, slot in slots.items():
            if name != "master":
                slot.zero_()
        bucket.home.reset(i)
        return
    bucket.home.set_step(i, entry["step"])
    given = [n for n in bucket.home.names if n in entry or (bucket.compact and _held(bucket, i, n))]
    bucket.home.hold_only(i, given)  # (as given; compact: a moment left out stays as it was)
    for name, slot in slots.items():
        if name in entry:
            if not _same_memory(entry[name], slot):
                slot.copy_(entry[name])
        elif _optional(bucket, name):
            slot.zero_()
    if "master" in entry:
        bucket.home.loaded(i, True)
    elif bucket.low_precision:
        bucket.home.loaded(i, False)  # AdamW's state has no master: take it from the parameter


def _held(bucket: FlatBucket, i: int, name: str) -> bool:
    """Whether parameter ``i``'s entry holds buffer ``name`` (an optional one only where an update or load gave
    it)."""
    return name in bucket.home.shows(i, {name: None})


def _optional(bucket: FlatBucket, name: str) -> bool:
    """Whether ``name`` is an optional buffer of the bucket's rule (amsgrad's: zeroed where an entry lacks it)."""
    buf = bucket.home.declared.get(name)
    return buf is not None and buf.optional


def sync_state(state: State, buckets: Buckets, settle: Callable[[bool], None], local_value: LocalValue
               ) -> "StateMap":
    """``opt.state`` after the user's edits since the last call took effect as they would in AdamW: a removed or
    emptied entry (``opt.state.clear()``, ``del opt.state[p]``, ``opt.state[p] = {}``, a new ``opt.state``)
    restarts its parameter (moments zeroed, step 1 next), and an empty one stays (``state_dict()`` lists it as
    AdamW's does, also one a mere read of ``opt.state[p]`` made before ``p``'s first step); tensors or steps put
    into an entry are copied into the buffers, and the entry points at the buffers again. Everything is validated
    before anything is written (``ValueError``). ``settle(homes)`` runs first when there is something to look at (an update still pending
    belongs to the state before the edit), with ``homes`` again once there are edits to write: the homes' state in
    flight lands before they are written, and what was brought up before them (a parked bucket's reload in
    backward) is let go. Without edits (torch's plain ``opt.state`` before the first step, made the optimizer's
    map) no home is settled, so that reload is the one the step uses. ``local_value(value, param)``: the part of
    an entry's tensor this rank holds (the optimizer's topology's). O(1) when nothing was edited."""
    if type(state) is StateMap and not state.flag.changed:
        return state
    settle(False)
    edits: List[Tuple[FlatBucket, int, Optional[Dict[str, Any]]]] = []
    for bucket in chain.from_iterable(buckets):
        for i, p in enumerate(bucket.owners):
            entry = state.get(p)
            if not entry:
                if bucket.exposed[i]:  # (an empty entry stays, as AdamW's does: state_dict() lists it)
                    edits.append((bucket, i, None))
            elif not (bucket.exposed[i] and _unchanged(entry, bucket, i)):
                edits.append((bucket, i, _check_edit(entry, bucket, i, local_value)))
    if edits:
        settle(True)
    out = state if type(state) is StateMap else StateMap(dict, state)
    for bucket, i, entry in edits:
        _apply_edit(bucket, i, entry)
    for bucket in chain.from_iterable(buckets):
        expose(out, bucket, [i for i in range(len(bucket.owners)) if bucket.exposed[i] or out.get(bucket.owners[i])])
    out.flag.changed = False
    return out


def _unchanged(entry: Dict[str, Any], bucket: FlatBucket, i: int) -> bool:
    """Whether an entry still is exactly what :func:`expose` put there (its tensors the buffers' views)."""
    mine = bucket.home.entry(i)
    return entry.keys() - foreign(entry, bucket).keys() == mine.keys() and all(_same_memory(entry[k], v)
                                                                              for k, v in mine.items())




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
    value = _local(value)  # (FSDP2: the rows this rank loads; each rank checks its own)
    if not buf.signed and bool((value < 0).any()):
        raise ValueError(f"{where}: {name} has a negative value ({float(value[value < 0].min()):g}), which a second "
                         f"moment cannot have; {DTYPE_LABELS[state_dtype]} state refuses it")
    if state_dtype == torch.int8 and not bool(torch.isfinite(value).all()):
        bad = value[~torch.isfinite(value)].view(-1)[0]
        raise ValueError(f"{where}: {name} holds a non-finite value ({float(bad)}), which 8-bit state cannot hold "
                         "(its elements share their 64-element block's scale); load it into fp32 or bf16 state, or "
                         "repair the checkpoint")



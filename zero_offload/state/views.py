"""The optimizer state as ``opt.state`` shows it and loads write it: each parameter's entry in the rule's format
(views of the store's buffers and of its separate master, not copies), which parameters have an entry, and a
parameter's values written back into the buffers through their codecs (its piece when sharded).

With compact state (``state_dtype`` not fp32) the entries hold the step (and ``master``) only: the rule's buffers
are not fp32 tensors anywhere, and :meth:`StateViews.fp32` / :meth:`StateViews.load` convert.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload.rules.base import Rule
from zero_offload.state.layout import BucketLayout, ShardLayout, memory_order_flat, view_like
from zero_offload.state.params import Masters
from zero_offload.state.store import StateStore

__all__ = ["StateViews"]


class StateViews:
    """A bucket's per-parameter state entries.

    Attributes:
        exposed (List[bool]): whether each parameter has an entry in the optimizer's ``state``;
            ``all_exposed`` whether all do.
    """

    def __init__(self, rule: Rule, store: StateStore, masters: Masters, layout: BucketLayout,
                 shard: Optional[ShardLayout], params: Sequence[torch.Tensor],
                 placed: Optional[Sequence[torch.Tensor]] = None):
        self.rule, self.store, self.masters = rule, store, masters
        self.layout, self.shard, self.params = layout, shard, params
        # FSDP2: each entry's tensors are DTensors over the views, placed like these parameters (zero_offload.fsdp2).
        self.placed = placed
        self.steps = store.steps
        self.exposed = [False] * len(params)
        self.all_exposed = False
        # Per optional buffer (amsgrad's), whether each parameter's entry shows it: as AdamW's state holds amsgrad's
        # buffer from the parameter's first update with amsgrad on (or a load or edit that gives it), not merely
        # because the bucket allocated the buffer (amsgrad switched off before that update).
        self.holds: Dict[str, List[bool]] = {b.name: [False] * len(params) for b in rule.buffers if b.optional}
        self._all_hold = dict.fromkeys(self.holds, False)
        self.all_hold = not self.holds  # (every entry holds every optional buffer)
        self.wrapped: Dict[int, List[torch.Tensor]] = {}  # FSDP2: the DTensors each entry shows, by parameter

    def entry(self, i: int) -> Dict[str, torch.Tensor]:
        """Parameter ``i``'s optimizer state in the rule's format: views, not copies (with compact state, the step
        and ``master`` only; ``state_dict()`` converts the rest)."""
        slots = {} if self.store.compact else self.shown(i, self.store.slots(i))
        if self.masters.low_precision:
            slots["master"] = self.masters.master_views[i]
        if self.placed is not None:
            from zero_offload.fsdp2 import wrap

            slots = {name: wrap(view, self.placed[i]) for name, view in slots.items()}
            self.wrapped[i] = list(slots.values())
        key = self.step_key
        return {**({} if key is None else {key: self.steps[i]}), **slots}

    def shown_versions(self) -> List[int]:
        """FSDP2: the version counter of each DTensor the entries show (an in-place write through one moves its own
        counter, not its view's: DTensor runs the op on the view below autograd); empty elsewhere, where a write
        through an entry moves its buffer's counter (a view shares it)."""
        return [t._version for shown in self.wrapped.values() for t in shown]

    @property
    def step_key(self) -> Optional[str]:
        """The key of the step count in the entries: the rule's; for a rule whose format has none (Lion, SGD),
        none, except with compact state, whose entries show no buffers: ``"step"`` then marks a parameter that has
        state (``state_dict()`` leaves it out)."""
        if self.rule.step_key is None and self.store.compact:
            return "step"
        return self.rule.step_key

    def slots(self, i: int, *, master: bool = True) -> Dict[str, torch.Tensor]:
        """Parameter ``i``'s state tensors by name (views of the buffers), the master with ``master`` where it is
        separate from the parameter."""
        out = self.store.slots(i)
        if master and self.masters.separate:
            out["master"] = self.masters.master_views[i]
        return out

    def set_exposed(self, i: int, exposed: bool) -> None:
        """Record whether parameter ``i`` has an entry in the optimizer's ``state`` (see checkpoint.expose)."""
        self.exposed[i] = exposed
        self.all_exposed = all(self.exposed)

    def set_step(self, i: int, step: float) -> None:
        self.steps[i] = step

    def shown(self, i: int, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``tensors`` (parameter ``i``'s, by buffer name) less the optional buffers its entry does not hold."""
        holds = self.holds
        if not holds or all(holds[name][i] for name in holds if name in tensors):
            return tensors
        return {name: t for name, t in tensors.items() if name not in holds or holds[name][i]}

    def hold(self, indices: Sequence[int], names: Sequence[str]) -> List[int]:
        """Parameters ``indices`` were just updated with the optional buffers ``names`` in use (amsgrad on): their
        entries hold them from now on. Returns those whose entries gained one (O(1) once every entry holds all)."""
        gained: List[int] = []
        for name in names:
            held = self.holds.get(name)
            if held is None or self._all_hold[name]:
                continue
            for i in indices:
                if not held[i]:
                    held[i] = True
                    gained.append(i)
            self._all_hold[name] = all(held)
        self.all_hold = all(self._all_hold.values())
        return gained

    def hold_only(self, i: int, names: Sequence[str]) -> None:
        """Parameter ``i``'s entry holds exactly the optional buffers among ``names`` (a loaded or edited entry's
        keys)."""
        for name, held in self.holds.items():
            held[i] = name in names
            self._all_hold[name] = self.all_hold = False  # (the next update's hold() looks again)

    def reset(self, i: int) -> None:
        """Parameter ``i`` starts afresh (its state is zeroed by the caller): step 0, no state entry, master
        taken from the parameter at its next update."""
        self.steps[i] = 0.0
        self.set_exposed(i, False)
        self.hold_only(i, ())
        self.masters.loaded(i, False)

    def fp32(self, name: str) -> torch.Tensor:
        """State buffer ``name`` whole as float32: the buffer itself for fp32 state, else a new tensor."""
        return self.store.fp32(name)

    def _range(self, i: int) -> Tuple[int, int]:
        """Element range of parameter ``i``'s slot (its piece when sharded) in the buffers."""
        if self.shard is not None:
            return self.shard.pieces[i]
        o = self.layout.offsets[i]
        return o, o + self.layout.numels[i]

    def load(self, name: str, i: int, value: Optional[torch.Tensor]) -> None:
        """Write parameter ``i``'s state buffer ``name`` (its piece when sharded) from ``value``, parameter-shaped,
        any floating dtype and device, converted by the buffer's codec; None: zeros. ``value`` is already
        validated (for 8-bit non-negative buffers: no negative value)."""
        a, b = self._range(i)
        if value is not None and self.shard is not None:
            src = self.shard.piece_src[i]
            value = memory_order_flat(value)[src : src + b - a]
        if not self.store.codecs[name].scaled:
            slot = self.store.views[name][i]  # shaped like the parameter, or the 1-D piece
            if value is None:
                slot.zero_()
            else:
                slot.copy_(value)
            return
        flat = None
        if value is not None:
            flat = torch.empty(b - a, dtype=torch.float32)
            if self.shard is not None:
                flat.copy_(value)
            else:  # in the slot's memory order, whatever the value's strides
                view_like(flat, 0, self.params[i]).copy_(value)
        self.store.write(name, a, b, flat)

    def load_pieces(self, entries: Sequence[Optional[Dict[str, object]]]) -> None:
        """Sharded: copy this rank's piece of each parameter's full (parameter-shaped) state into the shard;
        ``None``: fresh state. Entries are already validated (``checkpoint.check_entry``)."""
        for i, entry in enumerate(entries):
            a, b = self.shard.pieces[i]
            src = self.shard.piece_src[i]
            for name in self.store.names:
                self.load(name, i, None if entry is None else entry.get(name))
            if entry is None:
                self.reset(i)
                continue
            self.steps[i] = entry["step"]  # (checkpoint.check_entry's count, also for a rule whose format has none)
            self.hold_only(i, list(entry))
            if self.masters.separate and "master" in entry:
                self.masters.master_views[i].copy_(memory_order_flat(entry["master"])[src : src + b - a])
            self.masters.loaded(i, "master" in entry)

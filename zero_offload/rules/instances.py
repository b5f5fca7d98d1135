"""The wrapped class's own instances, one per bucket, kept for the optimizer's life by the generic rule
(:mod:`zero_offload.rules.torch_class`), and what they keep beyond the per-parameter state:

* keys the class adds to its param group as it steps (pytorch_optimizer's ``step``, schedule-free's ``weight_sum``):
  the rule shows them in the optimizer's param group after each update (so ``state_dict()`` carries them in the
  class's format), and a bucket's instance takes them from there when the group was replaced by a load or edited;
* entries of the class's ``state`` that are no parameter's (MADGRAD's ``k``): carried by ``state_dict()`` and
  taken back at ``load_state_dict()`` through the hooks :func:`zero_offload.offload` registers;
* attributes its ``step()`` changes: kept in memory, as the class keeps them (its state dict has none).

An update that did not count (a preview of a pending one on copies of the buffers) is undone here
too: a bucket's next update with the same step counts starts from what its instance held before.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch

from zero_offload.rules.probe import same

__all__ = ["Bound", "GroupRecord", "Snapshot"]


@dataclasses.dataclass
class Snapshot:
    """What an instance holds beyond the per-parameter state, copied: its param group's state keys, its global
    ``state`` entries, its changing attributes."""

    group: Dict[str, Any]
    globals: Dict[str, Any]
    attributes: Dict[str, Any]


@dataclasses.dataclass
class GroupRecord:
    """One param group, as the buckets' instances see it: the group dict last seen (``live``), the values of the
    class's keys last shown in it (``published``), and those its buckets' instances start from after it was
    replaced or edited (``adopted``, ``generation``)."""

    live: Optional[Dict[str, Any]] = None
    published: Dict[str, Any] = dataclasses.field(default_factory=dict)
    adopted: Dict[str, Any] = dataclasses.field(default_factory=dict)
    generation: int = 0

    def observe(self, live: Dict[str, Any], keys: Any) -> None:
        """Note a replaced group dict (a load) or one whose class keys were edited since they were shown."""
        values = {k: live[k] for k in keys if k in live}
        if self.live is not live or not same(values, self.published):
            self.live, self.generation = live, self.generation + 1
            self.adopted, self.published = copy.deepcopy(values), copy.deepcopy(values)


class Bound:
    """The class's instance for one bucket (``opt``, built at its first update), the bucket's live step counts
    (``steps``), and its last update: the step counts before it (``key``), the snapshots before and after it, and
    whether it was ``dry`` (on copies)."""

    def __init__(self, opt: torch.optim.Optimizer, group: int, steps: Optional[torch.Tensor],
                 attributes: Tuple[str, ...]):
        self.opt, self.group, self.steps, self.attributes = opt, group, steps, attributes
        self.stash: list = []  # the runs of the update in progress (the class steps once, at the last)
        self.key: Optional[Tuple] = None
        self.pre: Optional[Snapshot] = None
        self.post: Optional[Snapshot] = None
        self.dry = False
        self.group_generation = self.global_generation = 0
        self.tick = 0  # when it last stepped, in the rule's count of updates
        self.settings = {"params"}  # the keys of its param group that the rule sets: the rest is the class's
        self.initial: Dict[str, Any] = {}  # the class's keys as its constructor set them (schedule-free's lr_max)

    def group_state(self) -> Dict[str, Any]:
        """The class's own keys of its param group (those not among the settings the rule gives it)."""
        return {k: v for k, v in self.opt.param_groups[0].items() if k not in self.settings}

    def global_state(self) -> Dict[str, Any]:
        return {k: v for k, v in self.opt.state.items() if not isinstance(k, torch.Tensor)}

    def capture(self) -> Snapshot:
        return Snapshot(copy.deepcopy(self.group_state()), copy.deepcopy(self.global_state()),
                        {a: copy.deepcopy(getattr(self.opt, a)) for a in self.attributes if hasattr(self.opt, a)})

    def set_group_state(self, values: Dict[str, Any]) -> None:
        """The class's keys of its param group become ``values`` (those its constructor set, where absent)."""
        values = {**self.initial, **values}
        group = self.opt.param_groups[0]
        for k in list(self.group_state()):
            if k not in values:
                del group[k]
        group.update(copy.deepcopy(values))

    def set_global_state(self, values: Dict[str, Any]) -> None:
        for k in list(self.global_state()):
            if k not in values:
                del self.opt.state[k]
        for k, v in copy.deepcopy(values).items():
            self.opt.state[k] = v

    def restore(self, snap: Snapshot) -> None:
        self.set_group_state(snap.group)
        self.set_global_state(snap.globals)
        for a, v in snap.attributes.items():
            setattr(self.opt, a, copy.deepcopy(v))

    def uncounted(self) -> bool:
        """The last update was not counted (rolled back: the step counts are still those before it)."""
        return (self.key is not None and self.steps is not None and not self.dry
                and tuple(self.steps.tolist()) == self.key[0])

    def current(self) -> Optional[Snapshot]:
        """What the instance holds as the buckets' state stands: after its last update (a preview's, which is what
        saving shows), or before it where it was rolled back."""
        return self.pre if self.uncounted() else self.post

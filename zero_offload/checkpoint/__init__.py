"""The optimizer state and param groups as users see them: ``opt.state`` entries and their edits
(:mod:`~zero_offload.checkpoint.entries`), full state dicts (:mod:`~zero_offload.checkpoint.full`), and the sharded
state of ``torch.distributed.checkpoint`` (:mod:`~zero_offload.checkpoint.dcp`, loaded through
:mod:`~zero_offload.checkpoint.staging`)."""

from zero_offload.checkpoint.dcp import (FlatPiece, WholePiece, apply_sharded_load, commit_staged, plan_sharded_load,
                                         sharded_state_dict)
from zero_offload.checkpoint.entries import (ParamList, StateEntry, StateMap, check_compact_moment,
                                             check_param_lists, expose, sync_state)
from zero_offload.checkpoint.full import (Ahead, LoadPlan, add_compact_moments, ahead_entries, apply_load,
                                          check_format, full_state, plan_load)

__all__ = ["Ahead", "FlatPiece", "LoadPlan", "ParamList", "StateEntry", "StateMap", "WholePiece",
           "add_compact_moments", "ahead_entries", "apply_load", "apply_sharded_load", "check_compact_moment",
           "check_format", "check_param_lists", "commit_staged", "expose", "full_state", "plan_load",
           "plan_sharded_load", "sharded_state_dict", "sync_state"]

"""The sharded state that ``torch.distributed.checkpoint`` (DCP) saves and loads without gathering: each state
tensor a :class:`FlatPiece` holding this rank's piece, a view of the host buffers, which ``dcp.save`` reads in
place. ``dcp.load`` writes into staging instead (a :class:`LoadStage`: DCP may fail part way, a truncated file
say, and a failed load must change nothing), which is then validated and committed like a full state dict (plan,
then apply): the staging buffers trade their memory with the live ones, no byte copied."""
from __future__ import annotations

from copy import deepcopy
from itertools import chain
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload.buckets import FlatBucket
from zero_offload.checkpoint.staging import LoadStage, Staging, Twin
from zero_offload.rules.base import Rule
from zero_offload.state.layout import memory_order_flat, view_like
from zero_offload.options import check_step
from zero_offload.checkpoint.entries import Buckets, State, check_param_lists, expose
from zero_offload.checkpoint.full import Ahead, _entry_tensors, _install_params, _positions, _where, merge_groups

__all__ = ["FlatPiece", "WholePiece", "apply_sharded_load", "commit_staged", "plan_sharded_load",
           "sharded_state_dict"]


# ----------------------------------------------------------------------------- torch.distributed.checkpoint --
def _state_pieces(bucket: FlatBucket, i: int, after: Optional[Ahead], param: bool) -> Dict[str, torch.Tensor]:
    """Parameter ``i``'s state tensors that this rank holds, 1-D in slot order (flat ranges of the buffers, which
    saving reads in place and loading stages; of ``after``'s copies where a pending update is)."""
    return {name: memory_order_flat(t) for name, t in _entry_tensors(bucket, i, after, param).items()}


class FlatPiece(torch.Tensor):
    """A parameter's flattened state tensor (``numel`` elements) as ``torch.distributed.checkpoint`` sees it, of which
    this rank holds the contiguous range ``[start, start + local.numel())``, ``local`` being a view of the host
    buffers (which ``dcp.save`` reads in place; ``dcp.load`` writes into staging, see
    :mod:`~zero_offload.checkpoint.staging`).

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
    staging: Staging

    @staticmethod
    def __new__(cls, staging: Staging, start: int, numel: int) -> "FlatPiece":
        local = staging.local
        piece = torch.Tensor._make_wrapper_subclass(cls, (numel,), dtype=local.dtype, device=local.device)
        piece.local, piece.start, piece.staging = local, start, staging
        return piece

    def __init__(self, staging: Staging, start: int, numel: int) -> None:
        super().__init__()

    def _chunks(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        if self.local.numel() == 0:  # this rank holds nothing of the parameter: nothing to write or read
            return []
        return [ChunkStorageMetadata(offsets=torch.Size([self.start]), sizes=self.local.size())]

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        self.staging.plan_save()
        props = TensorProperties(dtype=self.dtype, pin_memory=False)
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=props, size=self.size()))
                for chunk in self._chunks()]

    def __create_chunk_list__(self) -> list:
        self.staging.plan_load()
        return self._chunks()

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        if index.offset is not None and tuple(index.offset) != (self.start,):
            raise ValueError(f"{index.fqn}: this rank holds the piece at offset {self.start}, not {index.offset}")
        return self.staging.target()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.new_empty.default and type(args[0]) is cls:
            # ``dcp.async_save``'s staging (torch's StateDictStager) copies a tensor subclass as it copies a DTensor:
            # ``new_empty`` on the host for the shell, then a deep copy of each attribute into it (``local``, a
            # view of the buffers, copied with its storage: the snapshot the upload reads, whatever the optimizer
            # does meanwhile). The shell is a FlatPiece of the same size, which those attributes complete.
            x = args[0]
            return torch.Tensor._make_wrapper_subclass(cls, x.shape, dtype=x.dtype, device=torch.device("cpu"))
        raise TypeError(f"{func} on a FlatPiece of sharded_state_dict(): it is only for torch.distributed.checkpoint "
                        "(its local piece is .local)")

    def __repr__(self) -> str:
        return f"FlatPiece(numel={self.numel()}, start={self.start}, local={self.local.numel()} elements)"


class WholePiece(torch.Tensor):
    """The state tensor of a parameter whose bucket is not sharded: a plain tensor (a view of the host buffers, which
    ``dcp.save`` reads in place and which pickles, prints and computes as one), that also tells DCP's load where to
    write (staging, see :mod:`~zero_offload.checkpoint.staging`). Saved in a plain tensor's format."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # (results of operations are plain tensors)

    local: torch.Tensor
    staging: Staging

    @staticmethod
    def of(staging: Staging) -> "WholePiece":
        piece = staging.local.as_subclass(WholePiece)
        piece.local, piece.staging = staging.local, staging
        return piece

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        self.staging.plan_save()
        zero = torch.Size([0] * self.dim())
        return [WriteItem(index=MetadataIndex(fqn, zero), type=WriteItemType.TENSOR,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=zero, sizes=self.size()),
                                                      properties=TensorProperties.create_from_tensor(self.local),
                                                      size=self.size()))]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        self.staging.plan_load()
        return [ChunkStorageMetadata(offsets=torch.Size([0] * self.dim()), sizes=self.size())]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        if index.offset is not None and any(index.offset):
            raise ValueError(f"{index.fqn}: not sharded, no piece at offset {index.offset}")
        return self.staging.target()

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.local.__reduce_ex__(protocol)  # a plain tensor, which torch.load(weights_only=True) takes

    def __deepcopy__(self, memo: Dict[int, Any]) -> torch.Tensor:
        return deepcopy(self.local, memo)


def sharded_state_dict(groups: Sequence[Dict[str, Any]], buckets: Buckets,
                       ahead: Optional[Dict[FlatBucket, Ahead]] = None, param: bool = False) -> Dict[str, Any]:
    """See :meth:`zero_offload.OffloadOptimizer.sharded_state_dict`. ``ahead``: a pending update's state, given
    instead of the buffers'; ``param``: each parameter's value too (``delayed_update``, whose parameters can be a
    step behind the state)."""
    ahead = ahead or {}
    compact = next((b for b in chain.from_iterable(buckets) if b.compact), None)
    if compact is not None:
        raise RuntimeError(f"sharded_state_dict() hands out the live state buffers for torch.distributed.checkpoint "
                           f"to save in place and stage loads, which needs fp32 moments; this optimizer keeps them as "
                           f"{compact.state_dtype} (state_dtype). Use state_dict() / load_state_dict() (fp32 moments, "
                           f"converted a bucket at a time), or state_dtype=torch.float32.")
    position = _positions(groups)
    state: Dict[str, Dict[str, Any]] = {}
    out_groups = []
    for group in groups:
        out_groups.append({**{k: deepcopy(v) for k, v in group.items() if k != "params"},
                           "params": [position[id(p)] for p in group["params"]]})
    stage = LoadStage()
    for bucket in chain.from_iterable(buckets):
        after = ahead.get(bucket)
        twins: Dict[str, Twin] = {}
        for i, p in enumerate(bucket.params):
            copied = after is not None and after.flat is not None and i in after.indices
            entry: Dict[str, Any] = {"step": (after.steps if copied else bucket.steps)[i].clone()}
            for name, local in _state_pieces(bucket, i, after, param).items():
                live = bucket.home.live(name)
                twin = None  # (a private copy, or ``param``: not a view of a live buffer)
                if live is not None and not copied:
                    twin = twins.get(name)
                    if twin is None:
                        twin = twins[name] = stage.twin(live, bucket.pin)
                staging = Staging(local, stage if live is None or twin is not None else None, twin)
                if bucket.sharded and bucket.shard.full.numels[i]:
                    entry[name] = FlatPiece(staging, bucket.shard.piece_src[i], bucket.shard.full.numels[i])
                else:  # the whole parameter
                    entry[name] = WholePiece.of(staging)
            state[str(position[id(p)])] = entry
    return {"state": state, "param_groups": out_groups}


def commit_staged(state_dict: Dict[str, Any]) -> None:
    """What ``dcp.load`` staged for the :func:`sharded_state_dict` ``state_dict`` (validated) becomes the live
    state."""
    stages: List[LoadStage] = []
    for entry in state_dict["state"].values():
        for t in entry.values() if isinstance(entry, dict) else ():
            stage = t.staging.stage if isinstance(t, (FlatPiece, WholePiece)) else None
            if stage is not None and not any(stage is s for s in stages):
                stages.append(stage)
    for stage in stages:
        stage.commit()


def _copy_in(bucket: FlatBucket, tensors: Dict[torch.Tensor, Dict[str, Any]]) -> None:
    """After the commit (which made the staged buffers live): where a tensor of the dict is not a view of the
    buffers (a private copy, made while a delayed update was pending, of which it shows the result; a tensor the
    caller put in), copy it into them; and each ``param`` into its parameter, where it is not the parameter's own
    storage."""
    values: List[Optional[torch.Tensor]] = []
    for i, p in enumerate(bucket.params):
        live = _state_pieces(bucket, i, None, param=False)
        loaded = {name: t.staging.take() if isinstance(t, WholePiece) else t for name, t in tensors[p].items()}
        for name, t in loaded.items():
            if name in live and t.data_ptr() != live[name].data_ptr():
                live[name].copy_(t)
        value = loaded.get("param")
        values.append(None if value is None or value.data_ptr() == p.data_ptr() else view_like(value, 0, p))
    _install_params(bucket, values)


def plan_sharded_load(groups: Sequence[Dict[str, Any]], buckets: Buckets, state_dict: Any, rule: Rule,
                      param: bool = False, defaults: Optional[Dict[str, Any]] = None
                      ) -> Tuple[List[Dict[str, Any]], Dict[torch.Tensor, float], Dict[torch.Tensor, Dict[str, Any]]]:
    """Validate a :func:`sharded_state_dict` filled by ``dcp.load``: the new param groups, each parameter's step,
    and the tensors ``dcp.load`` wrote for each parameter of an unsharded bucket (with ``param``, its value).
    ``defaults``: the optimizer's (see :func:`~zero_offload.checkpoint.full.merge_groups`)."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("load_sharded_state_dict expects the dict from sharded_state_dict(), filled by "
                         "torch.distributed.checkpoint.load")
    what = "loaded sharded state dict"
    check_param_lists(groups, buckets)
    new_groups = merge_groups(groups, state_dict["param_groups"], what, rule, same_amsgrad=True, defaults=defaults)
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
                       groups: Sequence[Dict[str, Any]],
                       tensors: Optional[Dict[torch.Tensor, Dict[str, Any]]] = None) -> None:
    """Apply the validated step counts; ``dcp.load`` already wrote moments and masters into the buffers, except
    for the ``tensors`` that are not views of them (see :func:`_copy_in`). ``groups``: the param groups as loaded."""
    for gi, group_buckets in enumerate(buckets):
        for bucket in group_buckets:
            _apply_bucket(state, bucket, steps, bucket.rule.needed(bucket.rule.hyper(groups[gi])), tensors)


def _apply_bucket(state: State, bucket: FlatBucket, steps: Dict[torch.Tensor, float], needed: Sequence[Any],
                  tensors: Optional[Dict[torch.Tensor, Dict[str, Any]]]) -> None:
    if tensors and not bucket.sharded:
        _copy_in(bucket, tensors)
    on = [b.name for b in needed if b.optional]
    off = [n for n in bucket.home.names if bucket.home.declared[n].optional and n not in on]
    for i, p in enumerate(bucket.params):
        step = steps[p]
        bucket.home.set_step(i, step)
        if step > 0:
            bucket.home.hold_only(i, on + _held_values(bucket, i, off))
            expose(state, bucket, [i])
        else:
            bucket.home.set_exposed(i, False)
            state.pop(p, None)
        # A master loaded with the state is kept while the parameter still rounds from it (see
        # Masters.refresh); a parameter never stepped takes its master from the parameter.
        bucket.home.loaded(i, step > 0 and bucket.low_precision)


def _held_values(bucket: FlatBucket, i: int, names: Sequence[str]) -> List[str]:
    """Those of the optional buffers ``names``, which parameter ``i``'s group does not use now (amsgrad off), that
    its entry still holds after a DCP load, as AdamW's keeps amsgrad's running maximum once created: a DCP checkpoint
    holds every buffer of every parameter (the flat pieces reshard), and an entry that did not hold one saved zeros
    (a buffer starts at zero, is zeroed where a load or edit leaves it out, and is written only while in use), so
    one with a value that is not zero was held. Sharded, none: a rank sees its own piece only, and the ranks must
    agree on the keys (see docs/differences.md)."""
    if not names or bucket.sharded:
        return []
    slots = bucket.home.slots(i)
    return [n for n in names if bool(slots[n].any())]

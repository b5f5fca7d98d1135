"""FSDP2's records of its parameters (``torch.distributed.fsdp.fully_shard``), as this optimizer reads them: which
parameters FSDP2 manages, the storage it keeps for each shard, and the ``DTensor`` entries of ``opt.state``. Each
rank offloads the state of its own shards (FSDP does every collective), so what the buckets hold is each parameter's
*local* shard; what the mesh means (the placements taken, the collectives over it) is the Mesh topology's
(:mod:`zero_offload.topology.mesh`).

A parameter FSDP2 shards is a ``DTensor``; its local shard (``p.to_local()``, no padding, possibly empty) is what
FSDP's next all-gather reads, so the updated values are written into it (on the host, and on a GPU for a bucket
stepped there, the optimizer's buffers take over the storage FSDP keeps for it, see :func:`bind_shard`, and the
update writes it directly); its gradient arrives
as a ``DTensor`` placed alike, through the post-accumulate-grad hooks FSDP runs after each unit's reduce-scatter. ``opt.state`` entries are
``DTensor``s over the host buffers, placed like their parameter, so ``torch.distributed.checkpoint`` plans and loads
them as it does ``torch.optim.AdamW``'s.

Placements alone cannot tell FSDP2 from tensor parallelism (a colwise-parallel weight is ``Shard(0)`` on a 1-D mesh
too), so the parameters FSDP2 manages are found in FSDP's own state registry: private (``_composable_state`` and
``FSDPState``'s param groups), there being no public way from the parameters' side. It also gives each parameter's
FSDP unit, by which the buckets are cut (a unit's gradients arrive together).

``torch.distributed`` is imported here only when a ``DTensor`` parameter is given: ``import zero_offload`` stays
cheap.
"""

from __future__ import annotations

import gc
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload._compat import own_storage

__all__ = ["adopt_switched", "bind_shard", "given", "is_dtensor", "local_ptrs", "local_shard", "registry", "take", "takeover",
           "takeover_numel", "takeover_ptrs", "version", "wrap"]


def is_dtensor(p: Any) -> bool:
    """A DTensor can only exist once its module was imported: look there, without importing torch.distributed."""
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        cls = getattr(sys.modules.get(name), "DTensor", None)
        if cls is not None and isinstance(p, cls):
            return True
    return False


def version(t: torch.Tensor) -> int:
    """A count that moves whenever ``t`` is written in place by an op autograd sees. A DTensor has two autograd
    version counters: its own (an in-place op on the DTensor, ``p.copy_(...)``, bumps it) and its local tensor's (a
    write into ``p.to_local()`` bumps only that one): their sum. (``dcp.load`` into a model's state dict moves
    neither.)"""
    local = getattr(t, "_local_tensor", None)
    return t._version if local is None else t._version + local._version


def take(params: Any, options: Any) -> "tuple[Any, Optional[Dict[int, int]]]":
    """The constructor's ``params`` (tensors or group dicts, maybe a generator), as a list, and, where they hold
    DTensors, which parameters FSDP2 manages (see :func:`registry`), after refusing the options that cannot go with
    FSDP2's shards (``options``: :class:`~zero_offload.options.Options`). FSDP's registry is read *before* the
    iterable is consumed: ``model.parameters()`` keeps its model (and so FSDP's state) alive only until then."""
    managed = registry() if _dtensors_exist() else None
    params = params if isinstance(params, torch.Tensor) else list(params)
    for item in params if isinstance(params, list) else ():
        # A group's parameters given as a generator are read once here: listed in the group, as torch's
        # add_param_group lists them, so that the group keeps them.
        if isinstance(item, dict) and not isinstance(item.get("params"), (torch.Tensor, list, type(None))):
            item["params"] = list(item["params"])
    return params, (managed if given(params, options) else None)


def adopt_switched(opt: Any) -> None:
    """Lay ``opt`` (an ``OffloadOptimizer``) out again over FSDP2's parameters where its groups' ``params`` were
    switched to them before its first step: what accelerate's FSDP2 preparation does (``Accelerator.prepare(model,
    optimizer)``: the optimizer is built over the model's plain parameters, ``fully_shard`` is applied, then each
    group's ``params`` is replaced by the DTensors FSDP2 made). As if built over them, with the groups'
    hyperparameters as they are and what was set since construction kept (torch.optim's hooks, the ``nonfinite``
    policy, a timeline being recorded). The new layout is made beside the old one (the whole model's, which the
    host held already; the new one is this rank's shards): if that fails, the optimizer is left as it was, and
    otherwise the old layout and its gradient hooks are let go at once. Any other edit of ``params``, or one after
    a step, is left to the optimizer's refusal (``check_param_lists``). (Only an optimizer not over FSDP2's
    parameters already: see ``Topology.adopt_switched``.)"""
    groups = opt.param_groups
    if not _dtensors_exist() or len(groups) != len(opt._buckets):
        return
    if all(not getattr(getattr(g["params"], "flag", None), "changed", True) for g in groups):
        return  # (the lists the optimizer made, unedited: the usual case, every zero_grad())
    listed = [p for g in groups for p in g["params"]]
    if not listed or not all(is_dtensor(p) for p in listed):
        return
    if any(bool(bucket.steps.any()) for buckets in opt._buckets for bucket in buckets):
        return
    fresh = [dict(g) for g in groups]
    given(fresh, opt.options)  # (options FSDP2's shards cannot take are refused before anything changes)
    saved = dict(vars(opt))
    try:
        opt._start(fresh, opt._rule, dict(opt.defaults), opt._given)
    except BaseException:
        if opt._unhook is not saved["_unhook"]:
            opt._unhook()  # whatever hooks the new layout registered
        vars(opt).clear()
        vars(opt).update(saved)
        raise
    for name, value in saved.items():
        if name.startswith("_optimizer_") and name.endswith("_hooks"):
            setattr(opt, name, value)
    opt.nonfinite = saved["options"].nonfinite
    opt._transport.timeline = saved["_transport"].timeline
    saved["_unhook"]()  # the gradient hooks on the plain parameters
    del saved
    gc.collect()  # the old buckets and lanes refer to each other: free them now, not at the next collection


def _dtensors_exist() -> bool:
    return any(getattr(sys.modules.get(name), "DTensor", None) is not None
               for name in ("torch.distributed.tensor", "torch.distributed._tensor"))


def tensors_given(params: Any) -> List[Any]:
    """The parameters in the constructor's ``params`` (listed: a tensor, or a list of tensors, ``(name, tensor)``
    pairs or group dicts whose ``params`` are any of those), in order, not yet checked to be tensors."""
    tensors = []
    for item in [params] if isinstance(params, (torch.Tensor, dict)) else params:
        group = item.get("params", ()) if isinstance(item, dict) else [item]
        for p in [group] if isinstance(group, torch.Tensor) else group:
            tensors.append(p[1] if isinstance(p, tuple) else p)
    return tensors


def given(params: Any, options: Any) -> bool:
    """Whether ``params`` (the constructor's, a list of tensors or group dicts) hold DTensors, after refusing the
    options that cannot go with FSDP2's shards."""
    if not any(is_dtensor(p) for p in tensors_given(params)):
        return False
    refused = [name for name, on in (("process_group", options.sharded),
                                     ("delayed_update", bool(options.delayed_update)),
                                     ("overlap_step", options.overlap_step)) if on]
    if refused and refused[0] == "process_group":
        raise ValueError("OffloadOptimizer over FSDP2's sharded parameters does not take process_group: FSDP does "
                         "the collectives and each rank keeps the state of its own shards (leave it out)")
    if refused:
        raise ValueError(f"OffloadOptimizer over FSDP2's sharded parameters does not take {refused[0]} yet: "
                         "delayed_update and overlap_step are not combined with FSDP2 (leave it out)")
    return True


# FSDP2's state class lives in one of these modules (its home moved from torch.distributed._composable.fsdp to
# torch.distributed.fsdp._fully_shard); no FSDP2 state can exist before its module was imported.
_FSDP_STATE_MODULES = ("torch.distributed.fsdp._fully_shard._fsdp_state",
                       "torch.distributed._composable.fsdp._fsdp_state")


def registry() -> Dict[int, Tuple[int, Any, int]]:
    """``id`` of every parameter FSDP2 manages in this process -> its FSDP unit (an index, per FSDP state and param
    group), FSDP's record of it (its ``FSDPParam``) and its place in FSDP's order (of its states as ``fully_shard``
    made them, then of each unit's parameters: a model's parameters come in the same order on every rank, whatever
    other models the process holds). Private (see the module docstring): FSDP's composable-state registry and its
    param groups."""
    found: Dict[int, Tuple[int, Any, int]] = {}
    classes = [getattr(sys.modules.get(name), "FSDPState", None) for name in _FSDP_STATE_MODULES]
    FSDPState = next((cls for cls in classes if cls is not None), None)
    if FSDPState is None:
        return found
    from torch.distributed._composable_state import _module_state_mapping

    unit = 0
    for ref in list(_module_state_mapping.values()):
        state = ref() if callable(ref) else ref
        if not isinstance(state, FSDPState):
            continue
        # (a list in torch 2.13; one group, ``_fsdp_param_group``, in 2.11)
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        for group in groups:
            for fsdp_param in group.fsdp_params:
                found.setdefault(id(fsdp_param.sharded_param), (unit, fsdp_param, len(found)))
            unit += 1
    return found


def local_shard(p: torch.Tensor) -> torch.Tensor:
    """The parameter's local shard, as a tensor aliasing FSDP's storage (what its next all-gather reads)."""
    with torch.no_grad():
        return p.to_local()


def takeover(p: torch.Tensor, record: Any) -> Optional[Any]:
    """FSDP's record of ``p`` (its ``FSDPParam``) where the optimizer can take over the storage of ``p``'s shard,
    else None. Taken over: a shard FSDP keeps as a plain padded 1-D tensor (``_sharded_param_data``, what its
    all-gather reads) whose leading rows are ``p``'s local shard, on the host (a CPU mesh, or ``CPUOffloadPolicy``:
    by every bucket) or on a GPU (by a bucket stepped there, ``placement`` ``"resident"`` or ``"parked"``; a bucket
    whose state is on the host leaves it where it is and uploads into it). Not: a tensor subclass or an all-gather
    extension, or a torch whose FSDP2 keeps shards otherwise (the optimizer then keeps a separate master and copies
    each update into the shard)."""
    data = getattr(record, "_sharded_param_data", None)
    size = getattr(record, "padded_sharded_param_size", None)
    local = getattr(p, "_local_tensor", None)
    if (getattr(record, "sharded_param", None) is not p or type(data) is not torch.Tensor
            or type(local) is not torch.Tensor or size is None or hasattr(local, "fsdp_pre_all_gather")):
        return None
    if (data.device != local.device or data.dtype != local.dtype or data.dim() != 1
            or data.numel() != torch.Size(size).numel() or not local.is_contiguous() or local.numel() > data.numel()
            or (local.numel() and local.data_ptr() != data.data_ptr())):
        return None
    return record


def takeover_numel(record: Any) -> int:
    """The elements FSDP keeps for the shard of :func:`takeover`'s record: the local shard and its padding rows."""
    return torch.Size(record.padded_sharded_param_size).numel()


def bind_shard(p: torch.Tensor, record: Any, room: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """Move the storage FSDP keeps for ``p``'s shard (``record``, see :func:`takeover`) into ``room``, a slot of the
    optimizer's flat buffer of :func:`takeover_numel` elements: the values (padding included) are copied there, FSDP's
    padded tensor becomes ``room`` and ``p``'s local shard its leading rows, as FSDP lays them out itself. Its
    all-gather then reads what the optimizer's kernel writes, and its lazy initialisation, seeing the same storage,
    keeps it (a pinned shard, ``CPUOffloadPolicy(pin_memory=True)``, needs ``room`` pinned: ``pinned``). Returns
    the new local shard (as :func:`local_shard`).

    ``room`` gets a storage of its own over its memory (:func:`~zero_offload._compat.own_storage`), so that the
    shard, and ``module.state_dict()``'s tensors derived from it, can be pickled and deep-copied as FSDP's own. Where
    CUDA would not count that storage as page-locked (FSDP would then re-pin the shard into a copy the optimizer
    does not write), the view of the flat buffer is kept. On a GPU, a tensor over the same memory made through DLPack
    (:func:`torch.utils.dlpack.from_dlpack`) is its storage of its own."""
    if room.device.type == "cpu":
        own = own_storage(room)
        room = own if not pinned or own.is_pinned() else room
    else:  # (a GPU's memory: the same, through DLPack, which keeps the flat buffer alive)
        room = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(room))
    room.copy_(record._sharded_param_data)
    local = p._local_tensor
    record._sharded_param_data = room
    p._local_tensor = room.view(record.padded_sharded_param_size).narrow(0, 0, local.size(0) if local.numel() else 0)
    return local_shard(p)


def local_ptrs(params: Sequence[torch.Tensor]) -> List[int]:
    """Where each DTensor's local shard is now: a shard the optimizer holds elsewhere was re-made by FSDP."""
    return [p._local_tensor.data_ptr() for p in params]


def takeover_ptrs(params: Sequence[torch.Tensor], records: Sequence[Any]) -> List[Tuple[int, int]]:
    """Where FSDP keeps each shard now (its padded tensor's and the local shard's addresses): compared with the
    addresses :func:`bind_shard` gave, a difference means FSDP re-made the storage (``model.to(...)``,
    ``load_state_dict(assign=True)``, a re-pin)."""
    return [(r._sharded_param_data.data_ptr(), p._local_tensor.data_ptr()) for p, r in zip(params, records)]


def wrap(view: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """A host view (shaped like the owner's local shard) as a DTensor placed like ``owner``: what ``opt.state``
    shows, and what DCP plans and writes into."""
    from torch.distributed.tensor import DTensor

    out = DTensor.from_local(view, owner.device_mesh, owner.placements, shape=owner.shape, stride=owner.stride(),
                             run_check=False)
    if out.storage_offset() == 0:
        return out
    # torch (2.13 here) gave it the view's storage offset, with which it could be neither pickled nor deep-copied
    # (see zero_offload._compat.own_storage); the same DTensor at offset 0, still over the view (which follows the
    # buffer when a load trades its memory).
    fixed = torch.Tensor._make_wrapper_subclass(DTensor, out.shape, strides=out.stride(), storage_offset=0,
                                                dtype=out.dtype, device=out.device, layout=out.layout,
                                                requires_grad=out.requires_grad)
    fixed._spec, fixed._local_tensor = out._spec, out._local_tensor
    return fixed

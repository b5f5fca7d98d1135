"""The host RAM an optimizer will take, planned before it is built (``OffloadOptimizer.estimate_host_memory(params,
**options)``): the same bucket layout and buffer declarations as the real buckets', allocating nothing; the options
taken once, as :class:`~zero_offload.options.Options`."""

from __future__ import annotations

import dataclasses
from numbers import Integral
from typing import Any, Dict, Iterable, Optional, Union

import torch

from zero_offload import buckets, fsdp2
from zero_offload.host_memory import HostMemoryEstimate
from zero_offload.options import DEFAULT_BUCKET_NUMEL, Options, check_state_dtype, gpu_params, planned_placement
from zero_offload.rules.adamw import ADAMW
from zero_offload.rules.base import Rule

__all__ = ["estimate_params", "plan_host_memory"]


def plan_host_memory(params: Iterable[Any], *, amsgrad: bool = False, bucket_numel: int = DEFAULT_BUCKET_NUMEL,
                     pin_memory: Optional[bool] = None, world_size: int = 1, delayed_update: bool = False,
                     state_dtype: torch.dtype = torch.float32, gpu_fraction: Union[float, str] = 0.0,
                     placement: Union[str, Dict[str, float], None] = None) -> HostMemoryEstimate:
    """Host RAM an ``OffloadOptimizer`` takes, in bytes by buffer.

    Two ways to ask, one name:

    * ``OffloadOptimizer.estimate_host_memory(params, **options)``, before constructing: what an optimizer over
      ``params`` with these options will allocate (exact: the same bucket layout), allocating nothing; meta
      tensors do as ``params``. The options are the constructor's; ``amsgrad`` is the default for groups that do
      not set it, ``world_size`` that of the ``process_group`` (the estimate is then per rank). FSDP2's
      parameters (DTensors) give this rank's buffers, from its local shards (``world_size`` is refused there).
    * ``opt.estimate_host_memory()``, on an optimizer: the buffers it holds now (per rank when sharded).

    Args:
        params (iterable): parameters or parameter groups, as for the constructor.
        amsgrad (bool): Default: False.
        bucket_numel (int): Default: 2**25.
        pin_memory (bool, optional): None: exactly the buckets on CUDA. Default: None.
        world_size (int): ranks of the ``process_group``. Default: 1.
        delayed_update (bool): Default: False.
        state_dtype (torch.dtype): Default: torch.float32.
        placement (str or dict): each home's share (see the constructor): a resident bucket holds no host RAM, a
            parked one its state only (the rule's buffers, and the fp32 master of bf16/fp16 parameters);
            ``"auto"`` (decided after the first step) counts every bucket on the host: an upper bound.
            Default: None, the constructor's default as it settles for these options (``"auto"``, or ``"host"``
            where ``"auto"`` cannot run): estimated alike, every bucket on the host.
        gpu_fraction (float or str): the buckets a number keeps on the GPU are not counted; ``"auto"`` (decided
            after the first step) counts every bucket: an upper bound. Default: 0.

    Returns:
        HostMemoryEstimate: bytes by buffer, ``total_bytes``, ``bytes_per_param``, ``pinned_bytes``; ``homes``:
        per home (``"host"``, ``"parked"``, ``"resident"``) its host RAM, GPU memory, bytes copied each way and
        kernel elements per step (:class:`~zero_offload.home_costs.HomeCost`, whose ``seconds(rates)`` predicts
        their time).

    Raises:
        ValueError: an option or a combination the constructor refuses (its very error: a ``bucket_numel`` that is
            not a positive int, ``delayed_update`` with a GPU ``placement`` or with ``world_size`` > 1...; not
            ``pin_memory=True`` without CUDA, as the plan may be for another machine); a ``world_size`` that is not
            a whole number >= 1; ``world_size`` with FSDP2's parameters.
        TypeError: FSDP2's parameters mixed with plain ones, or placed otherwise (the constructor's error); a removed
            option such as ``speculation_memory`` (the constructor's error).
    """
    check_state_dtype(state_dtype)
    if isinstance(world_size, bool) or not isinstance(world_size, Integral) or world_size < 1:
        raise ValueError(f"Invalid world_size: {world_size!r} (the process_group's number of ranks, a whole number "
                         ">= 1)")
    params = list(params)
    placement = planned_placement(placement, gpu_params(params), state_dtype=state_dtype, gpu_fraction=gpu_fraction,
                                  delayed_update=delayed_update)
    options = Options(bucket_numel=bucket_numel, pin_memory=pin_memory, delayed_update=delayed_update,
                      state_dtype=state_dtype, gpu_fraction=gpu_fraction, placement=placement,
                      sharded=world_size > 1)
    # (the constructor's checks, but pin_memory's need for CUDA: a plan may be made on another machine)
    dataclasses.replace(options, pin_memory=None).validate()
    return estimate_params(params, options, int(world_size), defaults={"amsgrad": amsgrad})


def estimate_params(params: Iterable[Any], options: Options, world_size: int = 1, *,
                    defaults: Optional[Dict[str, Any]] = None, rule: Rule = ADAMW) -> HostMemoryEstimate:
    """:func:`~zero_offload.buckets.estimate_layouts` of the buckets an optimizer over ``params`` (tensors or group
    dicts, whose own settings are honoured over ``defaults``) with ``options`` would plan, in the homes their
    ``placement`` (or ``gpu_fraction``) gives them (a resident bucket holds no host bytes, a parked one its state);
    see ``OffloadOptimizer.estimate_host_memory``. FSDP2's parameters
    (DTensors) are placed as their topology places them (this rank's local shards, cut at FSDP's units)."""
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    groups = [(g, [g["params"]] if isinstance(g["params"], torch.Tensor) else
               [p[1] if isinstance(p, tuple) else p for p in g["params"]]) for g in groups]
    mesh = None
    if any(fsdp2.is_dtensor(p) for _, ps in groups for p in ps):
        if world_size != 1:
            raise ValueError(f"OffloadOptimizer.estimate_host_memory: world_size={world_size} with FSDP2's sharded "
                             "parameters (DTensors): their estimate is per rank already, from this rank's local "
                             "shards (world_size is the process_group's, for plain parameters)")
        from zero_offload.topology.mesh import Mesh

        mesh = Mesh()
    total = HostMemoryEstimate(0, 0, {}, 0, 0)
    for g, ps in groups:
        settings = {**(defaults or {}), **{k: v for k, v in g.items() if k != "params"}}
        takeovers = None
        if mesh is not None:
            placed = mesh.plan(ps)
            layouts = buckets.plan_local(placed.data, options.bucket_numel, placed.units, placed.takeovers)
            takeovers = placed.takeovers
        else:
            layouts = buckets.plan_buckets(ps, options.bucket_numel)  # (as the constructor does: through the module)
        total = total + buckets.estimate_layouts(layouts, rule.buffers_for(settings), options, world_size, rule,
                                                 takeovers, buckets.home_plan(layouts, options))
    return total

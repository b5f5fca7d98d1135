"""The host RAM an optimizer will take, planned before it is built (``OffloadOptimizer.estimate_host_memory(params,
**options)``): the same bucket layout and buffer declarations as the real buckets', allocating nothing."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch

from zero_offload.buckets import estimate_params
from zero_offload.host_memory import HostMemoryEstimate
from zero_offload.options import DEFAULT_BUCKET_NUMEL, Options, check_speculation_memory, check_state_dtype
from zero_offload.undo import plan_undo

__all__ = ["plan_host_memory"]


def plan_host_memory(params: Iterable[Any], *, amsgrad: bool = False, bucket_numel: int = DEFAULT_BUCKET_NUMEL,
                     pin_memory: Optional[bool] = None, world_size: int = 1, delayed_update: bool = False,
                     state_dtype: torch.dtype = torch.float32, gpu_fraction: Union[float, str] = 0.0,
                     speculation_memory: Optional[int] = None
                     ) -> HostMemoryEstimate:
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
        gpu_fraction (float or str): the buckets a number keeps on the GPU are not counted; ``"auto"`` (decided
            after the first step) counts every bucket: an upper bound. Default: 0.
        speculation_memory (int, optional): given, the plan has an ``undo`` row: the bytes speculation's undo pool
            may hold, the cap or, where less, every GPU bucket speculated at once (master, state and, for bf16/fp16
            parameters, their output: about 12 B/param with fp32 state, 14 B with bf16 parameters, 8 B with bf16
            state). None (the constructor's default): no row; the pool is then sized to what speculation uses
            during backward, learned in the first steps (on the 1.3B GPT preset about a third of that worst case),
            and ``opt.estimate_host_memory()`` shows what it holds. Not with ``world_size > 1`` or
            ``delayed_update``, where speculation is off. Default: None.

    Returns:
        HostMemoryEstimate: bytes by buffer, ``total_bytes``, ``bytes_per_param``, ``pinned_bytes``.

    Raises:
        ValueError: a ``state_dtype`` or ``speculation_memory`` the constructor refuses (its very error);
            ``world_size`` with FSDP2's parameters.
        TypeError: FSDP2's parameters mixed with plain ones, or placed otherwise (the constructor's error).
    """
    check_state_dtype(state_dtype)
    Options(state_dtype=state_dtype, gpu_fraction=gpu_fraction)._check_gpu_tier()  # the constructor's checks
    memory = check_speculation_memory(speculation_memory)
    params = list(params)
    options = dict(bucket_numel=bucket_numel, pin_memory=pin_memory, state_dtype=state_dtype,
                   gpu_fraction=gpu_fraction)
    estimate = estimate_params(params, defaults={"amsgrad": amsgrad}, world_size=world_size,
                               delayed_update=delayed_update, **options)
    if memory and world_size == 1 and not delayed_update:
        estimate = estimate + plan_undo(params, memory, defaults={"amsgrad": amsgrad}, **options)
    return estimate

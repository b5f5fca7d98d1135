"""What each home (``placement``: docs/placement.md) costs, by the arithmetic of its buffers: the host RAM and the GPU
memory its buckets hold, the bytes that cross PCIe each way per step and the elements the CPU kernel steps per step;
and, from the cost model's rates (:class:`~zero_offload.cost_model.Rates`), the time those take. The figures come
from the same bucket layout and buffer declarations as the allocation (``estimate_host_memory``, the planner); the
times are predictions.

Per step, a bucket on a GPU whose state lives

* on the **host**: its gradients come down and its updated parameters go up (the parameters' bytes each way: 4 B a
  parameter for fp32, 2 for bf16/fp16; sharded over a ``process_group``, the rank's shard), and the CPU kernel steps
  it; its state takes no GPU memory;
* **parked**: its state (the rule's buffers, and the fp32 master of bf16/fp16 parameters) goes up in backward and
  down after the update: 8 B + 8 B a parameter for fp32 AdamW, 12 + 12 for bf16/fp16; the GPU holds that state from
  its reload to its write-back only;
* **resident**: nothing crosses; the GPU holds its state always (8 B a parameter, 12 for bf16/fp16).

Sharded over a ``process_group``, a parked or resident bucket also holds, on the GPU, the rank's shard of the reduced
gradients (the parameters' bytes of the shard: 4 B a shard element for fp32, 2 for bf16/fp16) from its first
reduce-scatter of a step to the step's end; the full buffer the reduce-scatter reads is transient (made when the
bucket's gradients are complete, on the collective stream, let go once the reduce-scatter is issued: one at a time,
its block kept by the allocator for that stream's next) and not counted, as the host route's (on its copy stream)
is not.

Under FSDP2 on a GPU, a parked or resident bucket takes over the storage FSDP keeps for its shards, as a parameter on
one GPU is bound to its slot: the same figures as one GPU's, per rank. Where it cannot (``copied``: a shard FSDP keeps
as a tensor subclass, say, see :func:`zero_offload.fsdp2.takeover`), the update is copied into the shard: an fp32 shard
has an fp32 master of its own, 4 B a parameter more (parked: on the host, and across PCIe each way; resident: on the
GPU): 12 B for fp32 as for bf16/fp16; and a bf16/fp16 shard a staging copy on the GPU, 2 B a parameter, held always.

State buffers count their alignment padding (they are allocated padded); gradients and parameters their elements. A
bucket of CPU parameters is stepped on the host and crosses nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping

import torch

__all__ = ["HOMES", "HomeCost", "bucket_cost"]

HOMES = ("host", "parked", "resident")


@dataclasses.dataclass(frozen=True)
class HomeCost:
    """One home's buckets, summed (see the module docstring).

    Attributes:
        buckets (int): how many.
        numel (int): their parameters (per rank: the rank's shards' where sharded).
        host_bytes (int): host RAM they hold (the estimate's buffers for them).
        gpu_bytes (int): GPU memory their state takes beyond the parameters' and gradients': a resident bucket's
            always, a parked one's from its reload to its write-back (the most a step holds at once, were every
            parked bucket up together; under FSDP2, where a bf16/fp16 shard is not taken over, with its staging
            copy, which it holds always); sharded, with the rank's shard of the reduced gradients, held through the
            step.
        up_bytes (int): bytes copied host to GPU per step (parameters, or a parked bucket's state).
        down_bytes (int): bytes copied GPU to host per step (gradients, or a parked bucket's state).
        kernel_numel (int): elements the CPU kernel steps per step.
    """

    buckets: int = 0
    numel: int = 0
    host_bytes: int = 0
    gpu_bytes: int = 0
    up_bytes: int = 0
    down_bytes: int = 0
    kernel_numel: int = 0

    def __add__(self, other: "HomeCost") -> "HomeCost":
        return HomeCost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def times(self, k: int) -> "HomeCost":
        """``k`` of these."""
        return HomeCost(*(k * a for a in dataclasses.astuple(self)))

    def seconds(self, rates: Any) -> Dict[str, float]:
        """Predicted seconds per step, by ``rates`` (a :class:`~zero_offload.cost_model.Rates`): ``"kernel"``, the
        CPU kernel's (elements at ``rates.kernel`` a second); ``"up"`` and ``"down"``, the copies' (at
        ``rates.upload`` and ``rates.download`` bytes a second). Each alone: how they overlap with backward and one
        another is the cost model's business."""
        return {"kernel": self.kernel_numel / rates.kernel, "up": self.up_bytes / rates.upload,
                "down": self.down_bytes / rates.download}


def bucket_cost(home: str, numel: int, padded_numel: int, dtype: torch.dtype, *, on_cpu: bool,
                state: Mapping[str, int], world_size: int = 1, host_bytes: int = 0, copied: bool = False) -> HomeCost:
    """One bucket's :class:`HomeCost` in ``home``: ``numel`` parameters of ``dtype`` laid out in ``padded_numel``
    elements (the full padded length where sharded over ``world_size`` ranks, each holding ``padded_numel /
    world_size``), ``state`` the rule's buffers' bytes (the rank's shard), ``host_bytes`` what its estimate holds
    on the host. ``copied``: its parameters are FSDP2's local shards whose storage the home could not take over (see
    the module docstring)."""
    shard = padded_numel // world_size
    moved = numel if world_size == 1 else shard  # (elements of gradients and parameters that cross, per rank)
    if home == "host":
        crossing = 0 if on_cpu else moved * dtype.itemsize
        return HomeCost(1, moved, host_bytes, 0, crossing, crossing, moved)
    copied = copied and not on_cpu
    held = sum(state.values()) + (4 * shard if dtype != torch.float32 or copied else 0)  # (a separate fp32 master)
    staging = shard * dtype.itemsize if copied and dtype != torch.float32 else 0  # (on the GPU, beside the shard)
    grads = shard * dtype.itemsize if world_size > 1 else 0  # (the rank's shard of the reduced gradients)
    if home == "parked":
        return HomeCost(1, moved, host_bytes, held + staging + grads, held, held, 0)
    if home != "resident":
        raise ValueError(f"Invalid home: {home!r} (one of {', '.join(HOMES)})")
    return HomeCost(1, moved, 0, held + staging + grads, 0, 0, 0)

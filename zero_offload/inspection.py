"""What an :class:`~zero_offload.OffloadOptimizer` tells about itself, beyond ``torch.optim``'s conventions, as a base
class of it: the host RAM it holds or would take (``estimate_host_memory``), its buffers, the GPU memory of its
device tier, and a timeline of its steps."""

from __future__ import annotations

import functools
import warnings
from itertools import chain
from typing import Any, Dict, List

import torch

from zero_offload.host_memory import HostMemoryEstimate, PlanOrMeasure
from zero_offload.lane import Plans
from zero_offload.options import check_removed
from zero_offload.placement import device_bytes
from zero_offload.planning import plan_host_memory
from zero_offload.timeline import Timeline, TimelineEvent

__all__ = ["GradlessSteps", "InspectionMethods"]


class GradlessSteps:
    """Counts the ``step()`` calls in which none of the optimizer's parameters had a gradient, while none ever had
    one; at the :attr:`WARN_AFTER`-th, one warning names the likely causes: the optimizer is over parameters that
    the model does not train (AdamW steps nothing, silently, too)."""

    WARN_AFTER = 3
    __slots__ = ("count",)

    def __init__(self):
        self.count = 0  # -1: a gradient was seen, or the warning given

    def see(self, plans: Plans) -> None:
        if self.count < 0:
            return
        if any(any(intake.present) for intakes in plans for intake in intakes):
            self.count = -1
            return
        self.count += 1
        if self.count == self.WARN_AFTER:
            self.count = -1
            n = sum(len(intake.present) for intakes in plans for intake in intakes)
            warnings.warn(
                f"OffloadOptimizer: step() was called {self.WARN_AFTER} times and none of its {n} parameters has "
                "ever had a gradient: it is not over the parameters the model trains. Was it built before "
                "fully_shard or parallelize_module (FSDP2 and tensor parallelism replace the model's parameters: build "
                "the optimizer after both, or switch each param group's params to the new ones), or over another "
                "copy of the model (copy.deepcopy, a model re-created or loaded with assign=True after the optimizer "
                "was built, model.to() or another module conversion that made new Parameter objects: onto the meta "
                "device, or under torch.__future__.set_overwrite_module_params_on_conversion(True))? Or are all its "
                "parameters frozen (requires_grad=False)?", UserWarning, stacklevel=6)


@functools.wraps(plan_host_memory)
def _plan(params: Any, **options: Any) -> HostMemoryEstimate:
    """:func:`~zero_offload.planning.plan_host_memory`, after the constructor's check for removed options."""
    check_removed(options, "OffloadOptimizer.estimate_host_memory")
    return plan_host_memory(params, **options)


def _held_host_memory(opt: Any) -> HostMemoryEstimate:
    """The host RAM ``opt`` holds: its buckets'."""
    return sum((b.estimate() for b in chain.from_iterable(opt._buckets)), HostMemoryEstimate(0, 0, {}, 0, 0))


class InspectionMethods:
    """The inspection methods of an :class:`~zero_offload.OffloadOptimizer` (see the module docstring)."""

    estimate_host_memory = PlanOrMeasure(_plan, _held_host_memory)

    def host_memory_estimate(self) -> HostMemoryEstimate:
        """Deprecated: ``opt.estimate_host_memory()`` (the same result, under the one documented name)."""
        warnings.warn("OffloadOptimizer.host_memory_estimate() is deprecated and will be removed: call "
                      "opt.estimate_host_memory() (same result)", FutureWarning, stacklevel=2)
        return _held_host_memory(self)

    def host_buffers(self) -> List[Dict[str, torch.Tensor]]:
        """The flat buffers of every bucket (name -> tensor), for inspection and measurement (a device-tier
        bucket's, ``gpu_fraction``, are on its GPU; a parked bucket's host buffers, once its state has landed)."""
        self._settle_homes()
        return [bucket.buffers() for bucket in chain.from_iterable(self._buckets)]

    def gpu_state_bytes(self) -> Dict[str, int]:
        """GPU memory held by the state on the device tier (``gpu_fraction``), in bytes by buffer, beyond the
        parameters' own (summed over its buckets; empty without a device tier; a parked bucket's only while its
        state is up, and, sharded, its shard of the reduced gradients through the step:
        :meth:`~zero_offload.buckets.FlatBucket.device_bytes`)."""
        return device_bytes(self._transport.lanes)

    def record_timeline(self, enabled: bool = True) -> None:
        """Start (or with ``enabled=False`` stop) recording a :class:`~zero_offload.timeline.Timeline` of the
        steps: host waits, kernels and copies issued, by the host clock. Costs a
        few microseconds per bucket per step while on; nothing while off. See :meth:`timeline`."""
        t = self._transport
        t.timeline = (t.timeline if t.timeline is not None else Timeline()) if enabled else None

    def timeline(self) -> List[TimelineEvent]:
        """The events recorded since :meth:`record_timeline` or the last call, by start time (and forgets them).
        ``zero_offload.timeline.breakdown`` sums them per kind; ``chrome_trace`` writes a Chrome trace."""
        tl = self._transport.timeline
        return [] if tl is None else tl.take()

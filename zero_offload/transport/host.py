"""The route of buckets whose state lives with their parameters: parameters on the host (a CPU model, whose
parameters are views of the master slots, so the kernel's writes are the update) and, on a GPU, the device tier
(``gpu_fraction``: :class:`~zero_offload.transport.device.DeviceTierRoute`). No bytes cross between device and
host: gradients are read where autograd left them whenever the kernel can read them there."""

from __future__ import annotations

import operator
from itertools import repeat
from typing import List, Optional, Sequence

import torch

from zero_offload._checks import CheckedGrads
from zero_offload._compat import increment_version
from zero_offload.host_memory import copy_many_
from zero_offload.lane import Intake, Lane
from zero_offload.transport.base import Route

__all__ = ["HostRoute"]


class HostRoute(Route):
    """Parameters on the host, the state beside them (see the module docstring)."""

    resident = True
    upload_reads = False  # (the kernel writes the parameters' storage: upload bumps versions only)

    def bind(self, lane: Lane) -> None:
        """Make CPU parameters views of their slots (see :meth:`~zero_offload.state.home.Home.bind`)."""
        lane.bucket.home.fill_param_slots()
        lane.bucket.home.bind()

    def send(self, lane: Lane, idx: List[int], grads: List[torch.Tensor], add: List[bool]) -> None:
        """Streamed CPU gradients (``stream_grads=True``): copied (or summed) into their slots now."""
        views, numels = lane.bucket.grads.grad_views, lane.bucket.layout.numels
        copy = [k for k, a in enumerate(add) if not a]
        if copy:
            copy_many_([views[idx[k]] for k in copy], [grads[k] for k in copy], [numels[idx[k]] for k in copy])
        summed = [k for k, a in enumerate(add) if a]
        if summed:
            torch._foreach_add_([views[idx[k]] for k in summed], [grads[k] for k in summed])

    def gather(self, intake: Intake) -> Intake:
        """The gradients for the kernel: ``in_place`` None when the flat buffer holds every one (each is its slot,
        or absent); otherwise the tensors the kernel reads in place (see :meth:`_in_place`). Streamed buckets copy
        into the buffer, where the streamed gradients already are."""
        bucket, pending = intake.bucket, intake.pending
        if not bucket.grads.allocated:  # a device-tier bucket whose gradients are all read where they are
            if any(g is not None for g in pending):
                return intake.but(in_place=self._in_place(intake))
            return intake
        views = bucket.grads.grad_views
        if all(map(operator.is_, pending, views)):
            # The zero_grad(set_to_none=False) steady state: backward accumulated into the slots already.
            bucket.grads.all_filled()
            return intake
        if not intake.lane.streamed and any(g is not None and g is not v for g, v in zip(pending, views)):
            return intake.but(in_place=self._in_place(intake))
        dsts, srcs = self._slot_copies(intake)
        if dsts:
            copy_many_(dsts, srcs, [d.numel() for d in dsts])
        return intake

    @staticmethod
    def _in_place(intake: Intake) -> List[Optional[torch.Tensor]]:
        """Each gradient where the kernel can read it: itself where it is contiguous like its slot, else the
        slot's flat range after a copy into it (a channels-last or transposed gradient). Copying fresh gradients
        into the buffer first would add 8 bytes of memory traffic per element to the update's 28. Returned as
        checked: they passed ``collect_grads`` (dense, the parameter's shape), are contiguous, and autograd gives a
        CPU parameter's gradient its dtype and device."""
        bucket, grads = intake.bucket, intake.pending
        slots = bucket.grads
        offsets, numels = bucket.layout.offsets, bucket.layout.numels
        # (A device-tier bucket's buffer may not exist: then no gradient is its slot.)
        views = slots.grad_views if slots.allocated else [None] * len(grads)
        # The usual case, checked in C-level loops: every gradient fresh, present and contiguous like its slot.
        if (slots.all_slots_contiguous and not any(map(operator.is_, grads, repeat(None)))
                and not any(map(operator.is_, grads, views)) and all(map(torch.Tensor.is_contiguous, grads))):
            return CheckedGrads(grads)
        out: List[Optional[torch.Tensor]] = []
        dsts, srcs, sizes = [], [], []
        for i, g in enumerate(grads):
            if g is None:
                out.append(None)
            elif g is not views[i] and slots.slot_contiguous[i] and g.is_contiguous():
                out.append(g)
            else:
                # The state's slots have the parameter's memory order; a gradient in any other order (or already
                # in its slot) is read from the slot, whose flat range is in that order.
                flat, views = slots.grad, slots.grad_views
                if g is not views[i]:
                    dsts.append(views[i])
                    srcs.append(g)
                    sizes.append(numels[i])
                slots.filled(i)
                out.append(flat[offsets[i] : offsets[i] + numels[i]])
        if dsts:
            copy_many_(dsts, srcs, sizes)
        return CheckedGrads(out)

    def upload(self, lane: Lane, indices: Sequence[int], srcs: Optional[Sequence[torch.Tensor]]) -> None:
        """The kernel already wrote the parameters' storage: only the autograd version bump an in-place op would
        have made (so a stale saved tensor is still caught)."""
        params = lane.bucket.params
        increment_version(params if len(indices) == len(params) else [params[i] for i in indices])

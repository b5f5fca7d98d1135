"""One bucket's update by its rule: a :class:`~zero_offload.rules.base.Run` per run of slots (parameters with a
gradient and the same step count), on the bucket's buffers or on copies of them. Nothing here waits for a
transfer, sends anything or touches ``opt.state``: the schedules (:mod:`zero_offload.update`) do, around it."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from zero_offload._checks import CheckedGrads
from zero_offload.buckets import FlatBucket
from zero_offload.rules.base import Run, Slots
from zero_offload.state.home import Copies

__all__ = ["Copies", "RunSpec", "is_whole", "run_rule", "touched"]

RunSpec = Tuple[int, int, int]  # (first, last, step count before the update): see FlatBucket.runs


def is_whole(bucket: FlatBucket, runs: Sequence[RunSpec]) -> bool:
    """Whether ``runs`` is one run over the whole bucket (the usual case)."""
    return len(runs) == 1 and runs[0][0] == 0 and runs[0][1] == len(bucket.params) - 1


def touched(bucket: FlatBucket, runs: Sequence[RunSpec]) -> Sequence[int]:
    """The parameters ``runs`` update."""
    if is_whole(bucket, runs):
        return range(len(bucket.params))
    return [i for first, last, _ in runs for i in range(first, last + 1)]


def run_rule(bucket: FlatBucket, runs: Sequence[RunSpec], grad: Optional[torch.Tensor],
             in_place: Optional[List[Optional[torch.Tensor]]], hyper, multiplier: float,
             copies: Optional[Copies] = None) -> None:
    """The rule's update of each run, reading the gradients from ``grad`` (flat, the bucket's layout; None: the
    bucket's gradient buffer) or ``in_place`` (per parameter, where they are), on the bucket's buffers or
    ``copies``, run where the bucket's home steps it (:meth:`~zero_offload.state.home.Home.update`). A run starts
    on a slot, so it owns whole scale blocks of 8-bit state."""
    rule, layout, home = bucket.rule, bucket.layout, bucket.home
    if grad is None and in_place is None:
        grad = bucket.grad
    staging = None if copies is None else copies[0].get("staging")
    grad_scale = multiplier * bucket.grad_multiplier
    whole = is_whole(bucket, runs)
    dry = copies is not None  # a preview (saving the state a pending update will leave): nothing kept changes
    # (per-parameter views the home keeps, for a rule whose device update reads them: not cut again every step)
    cut = rule.device_views and home.on_device and in_place is not None and not dry
    for index, (first, last, step) in enumerate(runs):
        a, b = (0, layout.padded_numel) if whole else layout.span(first, last)
        master, state, scales = home.run_buffers(a, b, copies)
        shaped = home.run_shaped(first, last, copies)
        param_out = bucket.param_out(grad, a, b) if copies is None else (None if staging is None else staging[a:b])
        slots = Slots(bucket, bucket.group, bucket.steps, index, len(runs), dry, bucket.shapes[first : last + 1],
                      layout.offsets[first : last + 1])
        if in_place is None:
            run = Run(master, grad[a:b], None, (), state, scales, step + 1, grad_scale, param_out, slots=slots,
                      shaped=shaped)
        else:
            grads = in_place if whole else CheckedGrads(in_place[first : last + 1])  # checked whole
            offsets = [o - a for o in layout.offsets[first : last + 1]]
            run = Run(master, None, grads, offsets, state, scales, step + 1, grad_scale, param_out, slots=slots,
                      shaped=shaped, views=home.run_views(first, last) if cut else None)
        home.update(rule, run, hyper)


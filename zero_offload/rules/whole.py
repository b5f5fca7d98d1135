"""A class's own code over whole parameters, on the GPU: how a bucket stepped there (parked or resident) runs an
``offload(cls)`` optimizer. The generic rule (:mod:`zero_offload.rules.torch_class`) hands the class's instance one
parameter per slot of the run, each a view of the bucket's flat device buffers shaped as the parameter
(:func:`pieces`), so a class that is not elementwise (Muon's orthogonalisation, a per-tensor trust ratio) steps as it
steps the model's own parameters; an elementwise one steps with its own GPU code rather than over flat runs.

Such a class is accepted only for buckets stepped on a GPU, after :func:`probe_whole`: its per-parameter state must be
tensors shaped like the parameter, besides a step count (anything else is refused, naming it: Adafactor's factored
``row_var`` and ``col_var``, a per-parameter scalar), and its update of one parameter must not depend on others (the
cross-parameter pass of :mod:`zero_offload.rules.probe`: a class that needs the whole model at once is refused).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence, Tuple

from zero_offload.rules.base import Run
from zero_offload.rules.probe import NotElementwise, Probed, independent, kinds, loss_use

__all__ = ["pieces", "probe_whole", "stand_in_shapes"]

# One small shape per number of dimensions: the probe's stand-ins for the model's parameters (odd sizes, so a class
# that mixes rows and columns up shows it).
_STAND_INS = {0: (), 1: (7,), 2: (4, 6), 3: (3, 2, 5), 4: (2, 3, 2, 3)}


def stand_in_shapes(ndims: Sequence[int]) -> List[Tuple[int, ...]]:
    """A probe's parameter shape for each of ``ndims`` (the numbers of dimensions of the parameters given)."""
    return [_STAND_INS.get(d, (2,) * d) for d in ndims]


def probe_whole(cls: type, ctor: Dict[str, Any], group: Dict[str, Any], ndims: Tuple[int, ...]) -> Probed:
    """What ``cls`` keeps per parameter, stepped whole over stand-ins of ``ndims`` dimensions, and whether it can be
    run one bucket at a time (see the module docstring). Raises :class:`~zero_offload.rules.settings.Refused` (its
    subclass :class:`~zero_offload.rules.probe.NotElementwise` for state not shaped like the parameter)."""
    shapes = stand_in_shapes(ndims)
    try:
        found = kinds(cls, ctor, group, shapes=shapes)
    except NotElementwise as e:
        raise NotElementwise(f"{cls.__name__}'s per-parameter state is not what a parked bucket holds, tensors shaped "
                             f"like the parameter (a step count aside): {str(e).split(': ', 1)[-1]}") from e
    cross = ((shapes[0], shapes[-1]), (shapes[0],))
    independent(cls, ctor, group, cross=cross)
    return dataclasses.replace(found, uses_loss=loss_use(cls, ctor, group, shape=shapes[0]), whole=tuple(ndims))


def pieces(run: Run) -> List[Run]:
    """``run`` (on the GPU) cut into one run per parameter: its master, gradient, state and low-precision output as
    views shaped as the parameter (no byte copied; the padding between slots left out), each told its one shape."""
    slots = run.slots
    if slots is None or not slots.shapes:
        raise RuntimeError("a run stepped whole needs its parameters' shapes and offsets (Slots.shapes)")
    base = slots.offsets[0]
    out = []
    for i, shape in enumerate(slots.shapes):
        o = slots.offsets[i] - base
        n = shape.numel()
        if run.grads is None:
            grad = run.grad[o:o + n].view(shape)
        else:
            grad = run.grads[i]
            if grad is None:
                continue
            grad = grad.view(shape)
        out.append(dataclasses.replace(
            run, master=run.master[o:o + n].view(shape), grad=grad, grads=None, offsets=(),
            state={k: v[o:o + n].view(shape) for k, v in run.state.items()},
            param_out=None if run.param_out is None else run.param_out[o:o + n].view(shape),
            slots=dataclasses.replace(slots, shapes=(shape,), offsets=(slots.offsets[i],))))
    return out


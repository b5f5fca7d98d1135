"""A class's own code over whole parameters, on the GPU: how a bucket stepped there (parked or resident) runs an
``offload(cls)`` optimizer. The generic rule (:mod:`zero_offload.rules.torch_class`) hands the class's instance one
parameter per slot of the run, each a view of the bucket's flat device buffers shaped as the parameter
(:func:`pieces`), so a class that is not elementwise (Muon's orthogonalisation, a per-tensor trust ratio) steps as it
steps the model's own parameters; an elementwise one steps with its own GPU code rather than over flat runs.

Such a class is accepted only for buckets stepped on a GPU, after :func:`probe_whole`: its per-parameter state must be
tensors, besides a step count, each of a fixed shape that follows from its parameter's (each dimension the
parameter's or 1, the same from step to step, found on stand-ins of two sizes for each number of dimensions), and
each parameter's own (no tensor shared by parameters); a tensor shaped like the parameter for every number of
dimensions is a slot of the bucket's per-element buffers, any other (Adafactor's factored ``row_var`` and
``col_var`` of a matrix, its ``variance`` of a vector) a slot of the bucket's shaped buffer
(:mod:`zero_offload.state.shaped`). Anything else is refused, naming it: a per-parameter scalar, a Python list, a
shape that changes between steps or is not derived from the parameter's. Its update of one parameter must not
depend on others (the cross-parameter pass of :mod:`zero_offload.rules.probe`: a class that needs the whole model at
once is refused).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload.rules.base import Run, Slots, StateShape
from zero_offload.rules.probe import NotElementwise, Probed, independent, kinds, loss_use

__all__ = ["check_kept", "pieces", "probe_whole", "stand_in_shapes", "whole_kinds"]

# One small shape per number of dimensions: the probe's stand-ins for the model's parameters (odd sizes, so a class
# that mixes rows and columns up shows it).
_STAND_INS = {0: (), 1: (7,), 2: (4, 6), 3: (3, 2, 5), 4: (2, 3, 2, 3)}
# A second set, every dimension of another size (none 1), tells a state shape that follows the parameter's from one
# that only matched it.
_OTHER_STAND_INS = {0: (), 1: (9,), 2: (5, 3), 3: (4, 3, 2), 4: (3, 2, 3, 2)}


def stand_in_shapes(ndims: Sequence[int], other: bool = False) -> List[Tuple[int, ...]]:
    """A probe's parameter shape for each of ``ndims`` (the numbers of dimensions of the parameters given); with
    ``other``, of the second set."""
    return [(_OTHER_STAND_INS if other else _STAND_INS).get(d, (3 if other else 2,) * d) for d in ndims]


def _kept(state: torch.Size, param: torch.Size) -> Optional[Tuple[bool, ...]]:
    """Which of ``param``'s dimensions ``state`` keeps (the others are 1), or None where it is not so derived."""
    if len(state) != len(param) or any(s not in (p, 1) for s, p in zip(state, param)):
        return None
    return tuple(s == p for s, p in zip(state, param))


def whole_kinds(name: str, opt: Any, params: List[torch.Tensor]) -> Tuple[Any, ...]:
    """The kinds pass's reading of a class stepped whole (see :func:`~zero_offload.rules.probe.kinds`): its buffers,
    step key, whether the step is a tensor, the shapes of the buffers not shaped like the parameter for every
    number of dimensions, and each tensor's shape (by key and parameter shape). Raises :class:`NotElementwise`
    naming an entry a parked bucket cannot hold."""
    step_key, step_is_tensor = None, False
    found: Dict[str, Dict[int, Tuple[bool, ...]]] = {}
    seen: Dict[Tuple[str, Tuple[int, ...]], Tuple[int, ...]] = {}
    owners: Dict[int, int] = {}
    for pi, p in enumerate(params):
        for key, value in opt.state[p].items():
            if key == "step" and (isinstance(value, (int, float)) or
                                  (isinstance(value, torch.Tensor) and value.numel() == 1)):
                step_key, step_is_tensor = key, isinstance(value, torch.Tensor)
                continue
            where = f"its state {key!r} of a parameter of shape {tuple(p.shape)}"
            if not isinstance(value, torch.Tensor):
                raise NotElementwise(f"{name} keeps {where} as a {type(value).__name__}: a parked bucket holds "
                                     "tensors")
            seen[(key, tuple(p.shape))] = tuple(value.shape)
            if value.dim() == 0 and p.dim() != 0:
                raise NotElementwise(f"{name} keeps a per-parameter scalar {key!r} besides the step count")
            kept = _kept(value.shape, p.shape)
            if kept is None:
                raise NotElementwise(f"{name}'s state {key!r} has shape {tuple(value.shape)} for a parameter of "
                                     f"shape {tuple(p.shape)}: not the parameter's shape with some dimensions 1")
            memory = value.untyped_storage().data_ptr()
            if owners.setdefault(memory, pi) != pi:
                raise NotElementwise(f"{name} shares {where} with another parameter's state: a parked bucket holds "
                                     "each parameter's own tensors")
            if found.setdefault(key, {}).setdefault(p.dim(), kept) != kept:
                raise NotElementwise(f"{name}'s state {key!r} has shape {tuple(value.shape)} for a parameter of "
                                     f"shape {tuple(p.shape)}, unlike another of {p.dim()} dimensions")
    ndims = sorted({p.dim() for p in params})
    shapes = tuple((key, StateShape(tuple((d, by.get(d)) for d in ndims))) for key, by in found.items()
                   if any(by.get(d) != (True,) * d for d in ndims))
    return tuple(found), step_key, step_is_tensor, shapes, seen


def probe_whole(cls: type, ctor: Dict[str, Any], group: Dict[str, Any], ndims: Tuple[int, ...]) -> Probed:
    """What ``cls`` keeps per parameter, stepped whole over stand-ins of ``ndims`` dimensions, and whether it can be
    run one bucket at a time (see the module docstring). Raises :class:`~zero_offload.rules.settings.Refused` (its
    subclass :class:`~zero_offload.rules.probe.NotElementwise` for state not shaped like the parameter)."""
    shapes, other = stand_in_shapes(ndims), stand_in_shapes(ndims, other=True)
    try:
        found = kinds(cls, ctor, group, shapes=shapes, classify=whole_kinds)
        again = kinds(cls, ctor, group, shapes=other, classify=whole_kinds)
    except NotElementwise as e:
        raise NotElementwise(f"{cls.__name__}'s per-parameter state is not what a parked bucket holds, tensors of a "
                             "fixed shape derived from the parameter's (a step count aside): "
                             f"{str(e).replace(f'{cls.__name__} is not elementwise: ', '')}") from e
    if (again.buffers, again.shapes) != (found.buffers, found.shapes):
        raise NotElementwise(f"{cls.__name__}'s per-parameter state is not what a parked bucket holds: its shapes do "
                             f"not follow the parameters' (over parameters of shapes {shapes} it keeps "
                             f"{dict(found.shapes)}, over {other} {dict(again.shapes)})")
    cross = ((shapes[0], shapes[-1]), (shapes[0],))
    independent(cls, ctor, group, cross=cross)
    return dataclasses.replace(found, uses_loss=loss_use(cls, ctor, group, shape=shapes[0]), whole=tuple(ndims))


def pieces(run: Run) -> List[Run]:
    """``run`` (on the GPU) cut into one run per parameter: its master, gradient, state and low-precision output as
    views shaped as the parameter (no byte copied; the padding between slots left out), its shaped state
    (``run.shaped``) among its state, each told its one shape. (Each piece is built from the run's fields rather
    than by ``dataclasses.replace``, which reads the class's field list again for every parameter of every step.)"""
    slots = run.slots
    if slots is None or not slots.shapes:
        raise RuntimeError("a run stepped whole needs its parameters' shapes and offsets (Slots.shapes)")
    base = slots.offsets[0]
    fields, slot_fields = vars(run), vars(slots)
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
        own = {} if run.shaped is None else run.shaped[i]  # (its tensors of their own shapes)
        out.append(Run(**{
            **fields, "master": run.master[o:o + n].view(shape), "grad": grad, "grads": None, "offsets": (),
            "shaped": None, "state": {**{k: v[o:o + n].view(shape) for k, v in run.state.items()}, **own},
            "param_out": None if run.param_out is None else run.param_out[o:o + n].view(shape),
            "slots": Slots(**{**slot_fields, "shapes": (shape,), "offsets": (slots.offsets[i],)})}))
    return out


def check_kept(name: str, step_key: Optional[str], run: Run, state: Dict[str, Any]) -> None:
    """After the class stepped one parameter whole (``run``, one of :func:`pieces`), what it keeps for it must be what
    the bucket holds: no key the probe did not find on its stand-ins, and each tensor of the shape it found (the
    class's tensors are then copied into ours). Raises ``RuntimeError`` naming the entry.

    Run for every parameter at every step, so cheap where nothing changed: a tensor the class still keeps is the
    very one it was handed (a view of ours, of the shape the probe found), and only a tensor it put in its place is
    compared."""
    ours = run.state
    unheld = state.keys() - ours.keys()
    if unheld and unheld != {step_key}:
        unheld.discard(step_key)
        raise RuntimeError(f"{name} kept {sorted(unheld)} for a parameter of shape {_shape(run)}, which the probe did "
                           "not find on its stand-ins: zero_offload holds none")
    for k, value in state.items():
        mine = ours.get(k)
        if mine is not None and value is not mine and tuple(value.shape) != tuple(mine.shape):
            raise RuntimeError(f"{name} kept {k!r} of shape {tuple(value.shape)} for a parameter of shape "
                               f"{_shape(run)}, not {tuple(mine.shape)} as the probe found")


def _shape(run: Run) -> Tuple[int, ...]:
    """The shape of the one parameter of ``run`` (a piece), for messages."""
    return tuple(run.slots.shapes[0]) if run.slots is not None and run.slots.shapes else tuple(run.master.shape)

"""What arrived, measured: the squared norms and the inf/nan check of a step's gathered gradients (each kind where it
lies: the streamed buckets' from the norms backward computed on the GPU, the device tier's on its GPU, the rest on
the host, a native call per dtype), clipping's total norm, and the naming of an inf/nan gradient for an error."""

from __future__ import annotations

import math
from itertools import chain
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from zero_offload import functional
from zero_offload._checks import CheckedGrads
from zero_offload._compat import foreach_norm_fp32
from zero_offload.lane import Intake, Plans, SqNorm
from zero_offload.timeline import Timeline

__all__ = ["Found", "Norm", "device_sq_norm", "every", "first_nonfinite", "host_norm", "name_held", "name_param",
           "on_device_sq_norm", "sq_norm_by_dtype", "streamed_norms", "two_norm"]


class Norm(NamedTuple):
    """A norm of gradients (``clip_grad_norm_``'s total norm), and whether one of them is inf/nan."""

    value: float
    nonfinite: bool


class Found(NamedTuple):
    """An inf/nan gradient: its param group, its index there and the parameter as the optimizer was given it (an
    FSDP2 parameter's DTensor, not its local shard)."""

    group: int
    index: int
    param: torch.Tensor


def streamed_norms(intakes: Sequence[Intake], timeline: Optional[Timeline]) -> List[Optional[float]]:
    """The squared norms backward computed on the GPU of the buckets among ``intakes`` whose norm is this step's
    (None for the others): each copied to the host in backward, ahead of the bucket's gradients (a wait for its
    event, usually long passed, and for no gradient copy)."""
    return [None if intake.norm is None else intake.lane.channel.read_norm(timeline, intake.lane.position)
            for intake in intakes]


def device_sq_norm(grads: Sequence[torch.Tensor]) -> SqNorm:
    """:func:`grad_sq_norm_segments` of gradients that stay on their device (the buckets stepped on their GPU):
    torch's norms there (each in float32, squared and summed in float64) and one synchronisation. The non-finite
    flag is exact: a sum that overflows is checked element by element (as the host kernel's flag, it is set only
    by an inf or nan)."""
    grads = [g for g in grads if g.numel()]
    if not grads:
        return SqNorm(0.0, False)
    total = float(torch.stack(foreach_norm_fp32(grads)).double().square().sum())
    if math.isfinite(total):
        return SqNorm(total, False)
    return SqNorm(total, not all(bool(torch.isfinite(g).all()) for g in grads))


def on_device_sq_norm(intakes: Sequence[Intake]) -> SqNorm:
    """The squared norm of the gathered gradients of the buckets stepped on their GPU, all at once."""
    # (A bucket with no gradient and no buffer has nothing to read: its host_grads() would make the buffer.)
    grads = [t for intake in intakes if intake.bucket.home.on_device
             and (intake.in_place is not None or intake.bucket.grads.allocated) for t in intake.host_grads()]
    return device_sq_norm(grads) if grads else SqNorm(0.0, False)


def sq_norm_by_dtype(grads: Sequence[torch.Tensor]) -> SqNorm:
    """:meth:`~zero_offload.lane.Intake.host_sq_norm` of the gradients several buckets read in place (their
    ``host_grads()``, checked), of any dtypes: one native call for each dtype."""
    by_dtype: Dict[torch.dtype, CheckedGrads] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, CheckedGrads()).append(g)
    sq, bad = 0.0, False
    for same in by_dtype.values():
        s, b = functional.grad_sq_norm_segments(same)
        sq, bad = sq + s, bad or b
    return SqNorm(sq, bad)


def two_norm(intakes: Sequence[Intake], streamed: Sequence[Optional[float]]) -> SqNorm:
    """The squared 2-norm of every gathered gradient (``streamed``: :func:`streamed_norms` of ``intakes``, read
    where it is not None, for the buckets whose gradients were copied), and whether one is inf/nan: the device
    tier's in one synchronisation, those read in place in one native call per dtype."""
    sq, nonfinite = on_device_sq_norm(intakes)
    read_in_place: List[torch.Tensor] = []
    for intake, norm in zip(intakes, streamed):
        if intake.bucket.home.on_device:
            continue
        if norm is not None:
            s, bad = norm, not math.isfinite(norm)
        elif intake.in_place is not None:
            read_in_place.extend(intake.host_grads())
            continue
        else:
            s, bad = intake.host_sq_norm()
        sq, nonfinite = sq + s, nonfinite or bad
    s, bad = sq_norm_by_dtype(read_in_place)
    return SqNorm(sq + s, nonfinite or bad)


def host_norm(intakes: Sequence[Intake], norm_type: float) -> float:
    """The ``norm_type`` norm (``inf`` or a finite p other than 2) of every gathered gradient, read where it lies
    (padding is zero in the gradient buffers, so it changes neither a max nor a p-norm)."""
    host = [t for intake in intakes for t in intake.host_grads() if t.numel()]
    if norm_type == math.inf:
        return max((float(t.abs().max()) for t in host), default=0.0)
    norms = [torch.linalg.vector_norm(t.float(), norm_type) for t in host]
    return float(torch.linalg.vector_norm(torch.stack(norms), norm_type)) if norms else 0.0


def first_nonfinite(plans: Plans) -> Optional[Found]:
    """The first gathered gradient of ``plans`` holding an inf/nan; None if none."""
    for gi, intakes in enumerate(plans):
        for intake in intakes:
            bucket = intake.bucket
            for i, has in enumerate(intake.present):
                if not has:
                    continue
                host = bucket.grads.grad_views[i] if intake.in_place is None else intake.in_place[i]
                if host is not None and not bool(torch.isfinite(host).all()):
                    return Found(gi, bucket.layout.indices[i], bucket.owners[i])
    return None


def name_param(group: int, index: int, param: torch.Tensor, names: Sequence[Optional[Sequence[str]]]) -> str:
    """A parameter as an error message names it (``names``: each group's ``param_names``, or None)."""
    label = f" ({names[group][index]!r})" if names[group] else ""
    return f"param group {group}, parameter {index}{label} of shape {tuple(param.shape)}"


def name_held(held: Sequence[Tuple[int, int, int]], plans: Plans, names: Sequence[Optional[Sequence[str]]]) -> str:
    """For a step refused on every rank of a group: of the inf/nan gradients ``held`` (each rank's first, as
    ``(param group, index, rank)``), the first by param group and index, named alike on every rank with the rank
    whose shard holds it."""
    if not held:
        return "the gradients"
    group, index, rank = min(held)
    param = next((intake.bucket.owners[i] for intake in plans[group]
                  for i, j in enumerate(intake.bucket.layout.indices) if j == index), None)
    named = f"param group {group}, parameter {index}" if param is None else name_param(group, index, param, names)
    return f"{named} (in rank {rank}'s shard)"


def every(plans: Plans) -> List[Intake]:
    """The intakes of every group, in order."""
    return list(chain.from_iterable(plans))

"""The step gate: whether a step applies, and with what gradient multiplier.

``step()`` reads in three phases: *intake* (the transport receives every bucket's gradients and measures them: the
norm, inf/nan), *decide* (here: one :class:`Decision` from what a ``GradScaler`` left on the optimizer, the pending
``clip_grad_norm_``, the ``nonfinite`` policy and the measurement), *run* (the schedule updates the buckets with
the decision's multiplier). Every message about a refused step is here too.

**GradScaler.** ``torch.amp.GradScaler.step`` drives an optimizer that sets ``_step_supports_amp_scaling`` by
setting ``grad_scale`` (the scale, or None once ``unscale_`` ran) and ``found_inf`` on it before calling
``step()``, and deleting them after: read here as a :class:`ScalerSignal`. Where the ranks of an FSDP2 mesh
disagree (HSDP: torch's check of DTensor gradients reduces ``found_inf`` over the shards, not over the replicas),
every rank skips, and the scalers that found nothing are told (:func:`overflow_elsewhere`).

**Clipping.** ``clip_grad_norm_`` measures the total norm at once (intake) and leaves a :class:`PendingClip`; the
next ``step()`` multiplies the gradients by its coefficient inside the kernel, torch's coefficient of the gradients
the clip saw (scaled ones where it came before the scaler's ``unscale_``), and refuses gradients a backward or an
edit changed since (:class:`GradsSeen`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import operator
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from zero_offload import fsdp2
from zero_offload.lane import Arrival, Lane, Plans

__all__ = ["NO_SCALER", "Decision", "PendingClip", "ScalerSignal", "check_max_norm", "check_norm_type", "decide",
           "nonfinite_error", "overflow_elsewhere", "refuse_clipping", "refuse_released_scaler"]

logger = logging.getLogger("zero_offload")


@dataclasses.dataclass(frozen=True)
class ScalerSignal:
    """What a ``GradScaler`` left on the optimizer for this ``step()`` (nothing: ``present`` False).

    ``unscaled``: a scaler drives the step and its ``unscale_`` rewrote the gradients in place (without a version
    bump), so every gradient still on a parameter must be read again; ``overflow``: it found an inf/nan (skip);
    ``check_nonfinite``: the intake looks for inf/nan (not where a scaler did, nor under the policy "ignore")."""

    present: bool = False
    grad_scale: Optional[Any] = None  # the scale (None: the user called unscale_ already)
    found_inf: Optional[Any] = None  # > 0: an inf/nan was found; skip the step
    unscaled: bool = False
    overflow: bool = False
    check_nonfinite: bool = True

    @classmethod
    def of(cls, opt: Any, policy: str) -> "ScalerSignal":
        if not (hasattr(opt, "grad_scale") or hasattr(opt, "found_inf")):
            return NO_SCALER[policy]
        scale, found = getattr(opt, "grad_scale", None), getattr(opt, "found_inf", None)
        return cls(True, scale, found, scale is None, found is not None and float(found) != 0.0,
                   found is None and policy != "ignore")

    @property
    def inv_scale(self) -> float:
        """``GradScaler.unscale_`` multiplies by this float32 reciprocal computed in double: the same bits here."""
        if self.grad_scale is None:
            return 1.0
        return float(torch.as_tensor(self.grad_scale).double().reciprocal().float())


def overflow_elsewhere(opt: Any, scaler: ScalerSignal) -> ScalerSignal:
    """``scaler`` as if this rank's GradScaler had found the inf/nan another rank's found (every rank of the mesh
    skips the step, see ``FSDPTransport.measure``), and the GradScaler driving this ``step()`` told so: its
    ``found_inf_per_device`` for ``opt`` (what its ``update()`` reads) set, so that it backs its scale off with the
    others' (a scale kept on some ranks only would scale the replicas' next gradients differently before FSDP
    averages them). The scaler gives the optimizer no handle on those (``opt.found_inf`` is a sum, a new tensor):
    they are read from ``GradScaler.step``'s frame up the stack (private: its local ``optimizer_state``)."""
    from torch.amp import GradScaler

    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code is GradScaler.step.__code__ and frame.f_locals.get("optimizer")
                                     is opt):
        frame = frame.f_back
    state = frame.f_locals.get("optimizer_state") if frame is not None else None
    found = state.get("found_inf_per_device") if isinstance(state, dict) else None
    if found:
        for t in found.values():
            t.fill_(1.0)
    else:
        logger.warning("OffloadOptimizer: another rank's GradScaler found an inf/nan gradient, so this step is skipped "
                       "on every rank, but the GradScaler of this rank could not be told (its step() is not up the "
                       "stack): its scale is not backed off as the others' are")
    del frame
    return dataclasses.replace(scaler, overflow=True)


# The signal of a step no GradScaler drives, by ``nonfinite`` policy (the step looks it up without a call when the
# optimizer carries no ``grad_scale``/``found_inf``).
NO_SCALER = {"raise": ScalerSignal(), "skip": ScalerSignal(), "ignore": ScalerSignal(check_nonfinite=False)}


@dataclasses.dataclass(frozen=True)
class PendingClip:
    """What ``clip_grad_norm_`` left for the next ``step``: the intakes it received and gathered, and the norm."""

    plans: Plans
    max_norm: float
    norm_type: float
    total_norm: float
    nonfinite: bool
    fresh: bool  # every gradient still on a parameter was read again (see OffloadOptimizer.clip_grad_norm_)
    seen: "GradsSeen"

    def coefficient(self) -> float:
        """``min(max_norm / (norm + 1e-6), 1)`` as torch's clip computes it, of the norm it measured (a scaled one
        where it came before the scaler's ``unscale_``). NaN where the norm is (a NaN gradient, or an inf one with
        ``max_norm=inf``): torch's clip then makes every gradient NaN, and so does this multiplier (under
        ``nonfinite="ignore"``; the other policies skip or refuse such a step before it is used)."""
        total = torch.tensor(self.total_norm, dtype=torch.float32)
        return float(torch.clamp(self.max_norm / (total + 1e-6), max=1.0))


_get_grad = operator.attrgetter("grad")
# (A DTensor gradient's own counter and its local tensor's: a write into ``p.grad.to_local()`` moves only the latter.)
_get_version = fsdp2.version
_not_none = functools.partial(operator.is_not, None)


class GradsSeen:
    """The gradients as ``clip_grad_norm_`` saw them: per bucket, what backward had sent (its record and how many
    times), each parameter's ``.grad`` and their version counters (a DTensor's and its local tensor's). The clip's
    coefficient is of those gradients: torch's clip scales them in place, so a backward after it adds unclipped
    gradients to clipped ones. ``step()`` refuses to apply the coefficient to gradients that changed since
    (:meth:`check`). About as much per parameter as the step's own collection of its gradients."""

    __slots__ = ("_lanes",)

    def __init__(self, lanes: Sequence[Lane]):
        self._lanes: List[Tuple[Lane, Arrival, int, List[Any], List[int]]] = []
        for lane in lanes:
            grads = list(map(_get_grad, lane.bucket.owners))
            self._lanes.append((lane, lane.arrival, lane.arrival.launches, grads,
                                list(map(_get_version, filter(_not_none, grads)))))

    def changed(self) -> bool:
        """Whether a gradient was sent again by a backward, assigned, or edited in place (but for the edits that
        move no version counter, ``GradScaler.unscale_``) since."""
        for lane, arrival, launches, grads, versions in self._lanes:
            # (a load_state_dict in between may have begun the lane's record afresh)
            if lane.arrival.launches > (launches if lane.arrival is arrival else 0):
                return True
            now = list(map(_get_grad, lane.bucket.owners))
            if not all(map(operator.is_, now, grads)) or list(map(_get_version, filter(_not_none, now))) != versions:
                return True
        return False

    def check(self, where: str, marks: Optional[dict] = None,
              together: Optional[Callable[..., contextlib.AbstractContextManager]] = None) -> None:
        """Refuse (in ``where``, ``step()`` or a new ``clip_grad_norm_``) gradients changed since. ``marks``: the
        optimizer's ``__dict__``, where ``GradScaler.step`` set ``grad_scale`` and ``found_inf``: it deletes them
        only when ``step()`` returns, and would multiply its next scale by one left there, so they go.
        ``together``: the transport's (see :meth:`~zero_offload.transport.base.Transport.together`): a rank that
        refuses still meets the others, so that they raise too, but where a GradScaler's inf/nan skips the step."""
        if not self.changed():
            return
        found = (marks or {}).get("found_inf")
        for name in ("grad_scale", "found_inf"):
            (marks or {}).pop(name, None)
        skipped = found is not None and float(found) != 0.0
        with contextlib.nullcontext() if together is None else together(skipped=skipped):
            raise RuntimeError(
                f"OffloadOptimizer.{where}: the gradients changed after opt.clip_grad_norm_ (a backward or an edit "
                "of .grad came between them). torch's clip would have scaled the gradients it saw in place and left "
                "the later ones unclipped, which the coefficient applied inside step() cannot do. Call "
                "opt.clip_grad_norm_ after the last backward of the step, right before step() (to clip each "
                "micro-batch, use torch.nn.utils.clip_grad_norm_). Nothing was changed: zero_grad() and run the "
                "step's backwards again in that order."
            )


@dataclasses.dataclass(frozen=True)
class Decision:
    """One step's verdict. ``skip``: why the step is not applied (``"scaler overflow"``, ``"nonfinite"``), or None;
    ``raise_``: the ``nonfinite="raise"`` policy refuses it with an error; ``multiplier``: what multiplies every
    gradient in the kernel (the loss-scale inverse times the clip coefficient); ``inv_scale`` and ``clip`` what it
    was made of (the next step is expected to look like this one)."""

    skip: Optional[str] = None
    raise_: bool = False
    multiplier: float = 1.0
    inv_scale: float = 1.0
    clip: Optional[PendingClip] = None


def decide(scaler: ScalerSignal, clip: Optional[PendingClip], nonfinite_found: bool, policy: str) -> Decision:
    """The step's :class:`Decision` (``nonfinite_found``: the intake's inf/nan check, where it ran)."""
    if scaler.overflow:
        return Decision(skip="scaler overflow")
    if nonfinite_found:
        return Decision(skip="nonfinite", raise_=policy == "raise")
    inv_scale = scaler.inv_scale
    # As torch's clip: the coefficient of the norm it measured, of the gradients as they were then (scaled ones
    # where it came before the scaler's unscale_, whichever unscales them).
    coef = 1.0 if clip is None else clip.coefficient()
    return Decision(multiplier=inv_scale * coef, inv_scale=inv_scale, clip=clip)


def nonfinite_error(where: str, optimizer_class: type = torch.optim.AdamW) -> RuntimeError:
    """The error of ``nonfinite="raise"``; ``nonfinite="ignore"`` steps as ``optimizer_class`` (the rule's) would."""
    return RuntimeError(f"OffloadOptimizer.step: non-finite gradient (inf or nan) in {where}; nothing was updated. "
                        "Pass nonfinite='skip' to skip such steps, or nonfinite='ignore' to apply them as "
                        f"{_public_name(optimizer_class)} would.")


def _public_name(cls: type) -> str:
    """``cls`` as users write it: ``torch.optim.AdamW`` (not ``torch.optim.adamw.AdamW``), ``zero_offload.Lion``."""
    for package in ("torch.optim", "zero_offload"):
        if cls.__module__.startswith(package) and getattr(sys.modules.get(package), cls.__name__, None) is cls:
            return f"{package}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def check_max_norm(max_norm: Any) -> float:
    """``clip_grad_norm_``'s ``max_norm`` as a float: a number >= 0, or ``inf`` (no clipping, as torch's). NaN is
    refused (torch's clip would make every gradient NaN), and so is a negative one (torch's would flip every
    gradient's sign)."""
    value = float(max_norm)
    if math.isnan(value) or value < 0:
        raise ValueError(f"Invalid max_norm: {value} (expected a number >= 0, or inf for no clipping); nothing was "
                         "changed")
    return value


def check_norm_type(norm_type: Any) -> float:
    norm_type = float(norm_type)
    if not (norm_type == math.inf or (math.isfinite(norm_type) and norm_type > 0)):
        raise ValueError(f"Invalid norm_type: {norm_type} (expected 2.0, inf or a finite p > 0)")
    return norm_type


def nonfinite_norm_error(norm_type: float) -> RuntimeError:
    """``clip_grad_norm_(error_if_nonfinite=True)``'s error: torch's own words."""
    return RuntimeError(
        f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
        "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
        "`error_if_nonfinite=False`"
    )


def refuse_clipping() -> RuntimeError:
    return RuntimeError("OffloadOptimizer(overlap_step=True) cannot clip: buckets are updated during backward, "
                        "before the total norm exists. Turn overlap_step off to clip.")


def refuse_overlap_scaler() -> RuntimeError:
    return RuntimeError("OffloadOptimizer(overlap_step=True) cannot be driven by a GradScaler: the scaler's "
                        "inf check comes after backward, when buckets were already updated. Turn "
                        "overlap_step off, or use bf16 autocast, which needs no scaler.")


def refuse_released_scaler(plans: Plans, release: bool) -> None:
    """A GradScaler finds infs in, and unscales, the gradients on the parameters: released ones it never saw."""
    if release and any(has and g is None for intakes in plans for intake in intakes
                       for has, g in zip(intake.present, intake.pending)):
        raise RuntimeError(
            "OffloadOptimizer: a GradScaler drives this step, but the gradients were released from the "
            "parameters as backward streamed them (release_grads=True), so the scaler could not check them for "
            "inf/nan. Pass release_grads=False to use a GradScaler (or use bf16 autocast, which needs none). "
            "Nothing was updated."
        )

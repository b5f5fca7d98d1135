r"""``OffloadOptimizer``: ``torch.optim.AdamW`` with its state in flat host buffers and a fused CPU kernel.

This module holds the ``torch.optim`` conventions only (defaults, param_groups, hyperparameters read at every
step, hooks, ``state_dict``) and drives the stages in the order the data meets them: :mod:`~zero_offload.options`
(what was asked), :mod:`~zero_offload.topology` (where the parameters live across ranks),
:mod:`~zero_offload.buckets` (where bytes live, each bucket's state in its home, :mod:`~zero_offload.state.home`),
:mod:`~zero_offload.grad_stream` (when gradients may leave), :mod:`~zero_offload.transport` (moving them, each
bucket's step told in the records of :mod:`~zero_offload.lane`), :mod:`~zero_offload.gate` (whether the step
applies, and with what multiplier), :mod:`~zero_offload.update` (the kernel and its schedule) and :mod:`~zero_offload.checkpoint` (the state as users see it).

``step()`` reads in three phases: intake (the transport receives each bucket's gradients as an intake and measures
them), decide (the gate's :class:`~zero_offload.gate.Decision`), run (the schedule), then finish (every lane's
step ends in one place).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import weakref
from itertools import chain
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from zero_offload import gate, placement, topology
from zero_offload.checkpoint.entries import ParamList, StateMap, check_param_lists, sync_state
from zero_offload.checkpoint.methods import StateDictMethods
from zero_offload.inspection import GradlessSteps, InspectionMethods
from zero_offload.buckets import FlatBucket, allocate_group
from zero_offload.gate import NO_SCALER, Decision, PendingClip, ScalerSignal
from zero_offload.grad_stream import GradStreamer
from zero_offload.host_memory import HostMemoryEstimate
from zero_offload.lane import Lane, Plans
from zero_offload.options import OFFLOAD_OPTIONS, Options, check_option_names, option_docs
from zero_offload.rules.adamw import ADAMW
from zero_offload.rules.base import Rule
from zero_offload.timeline import NOTHING
from zero_offload.transport import Transport
from zero_offload.update import Delayed, Immediate, Overlap, ensure_buffers, update_bucket

__all__ = ["OffloadOptimizer", "OFFLOAD_OPTIONS"]

logger = logging.getLogger("zero_offload")


class OffloadOptimizer(StateDictMethods, InspectionMethods, torch.optim.Optimizer):
    r"""AdamW (or Adam) whose fp32 master weights and moments live in flat host buffers, updated by a fused SIMD
    CPU kernel: a drop-in for ``torch.optim.AdamW`` that takes the optimizer state off the GPU.

    The update is operation for operation ``torch.optim.AdamW(foreach=False)``'s (the math is in
    :mod:`zero_offload.functional`; bias corrections in double), so an fp32 model follows AdamW's trajectory to
    within rounding. Where bytes live, how gradients stream, clipping, mixed precision, sharding and the state
    dict are described in docs/ (how-it-works.md, options.md, multi-gpu.md, checkpoints.md); what differs from
    AdamW, each refused with an error (pickling, float64, editing a group's ``params``...), in docs/differences.md.

    Other elementwise optimizers (:class:`zero_offload.Lion`, ``torch.optim.SGD``, ``Adagrad``, ...) get the same
    machinery through :func:`zero_offload.offload` (docs/other-optimizers.md): an instance of this class whose update
    rule, ``defaults`` and state-dict format are the wrapped optimizer's.

    Args:
        params (iterable): parameters or dicts defining parameter groups (optionally ``(name, param)`` pairs),
            as for any ``torch.optim.Optimizer``. fp32, bf16 or fp16, dense, on CPU or CUDA; leaf tensors only.
        lr (float or Tensor): learning rate; a Tensor must hold one element. Default: 1e-3.
        betas (Tuple[float, float]): coefficients of the running averages of the gradient and its square.
            Default: (0.9, 0.999).
        eps (float): added to the denominator. Default: 1e-8.
        weight_decay (float): weight decay coefficient. Default: 1e-2 (AdamW's).
        amsgrad (bool): use AMSGrad's running maximum of the second moment. Default: False.
        maximize (bool): maximize the objective instead of minimizing. Default: False.
        foreach (bool, optional): accepted and ignored: every update is one fused call per bucket. Default: None.
        capturable (bool): must be False: ``step()`` synchronises with the host. Default: False.
        differentiable (bool): must be False: the update runs in a host kernel, outside autograd. Default: False.
        fused (bool, optional): accepted and ignored like ``foreach``. Default: None.
        decoupled_weight_decay (bool): True is AdamW; False is ``torch.optim.Adam``'s L2 penalty. Default: True.
{options}

    Attributes:
        skipped_steps (int): steps skipped because a gradient was not finite.
    """

    _step_supports_amp_scaling = True

    def __init__(self, params: Iterable[Any], lr: Union[float, torch.Tensor] = 1e-3,
                 betas: Tuple[Union[float, torch.Tensor], Union[float, torch.Tensor]] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, decoupled_weight_decay: bool = True, **options: Any) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        self._start(params, ADAMW, defaults, options)

    @classmethod
    def _with_rule(cls, params: Iterable[Any], rule: Rule, defaults: Dict[str, Any], **options: Any
                   ) -> "OffloadOptimizer":
        """An optimizer that runs ``rule`` (another optimizer's update, see :func:`zero_offload.offload`) with
        ``defaults`` (that optimizer's) and the offload ``options`` (the constructor's, by name)."""
        opt = cls.__new__(cls)
        opt._start(params, rule, dict(defaults), options)
        return opt

    def _start(self, params: Iterable[Any], rule: Rule, defaults: Dict[str, Any], options: Dict[str, Any]) -> None:
        check_option_names(options)  # (a removed option's error says what replaced it)
        rule.check(defaults)
        opts = Options.of(options)
        self._topology, params = topology.of(params, opts)
        self.options = self._topology.options(opts).settled(params, rule).validate()  # (the default placement's)
        _check_rule(rule, self.options)
        self._placer = placement.Placer.of(self.options)  # (where buckets go once the first steps are measured)
        self._rule, self._given = rule, dict(options)
        self._transport = self._topology.transport(self.options)
        self._mode = _make_mode(self.options, self._transport, weak_method(self._early_update))
        self._streamer = GradStreamer(self._transport, self._mode)
        self._unhook = weakref.finalize(self, self._streamer.remove)
        self.skipped_steps = 0
        self._gradless = GradlessSteps()
        self._buckets: List[List[FlatBucket]] = []  # set before the base constructor calls add_param_group
        self._lanes: List[List[Lane]] = []  # each bucket's lane, by group
        self._pending: Optional[PendingClip] = None
        self._constructed = False
        super().__init__(params, defaults)
        # Parameters are rebound to their slots only once every group is in: a bad group raises with the model
        # exactly as it was.
        for lane in chain.from_iterable(self._lanes):
            lane.route.bind(lane)
        self._constructed = True
        self._topology.built()
        logger.info("OffloadOptimizer: %d param groups, %d buckets: %s", len(self.param_groups),
                    sum(len(b) for b in self._buckets), self.estimate_host_memory().describe())

    @property
    def nonfinite(self) -> str:
        """The ``nonfinite`` policy; may be changed between steps (validated like the constructor's)."""
        return self.options.nonfinite

    @nonfinite.setter
    def nonfinite(self, policy: str) -> None:
        self.options = dataclasses.replace(self.options, nonfinite=policy).validate()

    # ---------------------------------------------------------------------------------------- param groups --
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group, as ``torch.optim.Optimizer.add_param_group``, and allocate its buckets. Every
        check runs before the group is added; on any error the optimizer is unchanged.

        Args:
            param_group (dict): ``params`` plus any hyperparameter overriding the defaults.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        added = self._rule.group_keys({**self.defaults, **param_group})  # (the wrapped class's constructor's)
        self._rule.check({**self.defaults, **param_group, **added})
        raw = param_group["params"]
        raw = [raw] if isinstance(raw, torch.Tensor) else raw
        if isinstance(raw, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering "
                            "of tensors in sets will change between runs. Please use a list instead.")
        raw = list(raw)
        tensors = [p[1] if isinstance(p, tuple) else p for p in raw]
        n_groups = len(self.param_groups)
        # The switches of optional state buffers (amsgrad's) decide which buffers state_dict() gathers on a group.
        switches = tuple((f"{b.switch} of param group {n_groups}", bool(param_group.get(b.switch,
                         self.defaults[b.switch]))) for b in self._rule.buffers if b.switch)
        placed = self._topology.place(tensors, n_groups, (*self.options.collective_layout(), *switches))
        param_group["params"] = raw
        param_group.update(added)
        super().add_param_group(param_group)  # names, defaults, and the parameter-in-two-groups check
        try:
            buckets = allocate_group(self.param_groups[-1], n_groups, self.options, placed, self._rule)
        except BaseException:
            del self.param_groups[n_groups:]
            raise
        self._buckets.append(buckets)
        self._pending = None
        lanes = [self._transport.add(b, n_groups, self.options.streams(b.device)) for b in buckets]
        self._lanes.append(lanes)
        for lane in lanes:
            self._streamer.add(lane)  # (it watches the streamed ones)
        if self._constructed:
            for lane in lanes:
                lane.route.bind(lane)
            logger.info("OffloadOptimizer: added param group %d, %d buckets: %s", n_groups, len(buckets),
                        sum((b.estimate() for b in buckets), HostMemoryEstimate(0, 0, {}, 0, 0)).describe())

    # ------------------------------------------------------------------------------------------------- step --
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Optional[Any]:
        """One AdamW update of every parameter that has a gradient.

        Every check (hyperparameters, gradients, non-finite policy) runs before any write: an error changes nothing.

        Args:
            closure (Callable, optional): re-evaluates the model and returns the loss (run with grad enabled, once,
                before the update; a wrapped class whose update uses the loss is handed it).

        Returns:
            the closure's return value, or None.
        """
        loss = self._rule.run_closure(closure)
        if self._pending is not None:  # (before anything, streamed gradients too, is let go)
            self._pending.seen.check("step", self.__dict__, self._transport.together)
        placer = self._placer
        try:
            if placer is not None:
                placer.step_begins(self._transport)
            tl = self._transport.timeline
            with NOTHING if tl is None else tl.span("step", "step()"):
                self._step()
            if placer is not None:  # (after a step that did not raise, until it has placed)
                self._placer = None
                self._placer = placer.step_ends(self._topology, self._transport, self._streamer, self.state)
        finally:
            self._rule.set_loss(None)
            self._end_step(stepped=True)
            if self.options.placement != "host" and type(self.state) is StateMap and any(
                    b.home.kind == "parked" for b in chain.from_iterable(self._buckets)):
                # (opt.state's next read waits for the write-backs this step issued)
                self.state.landing = weakref.WeakMethod(self._settle_homes)
        return loss

    def _sync(self) -> None:
        """Refuse edited param lists (but adopt accelerate's switch to FSDP2's shards before the first step, see
        :func:`~zero_offload.fsdp2.adopt_switched`); apply the user's edits of ``opt.state`` (after a pending
        update)."""
        state = self.state
        # O(groups) when nothing was edited, without a call (the step runs this every time).
        if type(state) is StateMap and not state.flag.changed and len(self.param_groups) == len(self._buckets) \
                and all(type(g["params"]) is ParamList and not g["params"].flag.changed
                        for g in self.param_groups):
            return
        self._topology.adopt_switched(self)
        check_param_lists(self.param_groups, self._buckets)
        self.state = sync_state(self.state, self._buckets, self._before_edits, self._topology.local_value)

    def _step(self) -> None:
        self._settle()  # before _sync: an update running in backward may still write the state
        # Intake: what arrived, measured.
        policy, marks = self.options.nonfinite, self.__dict__  # (GradScaler.step sets grad_scale and found_inf)
        scaler = ScalerSignal.of(self, policy) if "grad_scale" in marks or "found_inf" in marks else NO_SCALER[policy]
        with self._transport.together(skipped=scaler.overflow):
            self._sync()
            clip, reread = self._take_clip(scaler.unscaled)
        with self._transport.together(skipped=scaler.overflow):  # (anew: a failure after a redone clip still meets)
            self._transport.edits.scaled = scaler.present
            plans = clip.plans if clip is not None and not reread else self._receive(fresh=scaler.unscaled)
            self._gradless.see(plans)
            hypers = [self._rule.hyper(g) for g in self.param_groups]
            if scaler.present:
                self._mode.check_scaler()
                gate.refuse_released_scaler(plans, self._transport.release)
        settings = self._topology.settings(hypers, self.options.nonfinite)
        plans, found, overflow = self._transport.measure(plans, settings, scaler.check_nonfinite,
                                                         None if reread else clip, scaler.overflow)
        if overflow and scaler.present and not scaler.overflow:  # (another rank's GradScaler found an inf/nan)
            self._transport.wait_all(plans)
            scaler = gate.overflow_elsewhere(self, scaler)
        # Decide.
        decision = gate.decide(scaler, clip, found, self.options.nonfinite)
        if decision.skip is not None:
            self._skip(decision, plans)
            return
        # Run.
        self._mode.run(decision, hypers, plans, self.state)

    def _skip(self, decision: Decision, plans: Plans) -> None:
        """A step not applied: counted, or refused with an error naming the first inf/nan gradient."""
        if decision.skip == "nonfinite":
            self._transport.wait_all(plans)  # no copy may still be reading the gradients once step() returns
        if decision.raise_:
            names = [g.get("param_names") for g in self.param_groups]
            raise gate.nonfinite_error(self._transport.describe_nonfinite(plans, names), self._rule.optimizer_class)
        self.skipped_steps += 1

    def _take_clip(self, unscaled: bool) -> Tuple[Optional[PendingClip], bool]:
        """The pending clip, and whether to read its gradients again (a GradScaler's ``unscale_`` may have come
        after it: its coefficient multiplies them as they are); redone if it trusted streamed copies (see below)."""
        pending, self._pending = self._pending, None
        if not unscaled or pending is None or pending.fresh:
            return pending, pending is not None and unscaled
        logger.warning("OffloadOptimizer: a GradScaler drove this step for the first time since a step without "
                       "one; clip_grad_norm_ was redone on the unscaled gradients (the norm it returned this "
                       "step was of the scaled ones)")
        self._transport.edits.scaled = True  # (the clip trusted copies streamed in backward: no scaler last step)
        self.clip_grad_norm_(pending.max_norm, pending.norm_type)
        pending, self._pending = self._pending, None
        return pending, False

    def _end_step(self, stepped: bool = False) -> None:
        """Forget what backward streamed for this step (after ``step()``, whatever its exit, or ``zero_grad``)."""
        if self._streamer.in_backward:
            self._streamer.reset(abandon=not stepped)  # (a backward that raised: see GradStreamer.reset)
        if self._transport.moved:  # (nothing moved: no lane has a step to end, e.g. zero_grad() after step())
            try:
                self._mode.end_step(stepped)
            finally:
                self._transport.reset()  # every lane's step ends, whatever the schedule's end did

    def _receive(self, fresh: bool = False) -> Plans:
        """What every bucket received for this step, by group (see :meth:`Transport.receive_all`)."""
        plans = self._transport.receive_all(self._lanes, fresh)
        self._mode.check_received(plans)
        return plans

    def _early_update(self, lane: Lane) -> None:
        """``overlap_step``: a bucket's update, run in the worker thread as soon as its gradients are sent
        (hyperparameters as they are now, which is what ``step()`` would read)."""
        self._sync()
        hyper = self._rule.hyper(self.param_groups[lane.group])
        ensure_buffers(self.state, lane.bucket, hyper)
        update_bucket(self._transport, lane, list(lane.arrival.sent), None, hyper, 1.0, self.state)

    def flush(self) -> None:
        """With ``delayed_update``: apply the last ``step()``'s pending update now (saving does not). A parked
        bucket's state still on its way back to the host has landed when it returns."""
        self._mode.flush(self.state)
        self._settle_homes()

    # ------------------------------------------------------------------------------------------- gradients --
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. With ``set_to_none=False``, existing gradients of CPU parameters
        become zeroed views of the flat gradient buffer, so backward accumulates into it and ``step()`` copies none.

        Args:
            set_to_none (bool): set gradients to None instead of zeroing them. Default: True.
        """
        self._pending = None
        self._topology.adopt_switched(self)  # (before the first step: the gradients to zero are the shards')
        self._end_step()  # gradients streamed since the last step are discarded with the rest
        if set_to_none:
            super().zero_grad(set_to_none=True)
        else:
            self._transport.keep_zero_grads()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> torch.Tensor:
        """Clip the gradients of the optimizer's parameters (not others of the model) by their total norm, as
        ``torch.nn.utils.clip_grad_norm_`` over them, fused into the next ``step()``: ``min(max_norm / (total_norm +
        1e-6), 1)`` multiplies the gradient inside the kernel instead of rewriting ``.grad`` (left as it was).

        It brings the gradients to the host now (``step()`` reuses them): call it after the last backward, right
        before ``step()`` (or ``scaler.step``); ``zero_grad()`` cancels it. A backward or an edit of ``.grad`` in
        between makes ``step()`` (and another clip) raise, changing nothing. Streamed gradients a ``GradScaler``
        may have unscaled in place (moving no version counter) are read again where their norm changed; a scaler
        that first appears later makes ``step()`` clip again. Before ``scaler.unscale_(opt)`` it clips the scaled
        gradients by their scaled norm, as torch's clip does.

        Args:
            max_norm (float): max norm of the gradients: >= 0, or ``inf`` (no clipping); NaN and negative values,
                which torch's clip would turn into NaN or sign-flipped gradients, raise ``ValueError``.
            norm_type (float): type of the p-norm: 2, ``inf``, or any finite p > 0. Default: 2.0.
            error_if_nonfinite (bool): raise ``RuntimeError`` if the total norm is nan or inf. Default: False.
                Otherwise a non-finite norm is left to the ``nonfinite`` policy at ``step()``: under ``"ignore"``
                the step then does what AdamW does after torch's clip (a NaN norm makes every gradient NaN; an
                inf one, every gradient zero but the inf ones, NaN).

        Returns:
            Tensor: the total norm of the gradients (viewed as a single vector), float32, on the device of the
            first parameter with a gradient; for FSDP2's parameters, a DTensor replicated over their mesh (as torch's).
        """
        norm_type = gate.check_norm_type(norm_type)
        max_norm = gate.check_max_norm(max_norm)
        if self.options.overlap_step:
            raise gate.refuse_clipping()
        if self._pending is not None:
            self._pending.seen.check("clip_grad_norm_")  # (the first clip would have scaled what it saw)
        self._topology.adopt_switched(self)
        fresh = self._transport.edits.scaled is not False
        plans = self._receive(fresh=fresh)
        first = next((intake.bucket.params[i] for intake in chain.from_iterable(plans)
                      for i, has in enumerate(intake.present) if has), None)
        settings = self._topology.settings((), self.options.nonfinite, (max_norm, norm_type))
        plans = self._transport.gather(plans, clipping=True, settings=settings).plans
        total, nonfinite = self._transport.total_norm(plans, norm_type)
        nonfinite = nonfinite or not math.isfinite(total)
        if error_if_nonfinite and nonfinite:
            raise gate.nonfinite_norm_error(norm_type)
        self._pending = PendingClip(plans, max_norm, norm_type, total, nonfinite, fresh,
                                    gate.GradsSeen(list(chain.from_iterable(self._lanes))))
        norm = torch.tensor(total, dtype=torch.float32, device=first.device if first is not None else "cpu")
        return self._topology.norm_value(norm, self.param_groups)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradient accumulation, like ``DistributedDataParallel.no_sync``: backward passes inside it keep their
        gradients in ``.grad`` instead of streaming them; only the last micro-batch's, outside it, sends them."""
        return self._streamer.no_sync()


def _check_rule(rule: Rule, options: Options) -> None:
    """Refuse the options the update rule cannot run: a ``state_dtype`` the options take that its update does not
    keep, a ``gpu_fraction`` for a rule without a GPU update, an update before ``step()`` (``overlap_step``,
    ``delayed_update``) for a rule that reads the closure's loss."""
    if options.state_dtype not in rule.state_dtypes:
        raise ValueError(f"state_dtype={options.state_dtype}: {rule.name}'s update keeps its state in "
                         f"{', '.join(map(str, rule.state_dtypes))} only")
    late = [n for n in ("overlap_step", "delayed_update") if getattr(options, n)]
    if rule.uses_loss and late:
        raise ValueError(f"{late[0]}={getattr(options, late[0])!r}: {rule.name} uses the loss its closure returns "
                         "(its update reads it), known only once step() has called the closure, and "
                         f"{late[0]} updates before that: leave {late[0]} off")
    if options.gpu_tier and not rule.device_update:
        name = options.gpu_option
        raise ValueError(f"{name}={getattr(options, name)!r}: {rule.name} has no GPU update (the GPU part runs "
                         f"torch's fused AdamW): leave {name} at its default")


def _make_mode(options: Options, transport: Transport, early_update: Callable[[Lane], None]) -> Immediate:
    """The schedule ``options`` ask for."""
    if options.overlap_step:
        return Overlap(transport, early_update)
    if options.delayed_update:
        return Delayed(transport, options.delayed_exact_steps)
    return Immediate(transport)


def weak_method(method: Callable) -> Callable:
    """A callable that calls ``method`` without keeping its object alive (the hooks live on the parameters, which
    usually outlive the optimizer)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        target = ref()
        if target is None:
            raise RuntimeError("OffloadOptimizer was garbage-collected while its gradient stream was in use")
        return target(*args)

    return call


def _signature() -> inspect.Signature:
    """The constructor's signature as ``help()`` and ``inspect`` show it: AdamW's arguments, then every offload
    option as a keyword with its default (declared once, in :class:`~zero_offload.options.Options`)."""
    sig = inspect.signature(OffloadOptimizer.__init__)
    own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    extra = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
             for f in dataclasses.fields(Options) if f.name in OFFLOAD_OPTIONS]
    return sig.replace(parameters=own + extra)


OffloadOptimizer.__init__.__signature__ = _signature()
OffloadOptimizer.__doc__ = OffloadOptimizer.__doc__.replace("{options}", option_docs())

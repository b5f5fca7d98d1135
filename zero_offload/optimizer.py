r"""``OffloadOptimizer``: ``torch.optim.AdamW`` with its state in flat host buffers and a fused CPU kernel.

This module holds the ``torch.optim`` conventions only (defaults, param_groups, hyperparameters read at every
step, hooks, ``state_dict``) and drives the stages in the order the data meets them: :mod:`~zero_offload.options`
(what was asked), :mod:`~zero_offload.buckets` (where bytes live), :mod:`~zero_offload.grad_stream` (when
gradients may leave), :mod:`~zero_offload.transport` / :mod:`~zero_offload.distributed` (moving them),
:mod:`~zero_offload.update` (the kernel and its schedule) and :mod:`~zero_offload.checkpoint` (the state as
users see it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import warnings
import weakref
from itertools import chain
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from zero_offload import checkpoint
from zero_offload.buckets import FlatBucket, allocate_group, estimate_params
from zero_offload.grad_stream import GradStreamer
from zero_offload.host_memory import HostMemoryEstimate, PlanOrMeasure
from zero_offload.options import (DEFAULT_BUCKET_NUMEL, Options, agreed_settings,
                                  check_params, check_speculation_memory, check_state_dtype, delayed_setting,
                                  world_without_group)
from zero_offload.timeline import Timeline, TimelineEvent, span
from zero_offload.transport import Transport
from zero_offload.records import PendingClip, Plans
from zero_offload.rules.adamw import ADAMW
from zero_offload.rules.base import Rule
from zero_offload.speculation import Speculative
from zero_offload.undo import plan_undo
from zero_offload.update import Delayed, Immediate, Overlap, ensure_buffers, update_bucket, weak_method

__all__ = ["OffloadOptimizer", "OFFLOAD_OPTIONS"]

logger = logging.getLogger("zero_offload")


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
      not set it, ``world_size`` that of the ``process_group`` (the estimate is then per rank).
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
        ValueError: a ``state_dtype`` or ``speculation_memory`` the constructor refuses (its very error).
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


class OffloadOptimizer(torch.optim.Optimizer):
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
        nonfinite (str): an inf/NaN gradient without a ``GradScaler``: ``"raise"`` (``RuntimeError`` naming the
            parameter, nothing updated), ``"skip"`` (the step is skipped, counted in :attr:`skipped_steps`) or
            ``"ignore"`` (no check, as AdamW). Default: ``"raise"``.
        bucket_numel (int): soft cap on the elements of one bucket. Default: 2**25.
        pin_memory (bool, optional): page-lock the host buffers; None: exactly the buckets on CUDA. Default: None.
        stream_grads (bool, optional): send each bucket's gradients to the host from backward hooks; None: the
            buckets on CUDA (all with ``delayed_update``; none with ``grads_reduced`` or under DDP). Default: None.
        release_grads (bool): with streaming, set ``p.grad`` to None once its copy is under way (then clip only
            with :meth:`clip_grad_norm_`, and no ``GradScaler``). Default: False.
        overlap_step (bool): update each streamed bucket during backward (needs ``nonfinite="ignore"``; no
            clipping or ``GradScaler``). Redundant with ``speculate``, which does the same exactly and with all
            three; kept for compatibility. Default: False.
        delayed_update (bool or int): apply each step's update one step late, overlapped with the next forward
            and backward (parameters one step stale). An int N >= 1: the first N steps are exact (AdamW's), the
            later ones delayed; docs/accuracy.md measures what the stale step costs.
            Default: False.
        process_group (ProcessGroup, optional): shard the state over this data-parallel group (ZeRO): 12/N bytes
            per parameter per rank. Every rank builds the same optimizer and calls ``step()``,
            ``clip_grad_norm_()`` and ``state_dict()`` together, with the same hyperparameters (checked at every
            step: a ``RuntimeError`` naming what differs) and the same number of streamed backward passes.
            Default: None.
        grads_reduced (bool): the gradients arrive already averaged (DDP): take this rank's slice (ZeRO-1).
            Needs ``process_group``. Default: False.
        timeout (timedelta or float, optional): the longest one collective may take (seconds if a number).
            Needs ``process_group``. Default: 30 minutes.
        state_dtype (torch.dtype): the moments' storage: ``torch.float32`` (exactly AdamW), ``torch.bfloat16``
            (4 B/param less) or ``torch.int8``: 8-bit block-wise moments (5.875 B/param less). See docs/accuracy.md
            for what that costs in loss; the state dict stays fp32. Default: torch.float32.
        speculate (bool, optional): update each streamed GPU bucket in a worker thread as soon as backward has
            sent its gradients, and keep the update at ``step()`` only if it is bit-exactly what ``step()``
            computes (same clip coefficient and loss scale, same hyperparameters, step not skipped, gradients
            unchanged); otherwise restore the bucket's saved state and update it at ``step()``. The result is
            always the non-speculative one, bit for bit; the CPU work moves into backward. Costs host memory for
            the state of the buckets speculated in a step (saved to undo it; at most +12 B per GPU parameter with
            fp32 state, see ``speculation_memory``) and a copy pass per speculated bucket.
            None: on wherever it applies (not with ``overlap_step``, ``delayed_update`` or a ``process_group``,
            which True refuses); CPU parameters are updated at ``step()`` either way. See docs/speculation.md.
            Default: None.
        gpu_fraction (float or str): the share of each param group's CUDA elements whose master and moments stay
            on the GPU ("twin flow"): the group's first buckets, whose gradients backward produces last, are
            updated there by torch's fused AdamW after the same checks as the rest (finite gradients, the clip
            coefficient), while the host updates the others. Costs 8 B per such parameter of GPU memory (fp32
            parameters, which become their own master), 12 B for bf16/fp16 ones; saves their host RAM, transfers
            and host kernel time. ``"auto"``: after the first step, as many of the last-arriving buckets as fit in
            the free GPU memory less ``gpu_margin_gib``. Not with compact ``state_dtype``, ``overlap_step`` or
            ``delayed_update``. See docs/twin-flow.md. Default: 0.
        gpu_margin_gib (float): with ``gpu_fraction="auto"``, the GPU memory (GiB) left free. Default: 2.0.
        speculation_memory (int, optional): the most bytes of host RAM speculation's undo buffers may hold: they
            come from one pool shared by the buckets of a step and reused by the next, and a bucket that finds no
            room is updated at ``step()`` (``speculation_stats.not_started["undo pool full"]``). None: sized to
            what the worker reaches during backward, learned step by step (the most it used in the last 10 steps,
            plus one bucket; the first step that speculates measures it), never more than the host can spare twice
            over. 0 turns speculation off; unused where speculation is off. ``opt.estimate_host_memory()`` shows
            what the pool holds (``undo``).
            Default: None.

    Attributes:
        skipped_steps (int): steps skipped because a gradient was not finite.
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: Union[float, torch.Tensor] = 1e-3,
        betas: Tuple[Union[float, torch.Tensor], Union[float, torch.Tensor]] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        decoupled_weight_decay: bool = True,
        nonfinite: str = "raise",
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        pin_memory: Optional[bool] = None,
        stream_grads: Optional[bool] = None,
        release_grads: bool = False,
        overlap_step: bool = False,
        delayed_update: Union[bool, int] = False,
        process_group: Optional[Any] = None,
        grads_reduced: bool = False,
        timeout: Optional[Any] = None,
        state_dtype: torch.dtype = torch.float32,
        speculate: Optional[bool] = None,
        gpu_fraction: Union[float, str] = 0.0,
        gpu_margin_gib: float = 2.0,
        speculation_memory: Optional[int] = None,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        self._start(params, ADAMW, defaults, nonfinite=nonfinite, bucket_numel=bucket_numel, pin_memory=pin_memory,
                    stream_grads=stream_grads, release_grads=release_grads, overlap_step=overlap_step,
                    delayed_update=delayed_update, process_group=process_group, grads_reduced=grads_reduced,
                    timeout=timeout, state_dtype=state_dtype, speculate=speculate, gpu_fraction=gpu_fraction,
                    gpu_margin_gib=gpu_margin_gib, speculation_memory=speculation_memory)

    @classmethod
    def _with_rule(cls, params: Iterable[Any], rule: Rule, defaults: Dict[str, Any], **options: Any
                   ) -> "OffloadOptimizer":
        """An optimizer that runs ``rule`` (another optimizer's update, see :func:`zero_offload.offload`) with
        ``defaults`` (that optimizer's) and the offload ``options`` (the constructor's, by name)."""
        unknown = sorted(set(options) - set(OFFLOAD_OPTIONS))
        if unknown:
            raise TypeError(f"unexpected offload option(s) {unknown}; the options are {', '.join(OFFLOAD_OPTIONS)}")
        opt = cls.__new__(cls)
        opt._start(params, rule, dict(defaults), **{**OFFLOAD_OPTIONS, **options})
        return opt

    def _start(self, params: Iterable[Any], rule: Rule, defaults: Dict[str, Any], *, nonfinite: str,
               bucket_numel: int, pin_memory: Optional[bool], stream_grads: Optional[bool], release_grads: bool,
               overlap_step: bool, delayed_update: Union[bool, int], process_group: Optional[Any],
               grads_reduced: bool, timeout: Optional[Any], state_dtype: torch.dtype, speculate: Optional[bool],
               gpu_fraction: Union[float, str], gpu_margin_gib: float, speculation_memory: Optional[int]) -> None:
        rule.check(defaults)
        delayed, exact_steps = delayed_setting(delayed_update)
        self.options = Options(nonfinite, bucket_numel, pin_memory, stream_grads, bool(release_grads),
                               bool(overlap_step), delayed, process_group is not None,
                               bool(grads_reduced), timeout, world_without_group(process_group),
                               state_dtype, exact_steps, speculate, gpu_fraction, gpu_margin_gib,
                               speculation_memory=speculation_memory).validate()
        if state_dtype not in rule.state_dtypes:  # (one the options take, that this rule's update does not)
            raise ValueError(f"state_dtype={state_dtype}: {rule.name}'s update keeps its state in "
                             f"{', '.join(map(str, rule.state_dtypes))} only")
        if self.options.gpu_tier and not rule.device_update:
            raise ValueError(f"gpu_fraction={gpu_fraction!r}: {rule.name} has no GPU update (the GPU part runs "
                             "torch's fused AdamW): leave gpu_fraction at 0")
        self._place_after_step = gpu_fraction == "auto"
        self._rule = rule
        self._transport = _make_transport(process_group, self.options)
        self._mode = _make_mode(self.options, self._transport, weak_method(self._early_update),
                               weak_method(self._speculation_inputs))
        self._streamer = GradStreamer(self._transport, self._mode)
        weakref.finalize(self, self._streamer.remove)
        self.skipped_steps = 0
        self._buckets: List[List[FlatBucket]] = []  # set before the base constructor calls add_param_group
        self._pending: Optional[PendingClip] = None
        self._scaled: Optional[bool] = None  # whether a GradScaler drove the last step() (see clip_grad_norm_)
        self._constructed = False
        super().__init__(params, defaults)
        # Parameters are rebound to their slots only once every group is in: a bad group raises with the model
        # exactly as it was.
        for bucket in chain.from_iterable(self._buckets):
            self._transport.bind(bucket)
        self._constructed = True
        logger.info("OffloadOptimizer: %d param groups, %d buckets: %s", len(self.param_groups),
                    sum(len(b) for b in self._buckets), self._held_host_memory().describe())

    @property
    def nonfinite(self) -> str:
        """The ``nonfinite`` policy; may be changed between steps (validated like the constructor's)."""
        return self.options.nonfinite

    @nonfinite.setter
    def nonfinite(self, policy: str) -> None:
        self.options = dataclasses.replace(self.options, nonfinite=policy).validate()

    # ------------------------------------------------------------------------------------------------ memory --
    def _held_host_memory(self) -> HostMemoryEstimate:
        total = HostMemoryEstimate(0, 0, {}, 0, 0)
        for bucket in chain.from_iterable(self._buckets):
            total = total + bucket.estimate()
        if isinstance(self._mode, Speculative) and self._mode.pool.held_bytes:  # (a row once it holds any)
            total = total + self._mode.pool.estimate()
        return total

    estimate_host_memory = PlanOrMeasure(plan_host_memory, _held_host_memory)

    def host_memory_estimate(self) -> HostMemoryEstimate:
        """Deprecated: ``opt.estimate_host_memory()`` (the same result, under the one documented name)."""
        warnings.warn("OffloadOptimizer.host_memory_estimate() is deprecated and will be removed: call "
                      "opt.estimate_host_memory() (same result)", FutureWarning, stacklevel=2)
        return self._held_host_memory()

    def host_buffers(self) -> List[Dict[str, torch.Tensor]]:
        """The flat buffers of every bucket (name -> tensor), for inspection and measurement (a device-tier
        bucket's, ``gpu_fraction``, are on its GPU)."""
        return [bucket.buffers() for bucket in chain.from_iterable(self._buckets)]

    # ---------------------------------------------------------------------------------------- param groups --
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group, as ``torch.optim.Optimizer.add_param_group``, and allocate its buckets. Every
        check runs before the group is added; on any error the optimizer is unchanged.

        Args:
            param_group (dict): ``params`` plus any hyperparameter overriding the defaults.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        self._rule.check({**self.defaults, **param_group})
        raw = param_group["params"]
        raw = [raw] if isinstance(raw, torch.Tensor) else raw
        if isinstance(raw, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering "
                            "of tensors in sets will change between runs. Please use a list instead.")
        raw = list(raw)
        tensors = [p[1] if isinstance(p, tuple) else p for p in raw]
        check_params(tensors)
        n_groups = len(self.param_groups)
        comm = self._transport.comm if self._transport.sharded else None
        if comm is not None:
            # The switches of optional state buffers (amsgrad's) decide which buffers state_dict() gathers.
            switches = tuple((f"{b.switch} of param group {n_groups}", bool(param_group.get(b.switch,
                             self.defaults[b.switch]))) for b in self._rule.buffers if b.switch)
            comm.check_same_params(tensors, n_groups, (*self.options.collective_layout(), *switches))
            if not comm.host_ok and any(p.device.type == "cpu" for p in tensors):
                raise ValueError("process_group runs NCCL alone, which moves CUDA tensors only, but param group "
                                 f"{n_groups} has parameters on the CPU: shard a CPU model over a gloo group")
        param_group["params"] = raw
        super().add_param_group(param_group)  # names, defaults, and the parameter-in-two-groups check
        try:
            buckets = allocate_group(self.param_groups[-1], n_groups, self.options,
                                     None if comm is None else (comm.world, comm.rank), self._rule)
        except BaseException:
            del self.param_groups[n_groups:]
            raise
        self._buckets.append(buckets)
        self._pending = None
        for bucket in buckets:
            streamed = self.options.streams(bucket.device) and not bucket.device_tier
            self._transport.add(bucket, streamed)
            if streamed:
                self._streamer.add(bucket, n_groups)
        if self._constructed:
            for bucket in buckets:
                self._transport.bind(bucket)
            logger.info("OffloadOptimizer: added param group %d, %d buckets: %s", n_groups, len(buckets),
                        sum((b.estimate() for b in buckets), HostMemoryEstimate(0, 0, {}, 0, 0)).describe())

    # ------------------------------------------------------------------------------------------------- step --
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Optional[Any]:
        """One AdamW update of every parameter that has a gradient.

        Every check (hyperparameters, gradients, non-finite policy) runs before the first parameter is written:
        an error leaves parameters and state unchanged.

        Args:
            closure (Callable, optional): re-evaluates the model and returns the loss (run with grad enabled).

        Returns:
            the closure's return value, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            with span(self._transport.timeline, "step", "step()"):
                self._step()
            if self._place_after_step:
                self._place_on_device()
        finally:
            self._end_step()
        return loss

    def _place_on_device(self) -> None:
        """``gpu_fraction="auto"``, after the first step: move the last-arriving CUDA buckets to the device tier,
        as many as fit in the GPU memory the step left free (what neither the allocator's peak of the step nor
        ``gpu_margin_gib`` takes). Sharded, every rank moves the same buckets (the fewest any rank has room for)."""
        self._place_after_step = False
        buckets = [b for b in chain.from_iterable(self._buckets) if not b.resident]
        if not buckets and not self._transport.sharded:  # (a CPU model: nothing to place; sharded, agree anyway)
            return
        arrived = [b for b in self._transport.arrivals if not b.resident]  # (streamed CPU buckets arrive too)
        # Last to arrive first; then those backward did not send, in construction order (backward would produce
        # the first ones last).
        order = list(reversed(arrived)) + [b for b in buckets if all(b is not a for a in arrived)]
        devices = {b.device for b in buckets}
        room = {d: _device_room(d, self.options.gpu_margin_gib) for d in devices}
        count = 0
        for bucket in order:
            cost = bucket.device_cost()
            if cost > room[bucket.device]:
                break
            room[bucket.device] -= cost
            count += 1
        if self._transport.sharded:
            count = int(self._transport.comm.all_reduce_host([count], torch.distributed.ReduceOp.MIN,
                                                            "the buckets gpu_fraction='auto' moves")[0])
        if not count:
            logger.info("OffloadOptimizer(gpu_fraction='auto'): no bucket fits on the GPU; all state stays on the host")
            return
        self._transport.synchronize()  # no copy may still read the host buffers being replaced
        moved = 0
        for bucket in order[:count]:
            try:
                bucket.move_to_device()
            except torch.cuda.OutOfMemoryError as exc:
                if self._transport.sharded:  # the other ranks may have moved it: the layouts would differ
                    raise
                logger.warning("OffloadOptimizer(gpu_fraction='auto'): the GPU ran out of memory moving %s (%s); "
                               "it and the buckets after it stay on the host", bucket.where, exc)
                break
            self._streamer.drop(bucket)
            self._transport.unstream(bucket)
            checkpoint.expose(self.state, bucket, [i for i, e in enumerate(bucket.exposed) if e])
            moved += 1
        logger.info("OffloadOptimizer(gpu_fraction='auto'): %d of %d GPU buckets moved to the GPU (%s)", moved,
                    len(buckets), self.gpu_state_bytes())

    def gpu_state_bytes(self) -> Dict[str, int]:
        """GPU memory held by the state on the device tier (``gpu_fraction``), in bytes by buffer, beyond the
        parameters' own (summed over its buckets; empty without a device tier)."""
        total: Dict[str, int] = {}
        for bucket in chain.from_iterable(self._buckets):
            for name, n in bucket.device_bytes().items():
                total[name] = total.get(name, 0) + n
        return total

    def _step(self) -> None:
        self._mode.settle()  # before _sync: an update running during backward may still write the state
        self._sync()
        # Set by torch.amp.GradScaler.step for optimizers with _step_supports_amp_scaling, deleted after.
        # grad_scale is the scale itself (None if the user already called scaler.unscale_); found_inf > 0: skip.
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        scaler = hasattr(self, "grad_scale") or hasattr(self, "found_inf")
        pending = self._take_clip(scaler and grad_scale is None)
        self._scaled = scaler
        hypers = [self._rule.hyper(g) for g in self.param_groups]
        # A GradScaler's unscale_ (signalled by grad_scale None) rewrote the gradients without a version bump.
        plans = pending.plans if pending is not None else self._receive(fresh=scaler and grad_scale is None)
        if scaler:  # a GradScaler finds infs in, and unscales, the gradients on the parameters
            self._mode.check_scaler()
            self._transport.check_scaler(plans)
        if found_inf is not None and float(found_inf) != 0.0:
            self.skipped_steps += 1
            return
        # GradScaler.unscale_ multiplies by this float32 reciprocal computed in double: same bits here.
        inv_scale = 1.0 if grad_scale is None else float(torch.as_tensor(grad_scale).double().reciprocal().float())
        check = found_inf is None and self.options.nonfinite != "ignore"
        # Sharded: checked to be the same on every rank.
        settings = agreed_settings(hypers, self.options.nonfinite) if self._transport.sharded else ()
        if pending is None:
            bad = self._transport.gather(plans, check=check, settings=settings)
        else:
            self._transport.agree(settings)
            bad = check and pending.nonfinite
        if bad:
            self._refuse_nonfinite(plans)
            return
        # A norm taken before the scaler's unscale is of scaled gradients; clip with the unscaled one.
        coef = 1.0 if pending is None else pending.coefficient(inv_scale if grad_scale is not None else 1.0)
        self._mode.observe(inv_scale, pending)
        self._mode.run(hypers, plans, inv_scale * coef, self.state)

    def _take_clip(self, unscaled: bool) -> Optional[PendingClip]:
        """The pending ``clip_grad_norm_``, redone if a GradScaler unscaled the gradients in place after it
        trusted the copies streamed in backward (the last step having had no scaler)."""
        pending, self._pending = self._pending, None
        if unscaled and pending is not None and not pending.fresh:
            logger.warning("OffloadOptimizer: a GradScaler drove this step for the first time since a step without "
                           "one; clip_grad_norm_ was redone on the unscaled gradients (the norm it returned this "
                           "step was of the scaled ones)")
            self._scaled = True
            self.clip_grad_norm_(pending.max_norm, pending.norm_type)
            pending, self._pending = self._pending, None
        return pending

    def _refuse_nonfinite(self, plans: Plans) -> None:
        self._transport.wait_all(plans)  # no copy may still be reading the gradients once step() returns
        if self.options.nonfinite == "skip":
            self.skipped_steps += 1
            return
        where = self._transport.describe_nonfinite(plans, [g.get("param_names") for g in self.param_groups])
        raise RuntimeError(f"OffloadOptimizer.step: non-finite gradient (inf or nan) in {where}; nothing was "
                           "updated. Pass nonfinite='skip' to skip such steps, or nonfinite='ignore' to apply them as "
                           "torch.optim.AdamW would.")

    def _end_step(self) -> None:
        """Forget what backward streamed for this step (after ``step()``, whatever its exit, or ``zero_grad``)."""
        self._streamer.reset()
        self._mode.reset()
        self._transport.reset()

    def _receive(self, fresh: bool = False) -> Plans:
        plans = []
        for buckets in self._buckets:
            group_plan = []
            for bucket in buckets:
                bg = self._transport.receive(bucket, fresh=fresh)
                self._mode.check_received(bg)
                group_plan.append(bg)
            plans.append(group_plan)
        return plans

    def _early_update(self, bucket: FlatBucket, group: int) -> None:
        """``overlap_step``: a bucket's update, run in the worker thread as soon as its gradients are sent
        (hyperparameters as they are now, which is what ``step()`` would read)."""
        self._sync()
        hyper = self._rule.hyper(self.param_groups[group])
        ensure_buffers(self.state, bucket, hyper)
        update_bucket(self._transport, bucket, self._transport.sent(bucket), None, hyper, 1.0, self.state)

    def _speculation_inputs(self, group: int) -> Tuple[Any, str]:
        """What a speculative update reads (in a backward hook): the group's hyperparameters as ``step()`` would
        read them now, and the ``nonfinite`` policy."""
        return self._rule.hyper(self.param_groups[group]), self.options.nonfinite

    @property
    def speculation_stats(self) -> Optional[Any]:
        """With speculation (``speculate``): a :class:`~zero_offload.speculation.SpeculationStats` counting the
        buckets speculated, committed and rolled back (with the reasons); None without."""
        return getattr(self._mode, "stats", None)

    def record_timeline(self, enabled: bool = True) -> None:
        """Start (or with ``enabled=False`` stop) recording a :class:`~zero_offload.timeline.Timeline` of the
        steps: host waits, kernels, copies issued, speculation's commits and rollbacks, by the host clock. Costs a
        few microseconds per bucket per step while on; nothing while off. See :meth:`timeline`."""
        if not enabled:
            self._transport.timeline = None
        elif self._transport.timeline is None:
            index = {id(b): i for i, b in enumerate(chain.from_iterable(self._buckets))}
            self._transport.timeline = Timeline(index)

    def timeline(self) -> List[TimelineEvent]:
        """The events recorded since :meth:`record_timeline` or the last call, by start time (and forgets them).
        ``zero_offload.timeline.breakdown`` sums them per kind; ``chrome_trace`` writes a Chrome trace."""
        if self._transport.timeline is None:
            return []
        return self._transport.timeline.take()

    def flush(self) -> None:
        """With ``delayed_update``: apply the last ``step()``'s pending update now (saving does not). Else: nothing."""
        self._mode.flush(self.state)

    # ------------------------------------------------------------------------------------------- gradients --
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. With ``set_to_none=False``, existing gradients of CPU parameters
        become zeroed views of the flat gradient buffer, so backward accumulates into it and ``step()`` copies none.

        Args:
            set_to_none (bool): set gradients to None instead of zeroing them. Default: True.
        """
        self._pending = None
        self._end_step()  # gradients streamed since the last step are discarded with the rest
        if set_to_none:
            super().zero_grad(set_to_none=True)
        else:
            self._transport.keep_zero_grads()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> torch.Tensor:
        """Clip the gradients of all parameters by their total norm, like ``torch.nn.utils.clip_grad_norm_``,
        fused into the next ``step()``: the coefficient ``min(max_norm / (total_norm + 1e-6), 1)`` multiplies the
        gradient inside the kernel instead of rewriting ``.grad`` (which is left as it was).

        It brings the gradients to the host now (``step()`` reuses them): call it right before ``step()`` (or
        ``scaler.step``); ``zero_grad()`` cancels it. Streamed gradients still on their parameters are read again
        while a ``GradScaler`` may have unscaled them in place (a step it drove, or the first), which leaves no
        trace in their version counters; a scaler that first appears later makes ``step()`` clip again.

        Args:
            max_norm (float): max norm of the gradients.
            norm_type (float): type of the p-norm: 2, ``inf``, or any finite p > 0. Default: 2.0.
            error_if_nonfinite (bool): raise ``RuntimeError`` if the total norm is nan or inf. Default: False.
                Otherwise a non-finite norm is left to the ``nonfinite`` policy at ``step()``.

        Returns:
            Tensor: the total norm of the gradients (viewed as a single vector), float32, on the device of the
            first parameter with a gradient.
        """
        norm_type = float(norm_type)
        if not (norm_type == math.inf or (math.isfinite(norm_type) and norm_type > 0)):
            raise ValueError(f"Invalid norm_type: {norm_type} (expected 2.0, inf or a finite p > 0)")
        max_norm = float(max_norm)
        if self.options.overlap_step:
            raise RuntimeError("OffloadOptimizer(overlap_step=True) cannot clip: buckets are updated during backward, "
                               "before the total norm exists. Turn overlap_step off to clip.")
        fresh = self._scaled is not False
        plans = self._receive(fresh=fresh)
        first = next((bg.bucket.params[i] for bg in chain.from_iterable(plans)
                      for i, has in enumerate(bg.present) if has), None)
        settings = agreed_settings((), self.options.nonfinite, (max_norm, norm_type)) if self._transport.sharded else ()
        self._transport.gather(plans, clipping=True, settings=settings)
        total, nonfinite = self._transport.total_norm(plans, norm_type)
        nonfinite = nonfinite or not math.isfinite(total)
        if error_if_nonfinite and nonfinite:
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
                "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        self._pending = PendingClip(plans, max_norm, norm_type, total, nonfinite, fresh)
        device = first.device if first is not None else torch.device("cpu")
        return torch.tensor(total, dtype=torch.float32, device=device)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradient accumulation, like ``DistributedDataParallel.no_sync``: backward passes inside it keep their
        gradients in ``.grad`` instead of streaming them; only the last micro-batch's, outside it, sends them."""
        return self._streamer.no_sync()

    # ------------------------------------------------------------------------------------------- state dict --
    def state_dict(self) -> Dict[str, Any]:
        """AdamW's state dict: views of the host buffers (compact moments: fp32 copies, a bucket at a time); saving
        changes nothing (``delayed_update``: the state after the pending update, with ``param``; see
        docs/checkpoints.md). Sharded: a collective gathering the full state onto *every* rank: prefer
        :meth:`sharded_state_dict` for large models.
        Entries of ``opt.state`` that are not a parameter's (a hook's ``opt.state["epoch"] = 3``) are carried as
        AdamW carries them. The pre-hooks run first and the post-hooks see the finished dict."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._sync()
        ahead = self._mode.ahead()  # on CUDA it waits for the worker that writes the buffers
        with _hooks_set_aside(self):  # torch's own packing of the param groups, without running the hooks twice
            sd = super().state_dict()
        if self._transport.sharded:  # gathered, then the entries that are no parameter's
            self._transport.agree_state(chain.from_iterable(self._buckets))
            state = checkpoint.full_state(self.param_groups, self._buckets, self._transport.comm.all_gather_host)
            state.update((k, v) for k, v in self.state.items() if not isinstance(k, torch.Tensor))
            sd["state"] = state
        else:  # entries as plain dicts
            sd["state"] = {k: dict(v) if isinstance(v, checkpoint.StateEntry) else v for k, v in sd["state"].items()}
        checkpoint.add_compact_moments(sd["state"], self.param_groups, self._buckets)
        sd["state"].update(checkpoint.ahead_entries(self.param_groups, self._buckets, ahead))
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def _sync(self) -> None:
        """Refuse edited param lists; apply the user's edits of ``opt.state`` (after a pending update)."""
        checkpoint.check_param_lists(self.param_groups, self._buckets)
        self.state = checkpoint.sync_state(self.state, self._buckets, self.flush)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict from this class or from ``torch.optim.AdamW``/``Adam``, into the host buffers in place.

        Everything is validated first; an invalid state dict raises ``ValueError`` and changes nothing. Parameters
        without an entry start fresh, as in AdamW; a missing ``master`` is taken from the parameter. With a
        ``process_group``, each rank copies only the piece it owns: no collective.

        Args:
            state_dict (dict): with ``"state"`` and ``"param_groups"``, as returned by ``state_dict()``.
        """
        checkpoint.check_format(state_dict)
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        plan = checkpoint.plan_load(self.param_groups, self._buckets, state_dict, self._rule)
        # Allocate before changing anything: an allocation failure must leave the optimizer as it was. (A new
        # buffer, amsgrad's, is zero-filled and not yet in any state entry, so adding it changes nothing visible.)
        for group, buckets in zip(plan.groups, self._buckets):
            for bucket in buckets:
                bucket.ensure_buffers(self._rule.needed(self._rule.hyper(group)))
        self._quiesce()
        checkpoint.apply_load(self.state, self._buckets, plan)
        self.param_groups = plan.groups
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _quiesce(self) -> None:
        """Before the state is replaced: no update running, none pending, no copy reading the buffers."""
        self._mode.settle()
        self._mode.drop()  # a pending update of the old trajectory
        self._transport.synchronize()
        self._pending = None
        self._end_step()

    def sharded_state_dict(self) -> Dict[str, Any]:
        """The optimizer state for ``torch.distributed.checkpoint`` (DCP), nothing gathered and no collective: a
        run saved on N ranks resumes on M ranks, or in one process. Each state tensor is 1-D (the parameter's
        elements in memory order), a :class:`~zero_offload.checkpoint.FlatPiece` holding this rank's piece, a view of
        the host buffers, so ``dcp.load`` writes the state in place; then call :meth:`load_sharded_state_dict`. With
        ``delayed_update``, as :meth:`state_dict`, with ``param`` in every entry. See docs/multi-gpu.md."""
        self._sync()
        return checkpoint.sharded_state_dict(self.param_groups, self._buckets, self._mode.ahead(),
                                             param=self.options.delayed_update)

    def load_sharded_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Finish loading a :meth:`sharded_state_dict` that ``dcp.load`` filled (moments and masters are in the
        buffers already): validate, then apply the step counts and hyperparameters. Local.

        Args:
            state_dict (dict): the dict returned by :meth:`sharded_state_dict` after ``dcp.load`` filled it.
        """
        groups, steps, tensors = checkpoint.plan_sharded_load(self.param_groups, self._buckets, state_dict,
                                                              self._rule, self.options.delayed_update)
        self._mode.drop()  # dcp.load has already replaced the state it would update
        self._transport.synchronize()
        self._pending = None
        checkpoint.apply_sharded_load(self.state, self._buckets, steps, tensors)
        self.param_groups = groups

    def __getstate__(self) -> Dict[str, Any]:
        raise TypeError("OffloadOptimizer cannot be pickled or deep-copied: its state lives in host buffers bound to "
                        "the parameters. Save and restore it with state_dict() / load_state_dict().")


@contextlib.contextmanager
def _hooks_set_aside(opt: torch.optim.Optimizer):
    """``torch.optim.Optimizer.state_dict`` without its hooks, which :meth:`OffloadOptimizer.state_dict` runs
    around its own completion of the dict."""
    pre, post = opt._optimizer_state_dict_pre_hooks, opt._optimizer_state_dict_post_hooks
    opt._optimizer_state_dict_pre_hooks, opt._optimizer_state_dict_post_hooks = type(pre)(), type(post)()
    try:
        yield
    finally:
        opt._optimizer_state_dict_pre_hooks, opt._optimizer_state_dict_post_hooks = pre, post


def _device_room(device: torch.device, margin_gib: float) -> int:
    """Bytes of ``device`` memory the state may take: free memory plus what the caching allocator holds, less the
    step's peak allocation (which the next step needs again) and the margin."""
    free, _ = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    return int(free + held - torch.cuda.max_memory_allocated(device) - margin_gib * 2**30)


def _make_mode(options: Options, transport: Transport, early_update: Callable[[FlatBucket, int], None],
               inputs: Callable[[int], Tuple[Any, str]]) -> Immediate:
    """The schedule ``options`` ask for (``inputs``: what speculation reads of a group, see
    :class:`~zero_offload.speculation.Speculative`)."""
    if options.overlap_step:
        return Overlap(transport, early_update)
    if options.delayed_update:
        return Delayed(transport, options.delayed_exact_steps)
    if options.speculates:
        return Speculative(transport, inputs, check_speculation_memory(options.speculation_memory))
    return Immediate(transport)


def _make_transport(process_group: Optional[Any], options: Options) -> Transport:
    if process_group is None:
        return Transport(release=options.release_grads)
    from zero_offload.distributed import DEFAULT_TIMEOUT, Comm, ShardedTransport  # only with a process group
    timeout = DEFAULT_TIMEOUT if options.timeout is None else options.timeout
    return ShardedTransport(Comm(process_group, timeout, options.grads_reduced,
                                 compact_state=options.state_dtype != torch.float32), release=options.release_grads)



# The offload options and their defaults: the constructor's keyword-only arguments that are not AdamW's (what
# zero_offload.offload takes besides the wrapped class's own hyperparameters).
OFFLOAD_OPTIONS: Dict[str, Any] = {
    name: p.default for name, p in inspect.signature(OffloadOptimizer.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in inspect.signature(torch.optim.AdamW).parameters
    and name not in ADAMW.defaults}

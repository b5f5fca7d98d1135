r"""``OffloadOptimizer``: ``torch.optim.AdamW`` with its state in flat host buffers and a fused CPU kernel.

This module holds the ``torch.optim`` conventions only (defaults, param_groups, hyperparameters read at every
step, hooks, ``state_dict``). Where bytes live is :mod:`zero_offload.buckets` and :mod:`zero_offload.host_memory`;
the arithmetic is :func:`zero_offload.functional.cpu_adam_`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import weakref
from copy import deepcopy
from itertools import chain
from numbers import Real
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from zero_offload import functional
from zero_offload.buckets import ALIGN, BucketLayout, FlatBucket, ShardedBucket, align_up, plan_buckets
from zero_offload.grad_stream import BucketStream, GradStreamer
from zero_offload.host_memory import HostMemoryEstimate, available_host_bytes, estimate_bucket, format_bytes

__all__ = ["OffloadOptimizer"]

logger = logging.getLogger("zero_offload")

NONFINITE_POLICIES = ("raise", "skip", "ignore")
# 32 Mi elements (128 MiB of fp32 per buffer): big enough that a kernel call's fixed cost is noise, small enough
# that with the model on a GPU the copies of one bucket overlap the CPU update of the previous one.
DEFAULT_BUCKET_NUMEL = 1 << 25
_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    """AdamW's validation, with AdamW's messages (so code matching on them keeps working)."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (expected a pair)")
    for i, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor) and beta.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


@dataclasses.dataclass(frozen=True)
class _Hyper:
    """One group's hyperparameters as plain floats, read at the start of a step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool
    decoupled: bool

    @staticmethod
    def read(group: Dict[str, Any]) -> "_Hyper":
        _check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        b1, b2 = group["betas"]
        return _Hyper(float(group["lr"]), float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]),
                      bool(group["amsgrad"]), bool(group["maximize"]), bool(group["decoupled_weight_decay"]))


# Per group, its buckets, each with the gradients collected from its parameters (None where absent) and, once
# gathered, what a CPU bucket's kernel reads in place of its flat gradient buffer (None: that buffer).
_Grads = List[Optional[torch.Tensor]]
_Plan = List[List[Tuple[FlatBucket, _Grads, Optional[_Grads]]]]


@dataclasses.dataclass
class _PendingClip:
    """What ``clip_grad_norm_`` left for the next ``step``: gradients already gathered, and the norm."""

    plans: _Plan
    max_norm: float
    norm_type: float
    total_norm: float
    nonfinite: bool
    fresh: bool  # every gradient still on a parameter was read again (see clip_grad_norm_)


class OffloadOptimizer(torch.optim.Optimizer):
    r"""AdamW (or Adam) whose fp32 master weights and moments live in flat host buffers, updated by a fused SIMD
    CPU kernel: a drop-in for ``torch.optim.AdamW`` that takes the optimizer state off the GPU.

    .. math::
        \begin{aligned}
        g_t &\leftarrow s\,\nabla_\theta f_t(\theta_{t-1}) \quad (-\text{ if maximize};\; s = \text{loss-scale
            inverse} \times \text{clip coefficient}) \\
        \theta_t &\leftarrow \theta_{t-1}(1 - \gamma\lambda) \ \text{(decoupled)} \quad\text{or}\quad
            g_t \leftarrow g_t + \lambda\theta_{t-1} \ \text{(Adam's L2)} \\
        m_t &\leftarrow \beta_1 m_{t-1} + (1-\beta_1) g_t, \qquad
            v_t \leftarrow \beta_2 v_{t-1} + (1-\beta_2) g_t^2 \\
        \hat v_t &\leftarrow \max(\hat v_{t-1}, v_t) \ \text{if amsgrad else}\ v_t \\
        \theta_t &\leftarrow \theta_t - \frac{\gamma}{1-\beta_1^t}\,
            \frac{m_t}{\sqrt{\hat v_t}/\sqrt{1-\beta_2^t} + \epsilon}
        \end{aligned}

    operation for operation ``torch.optim.AdamW(foreach=False)``'s arithmetic (bias corrections in double), so an
    fp32 model follows AdamW's trajectory to within rounding.

    **Where things live.** Per parameter group, parameters are packed into buckets (one per device and dtype, cut
    at ``bucket_numel`` elements) of flat fp32 buffers, every parameter's slot 64-element aligned: ``master``,
    ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``), plus a gradient buffer in the parameters' dtype and, for
    bf16/fp16 parameters, a staging buffer the kernel writes the rounded update into. One kernel call updates a
    whole bucket. Then:

    * fp32 parameters on CPU become views of their master slot (``p.data`` is rebound at construction): updated
      in place, nothing copied back, no extra master;
    * bf16/fp16 parameters on CPU become views of their staging slot; the fp32 master is kept beside them, so a
      bf16 model trains with fp32 accuracy in the optimizer;
    * (a consequence of the two above: CPU parameters of one bucket share one storage, so ``torch.save`` of a
      single such parameter writes the whole bucket; ``clone()`` it first. Build the optimizer after moving or
      casting the model, and do not rebind ``p.data`` afterwards: ``step()`` detects it and raises);
    * parameters on CUDA stay there: their gradients are streamed to page-locked host buffers during backward
      (below); ``step()`` waits on one event per bucket, updates it, and copies the fp32 master (fp32 params) or
      the bf16/fp16 staging copy back asynchronously on an upload stream, bucket by bucket (bucket k's upload
      overlaps bucket k+1's update); the compute stream waits for those copies (an event, not a device
      synchronisation) before it next touches the params.

    Buffers are allocated once, at their exact size (no power-of-two rounding), page-locked only where they take
    part in host<->device copies. :meth:`estimate_host_memory` gives their size before anything is allocated; the
    constructor logs it (logger ``"zero_offload"``, INFO). For an fp32 model that is 12 bytes per parameter
    (master and two moments; the master *replaces* a CPU parameter's own storage) plus the gradient buffer.

    A separate master is initialised from its parameter at the parameter's first step, and again whenever the
    parameter was changed outside the optimizer (e.g. ``model.load_state_dict``) to a value other than the master
    rounded to the parameter's dtype; so loading weights after building the optimizer works.

    **Gradients.** Parameters whose ``.grad`` is None are skipped exactly as AdamW skips them (no step count,
    moment or decay update). Sparse gradients are an error. With the model on CPU, ``zero_grad(set_to_none=False)``
    makes every existing ``.grad`` a view of the flat gradient buffer, so backward accumulates into it and
    ``step()`` copies nothing; with ``set_to_none=True`` (the default) the kernel reads each fresh gradient where
    it is (only a gradient laid out unlike its parameter, e.g. not contiguous, is copied into its slot first).

    **Streaming gradients in backward** (``stream_grads``, on by default for CUDA parameters). A hook on every
    parameter (``register_post_accumulate_grad_hook``) notices when all gradients of a bucket are final and copies
    them device-to-host on a dedicated stream that first waits for the compute stream, while backward goes on;
    the bucket's squared norm is computed on the GPU alongside, so clipping and the inf/nan check need one
    synchronisation per step. Buckets complete in backward order; one whose parameters did not all get a gradient
    is sent when backward ends. See :mod:`zero_offload.grad_stream`.

    * ``release_grads=True`` then sets ``p.grad`` to None (its memory handed safely to the copy stream), so the
      GPU never holds all the gradients: peak GPU memory is the parameters, activations and the buckets in
      flight. The price: nothing outside this optimizer sees gradients after backward, so clip with
      :meth:`clip_grad_norm_` (``torch.nn.utils.clip_grad_norm_`` would find none and clip nothing), and a
      ``GradScaler`` cannot be used (it raises, naming the option). Default False: gradients stay on the
      parameters, anything may read or edit them, and one edited in place after its copy (clipping, unscaling)
      is copied again at ``step()``.
    * Gradient accumulation: run every micro-batch but the last under :meth:`no_sync` and the gradients
      accumulate on the GPU in ``.grad`` (one transfer per step, but the GPU holds the gradients between
      micro-batches). Without it each backward streams, and the host buffer sums the micro-batches (the GPU holds
      none with ``release_grads``; one transfer per micro-batch, plus a landing buffer the size of the bucket's
      gradients on the host). Both are exact: fp32 additions give the same bits on either side.
    * ``overlap_step=True`` also starts each bucket's CPU update in a worker thread as soon as its gradients are
      on the host, during backward. Nothing may need the whole step's gradients first: no clipping, no
      ``GradScaler``, ``nonfinite="ignore"``, and :meth:`no_sync` for all but the last micro-batch (each is
      refused with an error saying so).
    * ``delayed_update=True`` is ZeRO-Offload's delayed parameter update: ``step()`` applies the *previous*
      step's update (sending its parameters back) and starts this step's in the worker thread, where it runs
      during the next forward and backward; the model therefore always trains on parameters one step stale.
      Hyperparameters, clipping and loss scaling of a step apply to its own gradients. It takes a second
      gradient buffer on the host. :meth:`flush` (and ``state_dict()``) applies the pending update; with the
      model on CPU the update runs at the next ``step()`` (the parameters are the masters there).
    * With the model on CPU, ``stream_grads=True`` runs the same ordering with plain copies (this is what
      CPU-only tests exercise); by default CPU gradients are read where they are at ``step()`` instead, which
      moves fewer bytes.

    **Clipping.** :meth:`clip_grad_norm_` has ``torch.nn.utils.clip_grad_norm_``'s semantics and return value,
    but does not rewrite the gradients: the coefficient is applied inside the kernel at the next ``step()``. It
    brings the gradients to the host, so call it after the last backward and right before ``step()``.
    ``torch.nn.utils.clip_grad_norm_`` on the model keeps working too (gradients stay on the parameters).

    **Mixed precision.** ``torch.amp.GradScaler`` drives this optimizer through PyTorch's
    ``_step_supports_amp_scaling`` protocol: the unscale is folded into the kernel's gradient multiplier (no
    separate pass), and the step is skipped when the scaler found an inf/NaN. ``scaler.unscale_(opt)`` before
    clipping works as with AdamW; so does clipping *without* it, which this optimizer can fuse too: the norm
    returned is then that of the scaled gradients, and the clip applied at the step uses the unscaled norm.

    **Non-finite gradients without a scaler** follow ``nonfinite``. The check is ``functional.grad_sq_norm``'s
    flag over each bucket's host gradients (the flat buffer, or a CPU bucket's gradient tensors where they are),
    taken right after that bucket's gradients were gathered, and free when :meth:`clip_grad_norm_` already
    computed it. Every bucket is checked before the first one is updated.

    **Sharded over a process group** (``process_group``): each bucket is padded to a multiple of ``N * 64``
    elements and rank ``r`` owns the ``r``-th of N equal contiguous shards (parameters may straddle shards). Every
    bucket's gradients are flattened and reduce-scattered (summed; the 1/N is folded into the kernel's gradient
    multiplier) and only the owned shard reaches the host: from the backward hooks as each bucket completes when
    gradients are streamed (the default on CUDA; buckets launch in a fixed order, the same on every rank), else
    at ``step()``, all buckets' collectives in flight together. The kernel updates the shard, and the updated
    shard is all-gathered into the full parameters while the next bucket is updated. One all-reduce of a small
    tensor per step combines the gradient norm, the non-finite check and which parameters have a gradient on any
    rank (a parameter with a gradient on some ranks only is updated on all, the others' gradients counting as
    zero); ``clip_grad_norm_`` with ``norm_type=inf`` or another p adds one more. ``opt.state[p]`` then holds
    the step and this rank's piece of each state tensor (1-D); :meth:`state_dict` gathers the full state and
    :meth:`sharded_state_dict` gives the sharded one for ``torch.distributed.checkpoint``. With a
    ``GradScaler``, every rank must see the same ``found_inf``: true under DDP; otherwise use
    ``torch.distributed.fsdp.ShardedGradScaler`` and call ``scaler.unscale_(opt)`` before ``scaler.step(opt)``.
    A gradient changed after backward streamed it (an in-place clip or unscale; the fused :meth:`clip_grad_norm_`
    re-reads gradients kept on the parameters too, at the first step and at steps a ``GradScaler`` drives) makes
    every rank reduce-scatter that bucket again at ``step()``: correct, but the streamed collective was wasted,
    so stream with ``release_grads=True`` and :meth:`clip_grad_norm_` for the full overlap.

    **State dict.** AdamW's format: per parameter ``step`` (0-dim float32 CPU tensor), ``exp_avg``,
    ``exp_avg_sq`` (and ``max_exp_avg_sq``), shaped like the parameter, plus ``master`` (fp32) for bf16/fp16
    parameters. The tensors are views of the host buffers (as AdamW's are its live state); modify them in place
    only. AdamW checkpoints load here and continue the same trajectory, and the reverse. :meth:`load_state_dict`
    validates everything before changing anything and copies into the buffers in place, so state stays in
    (pinned) host memory. The optimizer itself cannot be pickled or deep-copied: use ``state_dict()``.

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
        foreach (bool, optional): accepted for AdamW compatibility and ignored: every update here is one fused
            call per bucket. Kept in the param groups as given. Default: None.
        capturable (bool): must be False: ``step()`` synchronises with the host, which CUDA-graph capture
            forbids. Default: False.
        differentiable (bool): must be False: the update runs in a host kernel, outside autograd. Default: False.
        fused (bool, optional): accepted and ignored like ``foreach`` (this optimizer is always fused).
            Default: None.
        decoupled_weight_decay (bool): True is AdamW; False is ``torch.optim.Adam``'s L2 penalty added to the
            gradient. Default: True.
        nonfinite (str): what ``step()`` does with an inf/NaN gradient when no ``GradScaler`` drives it:
            ``"raise"`` raises ``RuntimeError`` naming the parameter, with nothing updated; ``"skip"`` skips the
            whole step (counted in :attr:`skipped_steps`); ``"ignore"`` does no check and lets the values into the
            update, as AdamW does (saves one read of the gradients). Default: ``"raise"``.
        bucket_numel (int): soft cap on the elements of one bucket; a larger parameter gets its own bucket.
            Default: 2**25.
        pin_memory (bool, optional): page-lock the host buffers. None pins exactly the buckets whose parameters
            are on CUDA (pinning buys nothing without transfers and locks RAM); True pins every bucket (needs
            CUDA); False pins none (host<->device copies then run synchronously). Default: None.
        process_group (ProcessGroup, optional): shard the state over this data-parallel group (ZeRO; e.g.
            ``torch.distributed.group.WORLD``): each rank keeps 1/N of every bucket's masters and moments, 12/N
            bytes per parameter. Every rank must build the optimizer over the same parameter shapes in the same
            order (checked: ``ValueError`` on every rank otherwise) and call ``step()``, ``clip_grad_norm_()``
            and ``state_dict()`` together. Rank 0's initial parameters are broadcast to the others at
            construction, as DDP does. Default: None (no sharding: the single-process behaviour).
        grads_reduced (bool): the gradients are already averaged over the group, as under
            ``DistributedDataParallel``: each rank takes its slice instead of reduce-scattering (ZeRO-1, like
            ``torch.distributed.optim.ZeroRedundancyOptimizer``). False (the default) reduce-scatters and
            averages: right for a model that is not DDP-wrapped, and still correct (averaging identical averages,
            one collective wasted) under DDP. Needs ``process_group``. Default: False.
        timeout (timedelta or float, optional): the longest any one collective may take (seconds if a number);
            past it, or on a collective's failure, ``RuntimeError`` names this rank, the collective and the
            bucket (param group and bucket index). Needs ``process_group``. Default: 30 minutes. (Under NCCL the
            process group's own watchdog, 10 minutes unless ``init_process_group(timeout=...)`` says otherwise,
            may end the process first: keep this below it.)
        stream_grads (bool, optional): copy (sharded: reduce-scatter) each bucket's gradients to the host from
            backward hooks, as soon as they are final (see above). None streams the buckets on CUDA (and all, with
            ``delayed_update``), except with ``grads_reduced``, or when ``torch.distributed`` is initialised and no
            ``process_group`` is given (DDP averages gradients only as backward ends; then ``release_grads``,
            ``overlap_step`` and ``delayed_update`` are refused); True streams every bucket; False gathers
            gradients at ``step()``. Default: None.
        release_grads (bool): with streaming, set ``p.grad`` to None once its copy is under way, so the GPU never
            holds all gradients; then clip only with :meth:`clip_grad_norm_`, and no ``GradScaler``.
            Default: False.
        overlap_step (bool): update each streamed bucket during backward, as soon as its gradients are on the
            host (needs ``nonfinite="ignore"``; no clipping or ``GradScaler``). Default: False.
        delayed_update (bool): apply each step's update one step late, overlapped with the next forward and
            backward (parameters one step stale; a second host gradient buffer). Default: False.

    Attributes:
        skipped_steps (int): steps skipped because a gradient was not finite (``nonfinite="skip"`` or a
            ``GradScaler``'s inf/NaN).
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
        delayed_update: bool = False,
        process_group: Optional[Any] = None,
        grads_reduced: bool = False,
        timeout: Optional[Any] = None,
    ) -> None:
        _check_hparams(lr, betas, eps, weight_decay)
        if not ((isinstance(betas[0], float) and isinstance(betas[1], float))
                or (isinstance(betas[0], torch.Tensor) and isinstance(betas[1], torch.Tensor))):
            raise ValueError("betas must be either both floats or both Tensors")
        if capturable:
            raise ValueError("OffloadOptimizer does not support capturable=True: step() synchronises with the host "
                             "to run the CPU kernel, which CUDA-graph capture forbids")
        if differentiable:
            raise ValueError("OffloadOptimizer does not support differentiable=True: the update runs in a host "
                             "kernel outside autograd")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"Invalid nonfinite policy: {nonfinite!r} "
                             f"(expected one of {', '.join(NONFINITE_POLICIES)})")
        if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
            raise ValueError(f"Invalid bucket_numel: {bucket_numel!r} (a positive number of elements)")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA, which is not available")
        if overlap_step and delayed_update:
            raise ValueError("overlap_step and delayed_update are alternatives: pass at most one of them")
        if (overlap_step or delayed_update) and stream_grads is False:
            raise ValueError(f"{'overlap_step' if overlap_step else 'delayed_update'}=True needs the gradients "
                             "streamed in backward: leave stream_grads at None or True")
        if overlap_step and nonfinite != "ignore":
            raise ValueError(
                "overlap_step=True updates each bucket as soon as its gradients are complete, before later buckets' "
                "gradients exist, so a whole step cannot be skipped or refused on an inf/nan: pass "
                "nonfinite='ignore' with it"
            )
        # zero_offload.distributed.Comm when the state is sharded over process_group, else None.
        self._shard: Optional[Any] = None
        self._grad_stats: Optional[Any] = None
        if process_group is not None:
            from zero_offload.distributed import DEFAULT_TIMEOUT, Comm

            self._shard = Comm(process_group, DEFAULT_TIMEOUT if timeout is None else timeout, grads_reduced)
        elif grads_reduced or timeout is not None:
            raise ValueError("grads_reduced and timeout only apply with a process_group, and none was given")
        if process_group is not None and (overlap_step or delayed_update):
            raise ValueError("overlap_step and delayed_update are not yet combined with a process_group: a sharded "
                             "bucket is updated at step(), after the gradient statistics are agreed over the group")
        # torch.distributed's world size when it is initialised and no process_group was given (else 1): the
        # model is then likely DDP-wrapped, and DDP averages the gradients only as backward ends.
        self._outside_world = _world_without_group(process_group)
        if self._outside_world > 1 and stream_grads is None and (release_grads or overlap_step or delayed_update):
            option = "release_grads" if release_grads else "overlap_step" if overlap_step else "delayed_update"
            raise ValueError(
                f"{option}=True works on gradients streamed from backward, but torch.distributed is initialised "
                f"(world size {self._outside_world}) and no process_group was given. If the model is "
                "DistributedDataParallel, DDP averages the gradients only when backward ends, after the hooks that "
                "would stream them, so they are taken at step() instead and this option cannot apply. Drop it; or "
                "drop DDP and pass process_group= to shard the state with gradients streamed (ZeRO-2); or pass "
                "stream_grads=True if nothing reduces this model's gradients after backward."
            )
        if grads_reduced and stream_grads:
            raise ValueError("stream_grads=True cannot take gradients already reduced (grads_reduced=True): DDP "
                             "writes its averages into .grad only when backward ends, after the hooks that stream "
                             "them. Leave stream_grads at None with DDP (gradients are then taken at step()).")
        self.nonfinite = nonfinite
        self.bucket_numel = bucket_numel
        self.pin_memory = pin_memory
        self.skipped_steps = 0
        # Set before the base constructor, which calls add_param_group.
        self._buckets: List[List[FlatBucket]] = []
        # Per device: the stream of the copies off the GPU (and a sharded bucket's reduce-scatter), and the stream
        # of the uploads back (and all-gathers). Two, so that uploads (overlap_step's during backward, a delayed
        # update's while the last buckets' gradients still come down) do not queue behind the other direction.
        self._streams: Dict[torch.device, Any] = {}
        self._upload_streams: Dict[torch.device, Any] = {}
        self._pending: Optional[_PendingClip] = None
        # Whether a GradScaler drove the last step() (None before the first): see clip_grad_norm_.
        self._scaled: Optional[bool] = None
        self._constructed = False
        self.stream_grads = stream_grads
        self.release_grads = bool(release_grads)
        self.overlap_step = bool(overlap_step)
        self.delayed_update = bool(delayed_update)
        # The update of the last step's gradients still to be applied (delayed_update), and its worker job.
        self._delayed: Optional[_Delayed] = None
        self._streamer = GradStreamer(release=self.release_grads, stream_for=_weak(self._stream),
                                      update=_weak(self._early_update) if overlap_step else None)
        weakref.finalize(self, self._streamer.remove)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)
        # Parameters are rebound to their slots only once every group is in: a bad group raises with the model
        # exactly as it was.
        for bucket in chain.from_iterable(self._buckets):
            bucket.bind()
        self._constructed = True
        est = self.host_memory_estimate()
        logger.info("OffloadOptimizer: %d param groups, %d buckets: %s", len(self.param_groups),
                    sum(len(b) for b in self._buckets), est.describe())

    # ------------------------------------------------------------------------------------------------ memory --
    @staticmethod
    def estimate_host_memory(
        params: Iterable[Any],
        *,
        amsgrad: bool = False,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        pin_memory: Optional[bool] = None,
        world_size: int = 1,
        delayed_update: bool = False,
    ) -> HostMemoryEstimate:
        """Host RAM an ``OffloadOptimizer`` over ``params`` will allocate, computed without allocating anything
        (same bucket layout as the real allocation, so exact).

        Args:
            params (iterable): as for the constructor (a group dict's own ``amsgrad`` is honoured).
            amsgrad (bool): the default for groups that do not set it. Default: False.
            bucket_numel (int): as for the constructor. Default: 2**25.
            pin_memory (bool, optional): as for the constructor. Default: None.
            world_size (int): the size of the ``process_group`` the state will be sharded over: the estimate is
                then per rank. Default: 1.
            delayed_update (bool): as for the constructor (one more gradient buffer). Default: False.

        Returns:
            HostMemoryEstimate: bytes by buffer, ``total_bytes``, ``bytes_per_param``, ``pinned_bytes``.
        """
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        total = HostMemoryEstimate(0, 0, {}, 0, 0)
        for g in groups:
            ps = g["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else [p[1] if isinstance(p, tuple) else p for p in ps]
            total = total + _estimate(plan_buckets(ps, bucket_numel), bool(g.get("amsgrad", amsgrad)), pin_memory,
                                      world_size, delayed_update)
        return total

    def host_memory_estimate(self) -> HostMemoryEstimate:
        """What the buffers allocated so far take (an :class:`HostMemoryEstimate` of the live layout)."""
        total = HostMemoryEstimate(0, 0, {}, 0, 0)
        for bucket in chain.from_iterable(self._buckets):
            total = total + bucket.estimate()
        return total

    def host_buffers(self) -> List[Dict[str, torch.Tensor]]:
        """The flat host buffers of every bucket (name -> tensor), for inspection and measurement."""
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
        merged = {**self.defaults, **param_group}
        _check_hparams(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"])
        if merged.get("capturable") or merged.get("differentiable"):
            raise ValueError("OffloadOptimizer does not support capturable=True or differentiable=True in a group")
        raw = param_group["params"]
        raw = [raw] if isinstance(raw, torch.Tensor) else raw
        if isinstance(raw, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering "
                            "of tensors in sets will change between runs. Please use a list instead.")
        raw = list(raw)
        tensors = [p[1] if isinstance(p, tuple) else p for p in raw]
        _check_params(tensors)
        n_groups = len(self.param_groups)
        if self._shard is not None:
            self._shard.check_same_params(tensors, n_groups)
        param_group["params"] = raw
        super().add_param_group(param_group)  # names, defaults, and the parameter-in-two-groups check
        try:
            group = self.param_groups[-1]
            layouts = plan_buckets(group["params"], self.bucket_numel)
            if self._shard is not None and not self._shard.host_ok and any(l.device.type == "cpu" for l in layouts):
                raise ValueError("process_group runs NCCL alone, which moves CUDA tensors only, but param group "
                                 f"{n_groups} has parameters on the CPU: shard a CPU model over a gloo group")
            est = _estimate(layouts, bool(group["amsgrad"]), self.pin_memory, self._world_size, self.delayed_update)
            avail = available_host_bytes()
            if avail is not None and est.total_bytes - est.replaces_param_bytes > avail:
                logger.warning("OffloadOptimizer: param group %d needs %s of host RAM, %s is available", n_groups,
                               format_bytes(est.total_bytes - est.replaces_param_bytes), format_bytes(avail))
            buckets = [self._new_bucket(layout, group, n_groups, bi) for bi, layout in enumerate(layouts)]
        except BaseException:
            del self.param_groups[n_groups:]
            raise
        self._buckets.append(buckets)
        self._pending = None
        for bucket in buckets:
            if self._streamed(bucket.device):
                self._streamer.add(bucket, n_groups)
        if self._constructed:
            for bucket in buckets:
                bucket.bind()
            logger.info("OffloadOptimizer: added param group %d, %d buckets: %s", n_groups, len(buckets),
                        est.describe())

    @property
    def _world_size(self) -> int:
        return 1 if self._shard is None else self._shard.world

    def _new_bucket(self, layout: BucketLayout, group: Dict[str, Any], gi: int, bi: int) -> FlatBucket:
        pin = _should_pin(layout.device, self.pin_memory)
        if self._shard is None:
            bucket = FlatBucket(layout, group["params"], amsgrad=bool(group["amsgrad"]), pin=pin)
            if self.delayed_update:
                bucket.add_grad_prev()  # allocated now, so the logged estimate and the RSS include it
            return bucket
        return ShardedBucket(layout, group["params"], amsgrad=bool(group["amsgrad"]), pin=pin, comm=self._shard,
                             where=f"param group {gi}, bucket {bi}")

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
        # Set by torch.amp.GradScaler.step for optimizers with _step_supports_amp_scaling, deleted after.
        # grad_scale is the scale itself (None if the user already called scaler.unscale_); found_inf > 0 means skip.
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        scaler = hasattr(self, "grad_scale") or hasattr(self, "found_inf")
        pending, self._pending = self._pending, None
        if scaler and grad_scale is None and pending is not None and not pending.fresh:
            # The scaler unscaled the gradients in place before that clip, which (the last step having had no
            # scaler) trusted the copies streamed in backward: clip again from the gradients as they are now.
            logger.warning("OffloadOptimizer: a GradScaler drove this step for the first time since a step without "
                           "one; clip_grad_norm_ was redone on the unscaled gradients (the norm it returned this "
                           "step was of the scaled ones)")
            self._scaled = True
            self.clip_grad_norm_(pending.max_norm, pending.norm_type)
            pending, self._pending = self._pending, None
        self._scaled = scaler
        hypers = [_Hyper.read(g) for g in self.param_groups]
        if self._shard is None:
            self._reexpose(every=False)
        self._streamer.wait_updates()
        # A GradScaler's unscale_ (signalled by grad_scale None) rewrote the gradients without a version bump.
        plans = pending.plans if pending is not None else self._collect(fresh=scaler and grad_scale is None)
        if scaler:
            self._check_scaler(plans)
        if found_inf is not None and float(found_inf) != 0.0:
            self.skipped_steps += 1
            self._streamer.reset()
            return loss
        inv_scale = 1.0
        if grad_scale is not None:
            # GradScaler.unscale_ multiplies by this float32 reciprocal computed in double: same bits here.
            inv_scale = float(torch.as_tensor(grad_scale).double().reciprocal().float())
        check = found_inf is None and self.nonfinite != "ignore"
        bad = self._gather(plans, check=check) if pending is None else (check and pending.nonfinite)

        multiplier = inv_scale
        if pending is not None:
            # A norm taken before the scaler's unscale is of scaled gradients; clip with the unscaled one.
            total = pending.total_norm * (inv_scale if grad_scale is not None else 1.0)
            coef = float(torch.clamp(pending.max_norm / (torch.tensor(total, dtype=torch.float32) + 1e-6),
                                     max=1.0))
            if math.isfinite(coef):
                multiplier = inv_scale * coef
        if bad:
            self._wait_all(plans)  # no copy may still be reading the gradients once step() returns
            if self.nonfinite == "skip":
                self.skipped_steps += 1
                self._streamer.reset()
                return loss
            raise RuntimeError(
                f"OffloadOptimizer.step: non-finite gradient (inf or nan) in {self._find_nonfinite(plans)}; "
                "nothing was updated. Pass nonfinite='skip' to skip such steps, or nonfinite='ignore' to apply "
                "them as torch.optim.AdamW would."
            )

        for hyper, group_plan in zip(hypers, plans):
            if hyper.amsgrad:  # amsgrad switched on for a group since its buckets were built
                for bucket, _, _ in group_plan:
                    self._ensure_amsgrad(bucket)
        if self.delayed_update:
            self._step_delayed(hypers, plans, multiplier)
            self._streamer.reset()
            return loss
        self._uploads_after_compute(b for b, _, _ in chain.from_iterable(plans))
        used_streams: Dict[torch.device, Any] = {}
        for hyper, group_plan in zip(hypers, plans):
            for bucket, grads, in_place in group_plan:
                if not self._streamer.updated(bucket):  # overlap_step updated it during backward
                    self._update_bucket(bucket, grads, in_place, hyper, multiplier)
                if not bucket.on_cpu:
                    used_streams[bucket.device] = self._stream(bucket.device, upload=True)
        for bucket, _, _ in chain.from_iterable(plans):
            bucket.wait_params()  # sharded: the all-gathers, each overlapped with the next bucket's update
        for device, stream in used_streams.items():
            # The next forward must read the parameters only after their uploads have landed: the compute stream
            # waits for the upload stream's work so far (an event), the host does not wait.
            torch.cuda.current_stream(device).wait_stream(stream)
        self._streamer.reset()
        return loss

    def _update_bucket(self, bucket: FlatBucket, grads: _Grads, in_place: Optional[_Grads], h: _Hyper,
                       multiplier: float, *, grad: Optional[torch.Tensor] = None, scatter: bool = True
                       ) -> Optional[List[int]]:
        """Run the kernel over the bucket's parameters that have a gradient (from ``grad``, default its gradient
        buffer, or ``in_place``) and, with ``scatter``, send the results to the parameters. Returns the indices
        updated (None: none)."""
        runs = bucket.runs(grads)
        if not runs:
            return None
        if grad is None:
            # (A delayed update's ``grad`` was waited for at its step(); its bucket's copy event may meanwhile
            # have been recorded again by the next backward, which this must not wait for.)
            bucket.wait_grads()
        if bucket.h2d_event is not None:
            bucket.h2d_event.synchronize()  # the last upload may still be reading master/staging
        flat_grad = bucket.grad if grad is None else grad
        full = len(runs) == 1 and runs[0][0] == 0 and runs[0][1] == len(bucket.params) - 1
        indices = range(len(bucket.params)) if full else [i for first, last, _ in runs for i in range(first, last + 1)]
        bucket.refresh_masters(indices)
        vmax = bucket.max_exp_avg_sq if h.amsgrad else None
        offsets = bucket.layout.offsets
        for first, last, step in runs:
            a, b = bucket.layout.span(first, last)
            kw = dict(step=step + 1, lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay,
                      decoupled_weight_decay=h.decoupled, amsgrad=h.amsgrad,
                      max_exp_avg_sq=None if vmax is None else vmax[a:b], maximize=h.maximize,
                      grad_scale=multiplier * bucket.grad_multiplier,
                      param_out=None if bucket.staging is None else bucket.staging[a:b])
            if in_place is None:
                functional.cpu_adam_(bucket.master[a:b], flat_grad[a:b], bucket.exp_avg[a:b],
                                     bucket.exp_avg_sq[a:b], **kw)
            else:
                functional._cpu_adam_segments_(
                    bucket.master[a:b], in_place if full else in_place[first : last + 1],
                    [o - a for o in offsets[first : last + 1]],
                    bucket.exp_avg[a:b], bucket.exp_avg_sq[a:b], **kw,
                )  # fmt: skip
        if full:
            bucket.steps += 1
        else:
            for first, last, _ in runs:
                bucket.steps[first : last + 1] += 1
        if not bucket.all_exposed:
            for i in indices:
                if not bucket.exposed[i]:
                    self.state[bucket.params[i]] = bucket.state_entry(i)
                    bucket.exposed[i] = True
            bucket.all_exposed = all(bucket.exposed)
        if scatter:
            self._upload(bucket, indices)
        return list(indices)

    def _early_update(self, state: BucketStream) -> None:
        """``overlap_step``: a bucket's update, run in the streamer's worker thread as soon as its gradients are
        complete (hyperparameters as they are now, which is what ``step()`` would read)."""
        hyper = _Hyper.read(self.param_groups[state.group])
        if hyper.amsgrad:
            self._ensure_amsgrad(state.bucket)
        grads = [True if present else None for present in state.present]
        self._update_bucket(state.bucket, grads, None, hyper, 1.0)

    def _step_delayed(self, hypers: List[_Hyper], plans: _Plan, multiplier: float) -> None:
        """``delayed_update``: apply the previous step's update (and upload it), then start this step's from a
        second gradient buffer, so the next backward's copies land in the first."""
        self._finish_delayed()
        work = []
        for hyper, group_plan in zip(hypers, plans):
            for bucket, grads, in_place in group_plan:
                if in_place is not None:  # never for streamed buckets, which every bucket is here
                    raise AssertionError("delayed_update with gradients read in place")
                if bucket.runs(grads):
                    bucket.wait_grads()
                    bucket.swap_grad_buffers()
                    work.append((bucket, grads, hyper))

        def run() -> List[Tuple[FlatBucket, Optional[List[int]]]]:
            return [(b, self._update_bucket(b, g, None, h, multiplier, grad=b.grad_prev, scatter=False))
                    for b, g, h in work]

        # With the model on a GPU the update runs in the worker while the next forward/backward runs; on CPU it
        # runs at the next step() (the parameters *are* the masters there, so it cannot run under a forward).
        on_gpu = any(not b.on_cpu for b, _, _ in work)
        self._delayed = _Delayed(run, self._streamer.submit(run) if on_gpu else None)

    def _finish_delayed(self) -> None:
        """Apply the pending delayed update, if any, and send its parameters back."""
        delayed, self._delayed = self._delayed, None
        if delayed is None:
            return
        done = delayed.job.result() if delayed.job is not None else delayed.run()
        self._uploads_after_compute(b for b, indices in done if indices is not None)
        used: Dict[torch.device, Any] = {}
        for bucket, indices in done:
            if indices is None:
                continue
            self._upload(bucket, indices)
            if not bucket.on_cpu:
                used[bucket.device] = self._stream(bucket.device, upload=True)
        for device, stream in used.items():
            torch.cuda.current_stream(device).wait_stream(stream)

    def _upload(self, bucket: FlatBucket, indices: List[int]) -> None:
        """Copy the updated values into the bucket's parameters ``indices``; on CUDA, ``h2d_event`` then marks
        when the upload has read master and staging, which the next kernel on this bucket waits for before
        writing them."""
        if bucket.on_cpu:
            bucket.scatter_params(indices)
            return
        stream = self._stream(bucket.device, upload=True)
        bucket.scatter_params(indices, stream)
        if bucket.h2d_event is None:
            bucket.h2d_event = torch.cuda.Event()
        bucket.h2d_event.record(stream)

    def _uploads_after_compute(self, buckets: Iterable[FlatBucket]) -> None:
        """Uploads overwrite the parameters, so their stream first waits for what the compute stream has queued
        since backward, which may still read them (an EMA of the weights, a norm for logging, an eval forward
        before ``state_dict()``). Not needed for ``overlap_step``'s uploads in backward: every use of a parameter
        was queued before the hook that found its gradient final."""
        for device in {b.device for b in buckets if not b.on_cpu}:
            self._stream(device, upload=True).wait_stream(torch.cuda.current_stream(device))

    def _drop_delayed(self) -> None:
        """Discard the update still pending from the last step (its state is about to be replaced), once its
        worker job has stopped writing."""
        delayed, self._delayed = self._delayed, None
        if delayed is not None and delayed.job is not None:
            delayed.job.result()

    def flush(self) -> None:
        """With ``delayed_update``: apply the update still pending from the last ``step()`` now, so parameters and
        state reflect every step taken (``state_dict()`` and ``sharded_state_dict()`` do this first). Otherwise:
        nothing to do."""
        self._finish_delayed()

    def _reexpose(self, every: bool) -> None:
        """Point ``self.state`` back at the host buffers where something replaced its tensors (Lightning's restore
        moves optimizer state to the model's device with ``state[p][k] = v.to(device)``): those copies would make
        ``state_dict()`` stale and hold the state in GPU memory. ``every=False`` checks one parameter per bucket
        (such replacements are wholesale), which is cheap enough for every step."""
        for bucket in chain.from_iterable(self._buckets):
            for i, p in enumerate(bucket.params):
                if not bucket.exposed[i]:
                    continue
                entry = self.state.get(p)
                if entry is None or entry.get("exp_avg") is not bucket.exp_avg_views[i] \
                        or entry.get("exp_avg_sq") is not bucket.exp_avg_sq_views[i]:
                    for j, q in enumerate(bucket.params):
                        if bucket.exposed[j]:
                            self.state[q] = bucket.state_entry(j)
                    break
                if not every:
                    break

    def _ensure_amsgrad(self, bucket: FlatBucket) -> None:
        if bucket.max_exp_avg_sq is not None:
            return
        bucket.ensure_amsgrad()
        for i, p in enumerate(bucket.params):
            if bucket.exposed[i]:
                self.state[p]["max_exp_avg_sq"] = bucket.max_views[i]

    def _collect(self, fresh: bool = False) -> _Plan:
        plans: _Plan = []
        for buckets in self._buckets:
            group_plan = []
            for bucket in buckets:
                grads = bucket.collect_grads()
                streamed = self._streamer.consume(bucket, grads, fresh=fresh)
                if streamed is not None:
                    if self._streamer.updated(bucket) and any(isinstance(g, torch.Tensor) for g in streamed):
                        raise RuntimeError(
                            "OffloadOptimizer(overlap_step=True): a gradient was assigned or changed in place after "
                            "backward (by clipping or unscaling?), but its bucket was already updated during "
                            "backward. With overlap_step, clip with optimizer.clip_grad_norm_ is not possible either: "
                            "turn overlap_step off to clip or to use a GradScaler."
                        )
                    grads = streamed
                group_plan.append((bucket, grads, None))
            plans.append(group_plan)
        return plans

    def _streamed(self, device: torch.device) -> bool:
        """Whether buckets on ``device`` stream their gradients in backward (see ``stream_grads``)."""
        if self._shard is not None and self._shard.grads_reduced:
            return False  # see the constructor: DDP's averages are final only when backward ends
        if self.stream_grads is not None:
            return self.stream_grads
        if self._outside_world > 1:
            return False  # likewise, if the model is DDP-wrapped (see the constructor)
        return device.type == "cuda" or self.delayed_update

    def _check_scaler(self, plans: _Plan) -> None:
        """A GradScaler finds infs in, and unscales, the gradients on the parameters: released ones it never saw."""
        if self.overlap_step:
            raise RuntimeError("OffloadOptimizer(overlap_step=True) cannot be driven by a GradScaler: the scaler's "
                               "inf check comes after backward, when buckets were already updated. Turn "
                               "overlap_step off, or use bf16 autocast, which needs no scaler.")
        if self.release_grads and any(g is True for _, grads, _ in chain.from_iterable(plans) for g in grads):
            raise RuntimeError(
                "OffloadOptimizer: a GradScaler drives this step, but the gradients were released from the "
                "parameters as backward streamed them (release_grads=True), so the scaler could not check them for "
                "inf/nan. Pass release_grads=False to use a GradScaler (or use bf16 autocast, which needs none). "
                "Nothing was updated."
            )

    def _stream(self, device: torch.device, upload: bool = False):
        streams = self._upload_streams if upload else self._streams
        stream = streams.get(device)
        if stream is None:
            stream = streams[device] = torch.cuda.Stream(device=device)
        return stream

    def _gather(self, plans: _Plan, check: bool = False) -> bool:
        """Make every bucket's gradients readable on the host (a CUDA bucket's copied into its buffer; a CPU
        bucket's where they are, recorded in its plan entry); with ``check``, return whether any is inf/nan.

        A CPU bucket is checked right after its own gather, when whatever it copied is still in cache.

        Sharded: every bucket is reduce-scattered, then one all-reduce combines the norm, the check and which
        parameters have a gradient (``zero_offload.distributed.Comm.gather``)."""
        if self._shard is not None:
            self._grad_stats = self._shard.gather(plans, self._stream, release=self.release_grads)
            return check and self._grad_stats.nonfinite
        # CUDA copies are only enqueued, so they go first and overlap the CPU buckets' copies.
        pairs = list(chain.from_iterable(plans))
        waited = set()
        for bucket, grads, _ in pairs:
            if bucket.on_cpu:
                continue
            stream = self._stream(bucket.device)
            if bucket.device not in waited:
                # Gradients were produced on the compute stream; the side stream must not read them earlier.
                stream.wait_stream(torch.cuda.current_stream(bucket.device))
                waited.add(bucket.device)
            bucket.gather_grads(grads, stream)
        bad = False
        for group_plan in plans:
            for k, (bucket, grads, _) in enumerate(group_plan):
                if bucket.on_cpu:
                    in_place = bucket.gather_grads(grads, into_slots=self._streamer.state(bucket) is not None)
                    group_plan[k] = (bucket, grads, in_place)
                    if check and not bad:
                        bad = _host_sq_norm(bucket, in_place)[1]
        if check and not bad:
            cuda = [bucket for bucket, _, _ in pairs if not bucket.on_cpu]
            gpu_norms = self._streamer.norms(cuda)  # one synchronisation for every streamed bucket
            if any(not math.isfinite(v) for v in gpu_norms.values()):
                return True
            for bucket in cuda:
                if id(bucket) not in gpu_norms:
                    bucket.wait_grads()
                    if functional.grad_sq_norm(bucket.grad)[1]:
                        return True
        return bad

    @staticmethod
    def _wait_all(plans: _Plan) -> None:
        for bucket, _, _ in chain.from_iterable(plans):
            bucket.wait_grads()

    def _find_nonfinite(self, plans: _Plan) -> str:
        for gi, group_plan in enumerate(plans):
            names = self.param_groups[gi].get("param_names")
            for bucket, grads, in_place in group_plan:
                for i, g in enumerate(grads):
                    host = bucket.grad_views[i] if in_place is None else in_place[i]
                    if g is not None and not bool(torch.isfinite(host).all()):
                        j = bucket.layout.indices[i]
                        label = f" ({names[j]!r})" if names else ""
                        return f"param group {gi}, parameter {j}{label} of shape {tuple(bucket.params[i].shape)}"
        return "the gradients"

    def _synchronize(self) -> None:
        """Wait for copies in flight from the host buffers (before anything rewrites them)."""
        for stream in chain(self._streams.values(), self._upload_streams.values()):
            stream.synchronize()

    # ------------------------------------------------------------------------------------------- gradients --
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. With ``set_to_none=False``, the existing gradients of CPU
        parameters become zeroed views of the flat gradient buffer, so backward accumulates into it and the next
        ``step()`` copies nothing (parameters whose ``.grad`` is None keep None, as in PyTorch).

        Args:
            set_to_none (bool): set gradients to None instead of zeroing them. Default: True.
        """
        self._pending = None
        if set_to_none:
            self._streamer.reset()  # gradients streamed since the last step are discarded with the rest
            super().zero_grad(set_to_none=True)
            return
        self._streamer.keep_zero_grads()
        for bucket in chain.from_iterable(self._buckets):
            if bucket.on_cpu and self._streamer.state(bucket) is None:
                bucket.zero_grads_as_views()
                continue
            grads = []
            for p in bucket.params:
                if p.grad is not None:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    grads.append(p.grad)
            if grads:
                torch._foreach_zero_(grads)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> torch.Tensor:
        """Clip the gradients of all parameters by their total norm, like ``torch.nn.utils.clip_grad_norm_``,
        fused into the next ``step()``: the coefficient ``min(max_norm / (total_norm + 1e-6), 1)`` multiplies the
        gradient inside the kernel instead of rewriting ``.grad`` (which is left as it was).

        It brings the gradients to the host now (``step()`` then reuses them; CPU gradients are read where they
        are), so call it after the last backward, right before ``step()`` (or ``scaler.step``); ``zero_grad()``
        cancels it. Gradients streamed in backward and still on their parameters are copied again only while a
        ``GradScaler`` may have unscaled them in place (at the first step, and after a step a scaler drove): that
        edit leaves no trace in their version counters. A scaler that first appears later is noticed at
        ``step()``, which then clips again (the norm returned that once is of the scaled gradients).

        Args:
            max_norm (float): max norm of the gradients.
            norm_type (float): type of the p-norm: 2 (computed by the fused ``grad_sq_norm`` kernel), ``inf``, or
                any finite p > 0. Default: 2.0.
            error_if_nonfinite (bool): raise ``RuntimeError`` if the total norm is nan or inf. Default: False.
                Otherwise a non-finite norm is left to the ``nonfinite`` policy at ``step()`` (with ``"ignore"``,
                an inf norm scales the gradients by 0, as torch's clip would; a nan norm leaves them unclipped).

        Returns:
            Tensor: the total norm of the gradients (viewed as a single vector), float32, on the device of the
            first parameter with a gradient.
        """
        norm_type = float(norm_type)
        if not (norm_type == math.inf or (math.isfinite(norm_type) and norm_type > 0)):
            raise ValueError(f"Invalid norm_type: {norm_type} (expected 2.0, inf or a finite p > 0)")
        max_norm = float(max_norm)
        if self.overlap_step:
            raise RuntimeError("OffloadOptimizer(overlap_step=True) cannot clip: buckets are updated during backward, "
                               "before the total norm exists. Turn overlap_step off to clip.")
        # A GradScaler's unscale_ rewrites gradients in place without bumping their version, so the copies streamed
        # in backward may be stale: read every gradient still on a parameter again, unless the last step() was
        # known to run without a scaler (then version counters tell every other edit; if a scaler appears after
        # all, step() sees it and clips again).
        fresh = self._scaled is not False
        plans = self._collect(fresh=fresh)
        self._gather(plans)
        entries = list(chain.from_iterable(plans))
        nonfinite = False
        if self._shard is not None:  # the averaged gradient's norm over the group
            self._wait_all(plans)
            total, nonfinite = self._shard.total_norm(plans, norm_type, self._grad_stats)
        elif norm_type == 2.0:
            # Streamed GPU buckets brought their squared norms along (one synchronisation for all of them).
            gpu_norms = self._streamer.norms([b for b, _, _ in entries if not b.on_cpu])
            self._wait_all(plans)
            sq = 0.0
            for b, _, in_place in entries:
                if id(b) in gpu_norms:
                    s = gpu_norms[id(b)]
                    bad = not math.isfinite(s)
                else:
                    s, bad = _host_sq_norm(b, in_place)
                sq, nonfinite = sq + s, nonfinite or bad
            total = math.sqrt(sq)
        else:
            self._wait_all(plans)
            # Padding is zero in the gradient buffers, so it changes neither a max nor a p-norm.
            host = [t for b, _, in_place in entries for t in _host_grads(b, in_place) if t.numel()]
            if norm_type == math.inf:
                total = max((float(t.abs().max()) for t in host), default=0.0)
            else:
                norms = [torch.linalg.vector_norm(t.float(), norm_type) for t in host]
                total = float(torch.linalg.vector_norm(torch.stack(norms), norm_type)) if norms else 0.0
        nonfinite = nonfinite or not math.isfinite(total)
        if error_if_nonfinite and nonfinite:
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
                "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        self._pending = _PendingClip(plans, max_norm, norm_type, total, nonfinite, fresh)
        first = next((b.params[i] for b, grads, _ in chain.from_iterable(plans)
                      for i, g in enumerate(grads) if g is not None), None)
        device = first.device if first is not None else torch.device("cpu")
        return torch.tensor(total, dtype=torch.float32, device=device)

    # ------------------------------------------------------------------------------------------- state dict --
    def state_dict(self) -> Dict[str, Any]:
        """AdamW's state dict (see the class docstring): per-parameter tensors are views of the host buffers.
        With ``delayed_update``, the pending update is applied first (:meth:`flush`).

        With a ``process_group`` it is a collective (every rank must call it, in the same order as the other
        collectives) that gathers the full, parameter-shaped state bucket by bucket onto *every* rank: the
        result costs each rank 12 bytes per parameter (16 with amsgrad, +4 for a bf16/fp16 parameter's master)
        of CPU memory for as long as it is kept, so save it from one rank and drop it. It loads into
        ``torch.optim.AdamW`` and into this optimizer at any world size. For large models prefer
        :meth:`sharded_state_dict` with ``torch.distributed.checkpoint``, which never gathers."""
        self.flush()
        if self._shard is None:
            self._reexpose(every=True)
        sd = super().state_dict()
        if self._shard is not None:
            sd["state"] = self._shard.full_state(self._buckets, self.param_groups)
        return sd

    def sharded_state_dict(self) -> Dict[str, Any]:
        """The optimizer state for ``torch.distributed.checkpoint`` (DCP), with nothing gathered: a run saved on N
        ranks resumes on M ranks, or in one process without a group, with the same trajectory.

        ``{"state": {"<index>": {"step", "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"][, "master"]}}, "param_groups":
        [...]}``, a parameter's index counted over all groups as in :meth:`state_dict`. Every state tensor is the
        parameter's state *flattened* to 1-D (in the parameter's memory order): with a process group, a
        ``ShardedTensor`` whose local shard is this rank's piece, at its offset; without one, a plain 1-D tensor.
        Those tensors are views of the optimizer's host buffers: ``dcp.save`` reads them where they are and
        ``dcp.load`` writes into them in place, so neither needs extra memory. Every parameter has an entry
        (``step`` 0 if it never had a gradient). Building it involves no collective. With ``delayed_update``, the
        pending update is applied first (:meth:`flush`).

        Usage (the same on every rank; the model's own weights are saved alongside as usual)::

            dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=path)
            ...
            sd = {"optim": opt.sharded_state_dict()}
            dcp.load(sd, checkpoint_id=path)          # fills the optimizer's buffers in place
            opt.load_sharded_state_dict(sd["optim"])  # steps and hyperparameters
        """
        from zero_offload import distributed

        self.flush()  # the tensors handed out are the live buffers: nothing may still be writing them
        return distributed.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Finish loading a :meth:`sharded_state_dict` filled by ``torch.distributed.checkpoint.load``: its moments
        (and masters) are already in this optimizer's buffers; this validates and applies the step counts and the
        param groups' hyperparameters (``ValueError`` naming the problem, before anything is applied). Local:
        no collective.

        Args:
            state_dict (dict): the dict returned by :meth:`sharded_state_dict` after ``dcp.load`` filled it.
        """
        from zero_offload import distributed

        distributed.load_sharded_state_dict(self, state_dict)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context manager for gradient accumulation: backward passes inside it keep their gradients in ``.grad``
        (accumulating on the device as usual) instead of streaming them, so only the last micro-batch's backward,
        outside it, sends gradients to the host. Without it every backward streams, and the host buffer sums the
        micro-batches (see the class docstring for the trade-off). Like ``DistributedDataParallel.no_sync``."""
        return self._streamer.no_sync()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict from this class or from ``torch.optim.AdamW``/``Adam``, into the host buffers in place.

        Everything is validated first (group count and sizes, hyperparameters, every state entry's keys, shapes
        and step), then copied; an invalid state dict raises ``ValueError`` and changes nothing. Parameters without
        an entry start fresh (step 0, zero moments), as they would in AdamW. A bf16/fp16 parameter without a
        ``master`` entry gets its master from the parameter. ``capturable``/``differentiable`` in the loaded
        groups are reset to False (see the constructor). With a ``process_group``, ``state_dict`` is the full
        state (from any world size, or from AdamW) and each rank copies only the piece it owns: no collective.

        Args:
            state_dict (dict): with ``"state"`` and ``"param_groups"``, as returned by ``state_dict()``.
        """
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict must be a dict with 'state' and 'param_groups' (from Optimizer.state_dict())")
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError(f"loaded state dict has a different number of parameter groups "
                             f"({len(saved_groups)}, this optimizer has {len(groups)})")
        new_groups = []
        for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(f"loaded state dict contains a parameter group that doesn't match the size of "
                                 f"optimizer's group (group {gi}: {len(sg['params'])} vs {len(g['params'])} params)")
            ng = {k: v for k, v in sg.items() if k != "params"}
            for k, v in g.items():
                ng.setdefault(k, v)  # keys an older checkpoint lacks keep their current value
            try:
                _check_hparams(ng["lr"], ng["betas"], ng["eps"], ng["weight_decay"])
            except ValueError as exc:
                raise ValueError(f"loaded state dict, param group {gi}: {exc}") from None
            ng["params"] = g["params"]
            ng["capturable"] = ng["differentiable"] = False
            new_groups.append(ng)

        id_map = dict(zip(chain.from_iterable(sg["params"] for sg in saved_groups),
                          chain.from_iterable(g["params"] for g in groups)))
        where = {}
        for gi, buckets in enumerate(self._buckets):
            for bucket in buckets:
                for i, p in enumerate(bucket.params):
                    where[p] = (gi, bucket, i)
        entries: Dict[torch.Tensor, Dict[str, Any]] = {}
        for key, entry in state_dict["state"].items():
            if key not in id_map:
                raise ValueError(f"loaded state dict has state for parameter id {key!r}, which none of its "
                                 "param_groups lists")
            p = id_map[key]
            gi = where[p][0]
            entries[p] = _check_entry(entry, p, key, amsgrad=bool(new_groups[gi]["amsgrad"]))

        # Allocate before changing anything: an allocation failure must leave the optimizer as it was. (A new
        # amsgrad buffer is zero-filled and not yet in any state entry, so adding it changes nothing visible.)
        for gi, buckets in enumerate(self._buckets):
            if new_groups[gi]["amsgrad"]:
                for bucket in buckets:
                    bucket.ensure_amsgrad()

        self._streamer.wait_updates()
        self._drop_delayed()  # a pending update of the old trajectory
        self._synchronize()
        self._pending = None
        self._streamer.reset()
        for bucket in chain.from_iterable(self._buckets):
            self._load_bucket(bucket, entries)
        for p in list(self.state.keys()):
            if isinstance(p, torch.Tensor) and p in where and p not in entries:
                del self.state[p]
        self.param_groups = new_groups
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_bucket(self, bucket: FlatBucket, entries: Dict[torch.Tensor, Dict[str, Any]]) -> None:
        if bucket.sharded:  # this rank's piece of each full entry
            bucket.load_entries([entries.get(p) for p in bucket.params])
            for i, p in enumerate(bucket.params):
                if entries.get(p) is not None:
                    self.state[p] = bucket.state_entry(i)
                    bucket.exposed[i] = True
            bucket.all_exposed = all(bucket.exposed)
            return
        dsts: List[torch.Tensor] = []
        srcs: List[torch.Tensor] = []
        zero: List[torch.Tensor] = []
        for i, p in enumerate(bucket.params):
            entry = entries.get(p)
            moments = [bucket.exp_avg_views[i], bucket.exp_avg_sq_views[i]]
            if bucket.max_views is not None:
                moments.append(bucket.max_views[i])
            if entry is None:
                zero.extend(moments)
                bucket.steps[i] = 0.0
                bucket.exposed[i] = False
                if bucket.separate_master:
                    bucket.versions[i] = -1
                continue
            bucket.steps[i] = entry["step"]
            dsts += [bucket.exp_avg_views[i], bucket.exp_avg_sq_views[i]]
            srcs += [entry["exp_avg"], entry["exp_avg_sq"]]
            if bucket.max_views is not None:
                if "max_exp_avg_sq" in entry:
                    dsts.append(bucket.max_views[i])
                    srcs.append(entry["max_exp_avg_sq"])
                else:
                    zero.append(bucket.max_views[i])
            if bucket.separate_master:
                if "master" in entry:
                    dsts.append(bucket.master_views[i])
                    srcs.append(entry["master"])
                    bucket.versions[i] = p._version
                else:
                    bucket.versions[i] = -1
        for d, s in zip(dsts, srcs):
            d.copy_(s)
        if zero:
            torch._foreach_zero_(zero)
        for i, p in enumerate(bucket.params):
            if entries.get(p) is not None:
                self.state[p] = bucket.state_entry(i)
                bucket.exposed[i] = True
        bucket.all_exposed = all(bucket.exposed)

    def __getstate__(self) -> Dict[str, Any]:
        raise TypeError("OffloadOptimizer cannot be pickled or deep-copied: its state lives in host buffers bound to "
                        "the parameters. Save and restore it with state_dict() / load_state_dict().")


@dataclasses.dataclass
class _Delayed:
    """A step's update held back by ``delayed_update``: ``run`` computes it; ``job`` is it running in the worker."""

    run: Callable[[], List[Tuple[FlatBucket, Optional[List[int]]]]]
    job: Optional[Any]


def _weak(method: Callable) -> Callable:
    """A callable that calls ``method`` without keeping its object alive (the streamer's hooks live on the
    parameters, which usually outlive the optimizer)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        target = ref()
        if target is None:
            raise RuntimeError("OffloadOptimizer was garbage-collected while its gradient stream was in use")
        return target(*args)

    return call


def _host_grads(bucket: FlatBucket, in_place: Optional[_Grads]) -> List[torch.Tensor]:
    """The host tensors holding a gathered bucket's gradients (see ``_Plan``)."""
    return [bucket.grad] if in_place is None else [g for g in in_place if g is not None]


def _host_sq_norm(bucket: FlatBucket, in_place: Optional[_Grads]) -> Tuple[float, bool]:
    if in_place is None:
        return functional.grad_sq_norm(bucket.grad)
    return functional._grad_sq_norm_segments(_host_grads(bucket, in_place))


def _estimate(layouts: Sequence[BucketLayout], amsgrad: bool, pin_memory: Optional[bool], world_size: int = 1,
              delayed_update: bool = False) -> HostMemoryEstimate:
    total = HostMemoryEstimate(0, 0, {}, 0, 0)
    for layout in layouts:
        padded = layout.padded_numel if world_size == 1 else align_up(layout.padded_numel, ALIGN * world_size)
        total = total + estimate_bucket(layout.numel, padded, layout.dtype,
                                        on_cpu=layout.device.type == "cpu", amsgrad=amsgrad,
                                        pin=_should_pin(layout.device, pin_memory), world_size=world_size,
                                        delayed_update=delayed_update)
    return total


def _world_without_group(process_group: Optional[Any]) -> int:
    if process_group is not None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size()


def _should_pin(device: torch.device, pin_memory: Optional[bool]) -> bool:
    if pin_memory is None:
        return device.type == "cuda"
    return bool(pin_memory)


def _check_params(params: Sequence[Any]) -> None:
    seen = set()
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError("optimizer can only optimize Tensors, but one of the params is " + torch.typename(p))
        if not p.is_leaf:
            raise ValueError("can't optimize a non-leaf Tensor")
        if p.is_complex():
            raise ValueError(f"OffloadOptimizer does not support complex parameters ({p.dtype}, shape "
                             f"{tuple(p.shape)}): keep them as real pairs in the model (torch.view_as_real)")
        if p.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"OffloadOptimizer supports float32, bfloat16 and float16 parameters, not {p.dtype}")
        if p.layout != torch.strided:
            raise ValueError(f"OffloadOptimizer supports dense parameters only, not {p.layout}")
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"OffloadOptimizer supports parameters on cpu or cuda, not {p.device}")
        if id(p) in seen:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} appears twice in one parameter group")
        seen.add(id(p))


def _check_entry(entry: Any, p: torch.Tensor, key: Any, *, amsgrad: bool) -> Dict[str, Any]:
    """Validate one parameter's loaded state; returns it with ``step`` as a float."""
    where = f"loaded state for parameter id {key!r} (shape {tuple(p.shape)})"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is a {type(entry).__name__}, not a dict")
    unknown = set(entry) - set(_STATE_KEYS)
    if unknown:
        raise ValueError(f"{where} has keys {sorted(map(str, unknown))} that are not Adam(W) state (expected "
                         f"{', '.join(_STATE_KEYS)}): is it from another optimizer?")
    required = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    missing = [k for k in required if k not in entry]
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master"):
        if k not in entry:
            continue
        v = entry[k]
        if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.layout != torch.strided:
            raise ValueError(f"{where}: {k} must be a dense floating-point tensor, got {type(v).__name__}")
        if v.shape != p.shape:
            raise ValueError(f"{where}: {k} has shape {tuple(v.shape)}, the parameter has {tuple(p.shape)}: "
                             "is this state dict from another model?")
    step = entry["step"]
    if isinstance(step, torch.Tensor):
        if step.numel() != 1:
            raise ValueError(f"{where}: step must hold one number, got shape {tuple(step.shape)}")
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, Real) or not math.isfinite(step) or step < 0 \
            or step != int(step) or step > 2**24:
        raise ValueError(f"{where}: invalid step {entry['step']!r} (a whole number >= 0)")
    out = dict(entry)
    out["step"] = float(step)
    return out

"""The CPU step: the kernel over one bucket (:func:`update_bucket`), and the three schedules that decide when each
bucket's update runs (:class:`Immediate`, the default; :class:`Overlap`, during backward; :class:`Delayed`,
during the next forward and backward). A schedule is chosen once, at construction (:func:`make_mode`).
"""

from __future__ import annotations

import dataclasses
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain
from typing import Any, Callable, Dict, List, MutableMapping, Optional, Sequence, Tuple

import torch

from zero_offload import functional
from zero_offload.buckets import MOMENTS, FlatBucket, view_like
from zero_offload.checkpoint import Ahead, expose
from zero_offload.options import Hyper, Options
from zero_offload.timeline import span
from zero_offload.transport import BucketGrads, Plans, Transport

__all__ = ["Delayed", "Immediate", "Overlap", "ensure_amsgrad", "make_mode", "preview_bucket", "update_bucket",
           "weak_method"]

State = MutableMapping[torch.Tensor, Dict[str, torch.Tensor]]


def ensure_amsgrad(state: State, bucket: FlatBucket) -> None:
    """amsgrad switched on for the bucket's group since it was built: allocate its buffer, show it in the state."""
    if bucket.max_exp_avg_sq is not None:
        return
    bucket.ensure_amsgrad()
    expose(state, bucket, [i for i in range(len(bucket.params)) if bucket.exposed[i]])


def _ensure_amsgrad(state: State, hypers: Sequence[Hyper], plans: Plans) -> None:
    for hyper, group_plan in zip(hypers, plans):
        if hyper.amsgrad:  # amsgrad switched on for a group since its buckets were built
            for bg in group_plan:
                ensure_amsgrad(state, bg.bucket)


def update_bucket(transport: Transport, bucket: FlatBucket, present: Sequence[bool],
                  in_place: Optional[List[Optional[torch.Tensor]]], h: Hyper, multiplier: float, state: State, *,
                  grad: Optional[torch.Tensor] = None, scatter: bool = True) -> Optional[List[int]]:
    """Run the kernel over the bucket's parameters that have a gradient (``present``), reading it from ``grad``
    (default: the bucket's gradient buffer) or ``in_place``, and with ``scatter`` send the results to the
    parameters. Returns the indices updated (None: none)."""
    runs = bucket.runs(present)
    if not runs:
        return None
    if grad is None:
        # (A delayed update's ``grad`` was waited for at its step(); its bucket's copy event may meanwhile have
        # been recorded again by the next backward, which this must not wait for.)
        transport.wait_grads(bucket)
    transport.before_update(bucket)  # the last upload may still be reading master/staging
    full = len(runs) == 1 and runs[0][0] == 0 and runs[0][1] == len(bucket.params) - 1
    indices = range(len(bucket.params)) if full else [i for first, last, _ in runs for i in range(first, last + 1)]
    bucket.refresh_masters(indices)
    with span(transport.timeline, "kernel", "step", bucket):
        _kernel(bucket, runs, bucket.grad if grad is None else grad, in_place, h, multiplier, full)
    bucket.count_steps(runs)
    if not bucket.all_exposed:
        expose(state, bucket, [i for i in indices if not bucket.exposed[i]])
    if scatter:
        transport.send_params(bucket, indices)
    return list(indices)


def preview_bucket(bucket: FlatBucket, present: Sequence[bool], h: Hyper, multiplier: float, *,
                   grad: torch.Tensor) -> Optional[Ahead]:
    """What :func:`update_bucket` would leave in a CPU bucket, computed into copies of its buffers (the bucket,
    its parameters and their recorded versions are left as they are): the state a delayed update will have."""
    runs = bucket.runs(present)
    if not runs:
        return None
    names = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "staging")
    flat = {n: getattr(bucket, n).clone() for n in names if getattr(bucket, n) is not None}
    scales = {n: t.clone() for n, t in bucket.scales.items()}
    full = len(runs) == 1 and runs[0][0] == 0 and runs[0][1] == len(bucket.params) - 1
    indices = list(range(len(bucket.params))) if full else [i for a, b, _ in runs for i in range(a, b + 1)]
    bucket.refresh_masters(indices, into=[view_like(flat["master"], o, p)
                                          for o, p in zip(bucket.layout.offsets, bucket.params)])
    _kernel(bucket, runs, grad, None, h, multiplier, full, into=(flat, scales))
    for name in [n for n in MOMENTS if n in flat and bucket.compact]:  # saved as fp32, as state_dict() does
        flat[name] = functional.dequantize_state(flat[name], scales[name]) if name in scales else flat[name].float()
    steps = bucket.steps.clone()
    for first, last, _ in runs:
        steps[first : last + 1] += 1
    return Ahead(set(indices), steps, flat)


def _kernel(bucket: FlatBucket, runs: Sequence[Tuple[int, int, int]], flat_grad: torch.Tensor,
            in_place: Optional[List[Optional[torch.Tensor]]], h: Hyper, multiplier: float, full: bool,
            into: Optional[Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]] = None) -> None:
    """One kernel call per run of parameters with the same step count, on the bucket's buffers or ``into`` (copies
    of them: flat buffers by name, and the 8-bit scales by moment name). A run starts on a slot, so it owns whole
    scale blocks of 8-bit state."""
    master = bucket.master if into is None else into[0]["master"]
    offsets = bucket.layout.offsets
    for first, last, step in runs:
        a, b = bucket.layout.span(first, last)
        kw = dict(step=step + 1, lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay,
                  decoupled_weight_decay=h.decoupled, amsgrad=h.amsgrad, maximize=h.maximize,
                  grad_scale=multiplier * bucket.grad_multiplier,
                  **bucket.kernel_state(a, b, h.amsgrad, into))
        if into is None:
            kw["param_out"] = bucket.param_out(flat_grad, a, b)
        elif "staging" in into[0]:
            kw["param_out"] = into[0]["staging"][a:b]
        if in_place is None:
            functional.cpu_adam_(master[a:b], flat_grad[a:b], **kw)
        else:
            grads = in_place if full else functional.CheckedGrads(in_place[first : last + 1])  # checked as a whole
            functional.cpu_adam_segments_(master[a:b], grads, [o - a for o in offsets[first : last + 1]], **kw)


class _Worker:
    """One thread: buckets are updated in submission order, each with the kernel's own intra-op parallelism (the
    kernel releases the GIL)."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None

    def submit(self, fn: Callable, *args) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero_offload_step")
        return self._pool.submit(fn, *args)


class Immediate:
    """The default schedule: ``step()`` updates every bucket, sending each back while the next is updated."""

    def __init__(self, transport: Transport):
        self.transport = transport

    def before_send(self, bucket: FlatBucket) -> None:
        """Called by the backward hooks before a bucket's gradients are sent."""

    def after_send(self, bucket: FlatBucket, group: int) -> None:
        """Called by the backward hooks once a bucket's gradients are on their way."""

    def settle(self) -> None:
        """Wait for updates started during backward (re-raising the first failure)."""

    def check_received(self, bg: BucketGrads) -> None:
        """Refuse what this schedule cannot take (a gradient edited after its bucket was already updated)."""

    def check_scaler(self) -> None:
        """Refuse a GradScaler if this schedule cannot wait for its inf check."""

    def updated(self, bucket: FlatBucket) -> bool:
        """Whether the bucket's update for this step has already run."""
        return False

    def observe(self, inv_scale: float, clip: Optional[Any]) -> None:
        """``step()`` is about to :meth:`run` with this loss-scale inverse and this pending clip (a
        ``PendingClip`` or None)."""

    def run(self, hypers: Sequence[Hyper], plans: Plans, multiplier: float, state: State) -> None:
        """Update every bucket of ``plans`` not yet updated, and send the results back."""
        _ensure_amsgrad(state, hypers, plans)
        buckets = [bg.bucket for bg in chain.from_iterable(plans)]
        self.transport.before_uploads(buckets)
        for hyper, group_plan in zip(hypers, plans):
            for bg in group_plan:
                if not self.updated(bg.bucket):
                    update_bucket(self.transport, bg.bucket, bg.present, bg.in_place, hyper, multiplier, state)
        self.transport.finish_params(buckets)  # sharded: the all-gathers, each overlapped with the next update

    def flush(self, state: State) -> None:
        """Apply any update still pending."""

    def ahead(self) -> Dict[int, Ahead]:
        """The state any pending update will leave, by ``id`` of bucket, without applying it (for saving)."""
        return {}

    def drop(self) -> None:
        """Discard any update still pending (the state is about to be replaced)."""

    def reset(self) -> None:
        """The step is over (or abandoned): forget its per-bucket progress."""


class Overlap(Immediate):
    """``overlap_step``: each bucket's update runs in a worker thread as soon as backward has sent its gradients,
    with the hyperparameters as they are then (what ``step()`` would read); ``step()`` only updates the buckets
    backward did not launch, and waits.

    Args:
        transport (Transport): the optimizer's transport.
        early_update (Callable[[FlatBucket, int], None]): runs one bucket's update (bucket, its group index).
    """

    def __init__(self, transport: Transport, early_update: Callable[[FlatBucket, int], None]):
        super().__init__(transport)
        self._early_update = early_update
        self._worker = _Worker()
        self._jobs: Dict[int, Future] = {}
        self._raised = False  # settle() has raised a job's failure this step

    def before_send(self, bucket: FlatBucket) -> None:
        if id(bucket) in self._jobs:
            raise RuntimeError(
                "OffloadOptimizer(overlap_step=True): a second backward before step() reached a bucket that was "
                "already updated. Run every micro-batch but the last under `with optimizer.no_sync():`."
            )

    def after_send(self, bucket: FlatBucket, group: int) -> None:
        self._jobs[id(bucket)] = self._worker.submit(self._early_update, bucket, group)

    def settle(self) -> None:
        for job in list(self._jobs.values()):
            if job.exception() is not None:
                self._raised = True
            job.result()

    def check_received(self, bg: BucketGrads) -> None:
        if self.updated(bg.bucket) and any(g is not None for g in bg.pending):
            raise RuntimeError(
                "OffloadOptimizer(overlap_step=True): a gradient was assigned or changed in place after "
                "backward (by clipping or unscaling?), but its bucket was already updated during "
                "backward. With overlap_step, clip with optimizer.clip_grad_norm_ is not possible either: "
                "turn overlap_step off to clip or to use a GradScaler."
            )

    def check_scaler(self) -> None:
        raise RuntimeError("OffloadOptimizer(overlap_step=True) cannot be driven by a GradScaler: the scaler's "
                           "inf check comes after backward, when buckets were already updated. Turn "
                           "overlap_step off, or use bf16 autocast, which needs no scaler.")

    def updated(self, bucket: FlatBucket) -> bool:
        return id(bucket) in self._jobs

    def reset(self) -> None:
        jobs, self._jobs = self._jobs, {}
        raised, self._raised = self._raised, False
        for job in jobs.values():
            if job.exception() is not None and not raised:  # (waits for the job) not yet seen by settle()
                job.result()


@dataclasses.dataclass
class _Pending:
    """A step's update held back by ``delayed_update``: ``run`` computes it; ``job`` is it running in the worker;
    ``work`` (bucket, which parameters, hyperparameters) and ``multiplier`` are what it was given."""

    run: Callable[[], List[Tuple[FlatBucket, Optional[List[int]]]]]
    job: Optional[Future]
    work: List[Tuple[FlatBucket, Sequence[bool], Hyper]]
    multiplier: float


class Delayed(Immediate):
    """``delayed_update``, ZeRO-Offload's delayed parameter update: ``step()`` applies the *previous* step's update
    (sending its parameters back) and starts this step's from a second gradient buffer, in the worker thread while
    the next forward and backward run (with the model on CPU, at the next ``step()``: the parameters *are* the
    masters there). Hyperparameters, clipping and loss scaling of a step apply to its own gradients.

    ``exact_steps``: the updates that take a parameter's step count up to this many are applied before ``step()``
    returns, as without delay (counted from the state, so a resumed run goes on where it was)."""

    def __init__(self, transport: Transport, exact_steps: int = 0):
        super().__init__(transport)
        self._worker = _Worker()
        self._pending: Optional[_Pending] = None
        self._exact_steps = exact_steps

    def run(self, hypers: Sequence[Hyper], plans: Plans, multiplier: float, state: State) -> None:
        self.flush(state)
        _ensure_amsgrad(state, hypers, plans)
        work = []
        for hyper, group_plan in zip(hypers, plans):
            for bg in group_plan:
                if bg.in_place is not None:  # never for streamed buckets, which every bucket is here
                    raise AssertionError("delayed_update with gradients read in place")
                if bg.bucket.runs(bg.present):
                    self.transport.wait_grads(bg.bucket)
                    bg.bucket.swap_grad_buffers()
                    work.append((bg.bucket, bg.present, hyper))
        transport = self.transport

        def run() -> List[Tuple[FlatBucket, Optional[List[int]]]]:
            return [(b, update_bucket(transport, b, present, None, h, multiplier, state, grad=b.grad_prev,
                                      scatter=False)) for b, present, h in work]

        # Read before the worker starts on the step counts; only while a warm-up is asked for (a tensor read per
        # bucket per step otherwise).
        exact = bool(self._exact_steps and work) and max(float(b.steps.max()) for b, _, _ in work) < self._exact_steps
        on_gpu = any(not b.on_cpu for b, _, _ in work)
        self._pending = _Pending(run, self._worker.submit(run) if on_gpu else None, work, multiplier)
        if exact:
            self.flush(state)

    def flush(self, state: State) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        done = [(b, idx) for b, idx in (pending.job.result() if pending.job is not None else pending.run())
                if idx is not None]
        buckets = [b for b, _ in done]
        self.transport.before_uploads(buckets)
        for bucket, indices in done:
            self.transport.send_params(bucket, indices)
        self.transport.finish_params(buckets)

    def ahead(self) -> Dict[int, Ahead]:
        """Saving must not change the run, so the pending update is neither applied early nor sent: on CUDA the
        worker writes it into the buffers anyway (waited for here; the parameters still get it at the next
        ``step()``); on the CPU, where the buffers are the parameters the next forward reads, it is computed into
        copies of each bucket's buffers."""
        pending = self._pending
        if pending is None:
            return {}
        if pending.job is not None:
            return {id(b): Ahead(set(idx)) for b, idx in pending.job.result() if idx is not None}
        out = {}
        for bucket, present, hyper in pending.work:
            after = preview_bucket(bucket, present, hyper, pending.multiplier, grad=bucket.grad_prev)
            if after is not None:
                out[id(bucket)] = after
        return out

    def drop(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and pending.job is not None:
            pending.job.result()


def make_mode(options: Options, transport: Transport,
              early_update: Optional[Callable[[FlatBucket, int], None]] = None,
              inputs: Optional[Callable[[int], Tuple[Hyper, str]]] = None) -> Immediate:
    """The schedule ``options`` ask for (``inputs``: what speculation reads of a group, see
    :class:`~zero_offload.speculation.Speculative`)."""
    if options.overlap_step:
        return Overlap(transport, early_update)
    if options.delayed_update:
        return Delayed(transport, options.delayed_exact_steps)
    if options.speculates and inputs is not None:
        from zero_offload.speculation import Speculative  # (it builds on this module)
        return Speculative(transport, inputs)
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

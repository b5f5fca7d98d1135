"""Lion (:class:`zero_offload.Lion`) over flat host buffers: the state dict is ``zero_offload.Lion``'s (``exp_avg``
only, no step count), the update torch's own CPU ops over cache-sized chunks of the run (the fused-torch path: a
handful of in-cache passes per chunk, no SIMD kernel of ours), ``exp_avg`` in fp32 or bf16."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch

from zero_offload._torch_fused import scaled_fp32
from zero_offload.lion import Lion as LionOptimizer, _multi_tensor_lion, _single_tensor_lion, check_lion_hparams
from zero_offload.rules.base import Rule, Run, StateBuffer, flat_grad, grads_like

__all__ = ["Lion", "Hyper", "LION"]

# Elements per chunk: the chunk's gradient, update and (bf16 state) fp32 momentum (1 MiB each) stay in cache between
# the passes, each torch op over it is long enough to split over many threads, and the Python cost per chunk (about
# ten op calls) is small beside its work. 64K-1M measured within noise of each other on one thread; 32K slower.
CHUNK = 1 << 18


@dataclasses.dataclass(frozen=True)
class Hyper:
    """One group's Lion hyperparameters as plain floats, read (and validated) at the start of a step."""

    lr: float
    beta1: float
    beta2: float
    weight_decay: float
    maximize: bool

    # The fields by the names a user gives them (messages of the ranks' agreement).
    user_names: ClassVar[Dict[str, str]] = {"lr": "lr", "beta1": "betas[0]", "beta2": "betas[1]",
                                            "weight_decay": "weight_decay", "maximize": "maximize"}

    @staticmethod
    def read(group: Dict[str, Any]) -> "Hyper":
        lr = group["lr"]
        lr = lr.item() if isinstance(lr, torch.Tensor) else lr
        check_lion_hparams(lr, group["betas"], group["weight_decay"])
        b1, b2 = group["betas"]
        return Hyper(float(lr), float(b1), float(b2), float(group["weight_decay"]), bool(group["maximize"]))


class Lion(Rule):
    """Lion with decoupled weight decay and maximize; ``exp_avg`` in fp32 or bf16 (8-bit state is not offered)."""

    name = "Lion"
    optimizer_class = LionOptimizer
    buffers = (StateBuffer("exp_avg"),)
    step_key: Optional[str] = None  # the update does not depend on the step count (see zero_offload.Lion)
    state_dtypes = (torch.float32, torch.bfloat16)
    defaults = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False, foreach=None)

    def hyper(self, group: Dict[str, Any]) -> Hyper:
        return Hyper.read(group)

    def update(self, run: Run, hyper: Hyper) -> None:
        grad, master, exp_avg = flat_grad(run), run.master, run.state["exp_avg"]
        n = master.numel()
        scale = -run.grad_scale if hyper.maximize else run.grad_scale
        decay = 1.0 - hyper.lr * hyper.weight_decay
        # param_out may be the gradient's own memory: each chunk's gradient is read before its parameter is written.
        out = run.param_out if run.grads is None else None
        g_buf, c_buf = torch.empty(min(n, CHUNK)), torch.empty(min(n, CHUNK))
        m_buf = torch.empty(min(n, CHUNK)) if exp_avg.dtype != torch.float32 else None
        for a in range(0, n, CHUNK):
            b = min(a + CHUNK, n)
            g, c = g_buf[: b - a].copy_(grad[a:b]), c_buf[: b - a]
            if scale != 1.0:
                g.mul_(scale)
            m = exp_avg[a:b] if m_buf is None else m_buf[: b - a].copy_(exp_avg[a:b])
            torch.lerp(m, g, 1.0 - hyper.beta1, out=c).sign_()
            p = master[a:b]
            if decay != 1.0:
                p.mul_(decay)
            p.add_(c, alpha=-hyper.lr)
            m.lerp_(g, 1.0 - hyper.beta2)
            if m_buf is not None:
                exp_avg[a:b].copy_(m)  # rounded to nearest even
            if out is not None:
                out[a:b].copy_(p)
        if run.param_out is not None and run.grads is not None and run.grads:
            torch._foreach_copy_([run.param_out[o:o + g.numel()] for o, g in zip(run.offsets, run.grads)],
                                 [master[o:o + g.numel()] for o, g in zip(run.offsets, run.grads)])

    device_update = True
    device_views = True

    def update_on_device(self, run: Run, hyper: Hyper) -> None:
        """:class:`zero_offload.Lion`'s own code over the run on its GPU (a parked or resident bucket, or this rank's
        shard of one): its multi-tensor implementation for CUDA tensors, as the class picks with ``foreach=None``
        (single-tensor elsewhere), on the gradients times ``grad_scale``. The update is elementwise, so it runs over
        whatever pieces the gradients come in: per-parameter gradients (a bucket on one GPU) with per-parameter
        views of the master and ``exp_avg`` (no flat copy of the gradients is made, nor its memory held), a flat
        gradient (a rank's shard, the reduce-scatter's output) with the flat buffers. The per-parameter views are
        the home's (:attr:`Run.views`, cut once, not per step), the gradients laid out as they are
        (:func:`~zero_offload.rules.base.grads_like`: a channels-last parameter's is read from its slot, flat)."""
        views = run.views
        if views is not None:
            masters, exp_avgs = views["master"], views["exp_avg"]
            grads = grads_like(run.grads, masters)
        else:
            masters, grads, exp_avgs = _pieces(run)
        grads = scaled_fp32(grads, run.grad_scale)  # (new tensors where they change: the gradients are not written)
        impl = _multi_tensor_lion if run.master.is_cuda else _single_tensor_lion
        impl(masters, grads, exp_avgs, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
             weight_decay=hyper.weight_decay, maximize=hyper.maximize)
        if run.param_out is not None:
            run.param_out.copy_(run.master)


def _pieces(run: Run) -> Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
    """The master, the gradients and ``exp_avg`` of a run as matching lists: per parameter (views of the flat
    buffers; the padding between slots, which an elementwise update leaves at zero, left out) where the gradients
    come per parameter, else the flat run itself."""
    master, exp_avg = run.master, run.state["exp_avg"]
    if run.grads is None:
        return [master], [run.grad], [exp_avg]
    spans = [(o, o + g.numel()) for o, g in zip(run.offsets, run.grads)]
    return ([master[a:b] for a, b in spans], [g.reshape(-1) for g in run.grads],
            [exp_avg[a:b] for a, b in spans])

LION = Lion()

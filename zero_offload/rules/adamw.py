"""Adam and AdamW (one rule, ``decoupled_weight_decay`` picks), over the fused CPU kernel of
:mod:`zero_offload.functional`: the state dict is ``torch.optim.AdamW``'s (``step``, ``exp_avg``, ``exp_avg_sq``,
with amsgrad ``max_exp_avg_sq``)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from typing import Any, ClassVar, Dict, List, Tuple

import torch

from zero_offload import _torch_fused, functional
from zero_offload.functional import check_hparams
from zero_offload.options import check_group
from zero_offload.rules.base import Rule, Run, StateBuffer, grads_like

__all__ = ["AdamW", "Hyper", "ADAMW"]


@dataclasses.dataclass(frozen=True)
class Hyper:
    """One group's hyperparameters as plain floats, read (and validated) at the start of a step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool
    decoupled: bool

    # The fields by the names a user gives them (messages of the ranks' agreement).
    user_names: ClassVar[Dict[str, str]] = {
        "lr": "lr", "beta1": "betas[0]", "beta2": "betas[1]", "eps": "eps", "weight_decay": "weight_decay",
        "amsgrad": "amsgrad", "maximize": "maximize", "decoupled": "decoupled_weight_decay"}

    @staticmethod
    def read(group: Dict[str, Any]) -> "Hyper":
        check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        b1, b2 = group["betas"]
        return Hyper(float(group["lr"]), float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]),
                     bool(group["amsgrad"]), bool(group["maximize"]), bool(group["decoupled_weight_decay"]))


_PLAIN = (float, int, bool)


@functools.lru_cache(maxsize=1024)
def _read_plain(key: tuple) -> Hyper:
    lr, b1, b2, eps, wd, amsgrad, maximize, decoupled = key
    return Hyper.read(dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, amsgrad=amsgrad, maximize=maximize,
                           decoupled_weight_decay=decoupled))


def _kernel_args(h: Hyper) -> Tuple[float, float, float, float, float, bool, bool]:
    """The kernel's hyperparameter arguments that follow the step count: lr, beta1, beta2, eps, weight_decay,
    decoupled, maximize."""
    return h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled, h.maximize


class AdamW(Rule):
    """Adam(W) with amsgrad and maximize, the moments in any codec (fp32, bf16, 8-bit block-wise)."""

    name = "Adam(W)"
    optimizer_class = torch.optim.AdamW
    buffers = (StateBuffer("exp_avg"), StateBuffer("exp_avg_sq", signed=False),
               StateBuffer("max_exp_avg_sq", signed=False, needed=operator.attrgetter("amsgrad"), switch="amsgrad"))
    step_key = "step"
    state_dtypes = (torch.float32, torch.bfloat16, torch.int8)
    defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False,
                    decoupled_weight_decay=True)

    # What torch.optim.Adam.__setstate__ gives a loaded group that lacks these flags (an older checkpoint).
    loaded_defaults = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                           fused=None)
    cleared_flags = ("capturable", "differentiable")  # not honoured here; a loaded AdamW group may carry them

    def forced_on_load(self, defaults: Dict[str, Any]) -> Dict[str, Any]:
        # torch.optim.AdamW.__setstate__ makes every loaded group decoupled (an Adam checkpoint loaded into AdamW
        # steps as AdamW); Adam's keeps what the group says (False where it says nothing: loaded_defaults).
        return {"decoupled_weight_decay": True} if defaults.get("decoupled_weight_decay") else {}

    def hyper(self, group: Dict[str, Any]) -> Hyper:
        # Read at every step for every group: plain numbers are looked up, already
        # validated (a hit costs no Python call); a tensor hyperparameter, which may change in place, is read anew.
        betas = group["betas"]
        key = (group["lr"], *betas, group["eps"], group["weight_decay"], group["amsgrad"], group["maximize"],
               group["decoupled_weight_decay"]) if type(betas) is tuple and len(betas) == 2 else None
        if key is None or not all(type(v) in _PLAIN for v in key):
            return Hyper.read(group)
        return _read_plain(key)

    def check_settings(self, group: Dict[str, Any]) -> None:
        check_group(group)

    def update(self, run: Run, hyper: Hyper) -> None:
        state, scales = run.state, run.scales
        vmax = state["max_exp_avg_sq"] if hyper.amsgrad else None  # (a buffer kept from an amsgrad group: unread)
        q8_kw = {f"{name}_scale": scales.get(name) for name in ("exp_avg", "exp_avg_sq")}
        q8_kw["max_exp_avg_sq_scale"] = scales.get("max_exp_avg_sq") if hyper.amsgrad else None
        functional.adam_own_(run.master, run.grad if run.grads is None else run.grads,
                             None if run.grads is None else run.offsets, (state["exp_avg"], state["exp_avg_sq"], vmax),
                             run.param_out, q8_kw, (run.step, *_kernel_args(hyper), run.grad_scale))

    device_update = True
    device_views = True

    def update_on_device(self, run: Run, hyper: Hyper) -> None:
        """torch's fused Adam(W) over the run (one kernel call): fp32 master and moments, the gradient multiplied
        in fp32 first (see :mod:`zero_offload._torch_fused`), the low-precision parameter written as the master
        rounded to nearest. Per-parameter gradients (a bucket on one GPU) are stepped where autograd left them,
        beside the home's views of the master and the moments (:attr:`Run.views`: cut once, not per step), and the
        low-precision parameters are written in one copy of the run's flat range (every slot of a run has a
        gradient; the padding between slots is zero in both buffers); a flat gradient (a rank's shard), or a run
        without the home's views (an update into copies), steps the flat buffers or pieces cut from them."""
        if not _torch_fused.available_on(run.master.device):
            raise RuntimeError(f"gpu_fraction: torch {torch.__version__} has no fused Adam kernel for "
                               f"{run.master.device.type} tensors")
        names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if hyper.amsgrad else [])
        views = run.views
        if views is not None and not any(map(operator.is_, run.grads, itertools.repeat(None))):
            pieces, outs = {k: views[k] for k in ["master", *names]}, None
            grads = grads_like(run.grads, pieces["master"])
        else:
            pieces, grads = _pieces(run, names)
            outs = pieces.get("out")
        _torch_fused.adam_(pieces["master"], grads, pieces["exp_avg"], pieces["exp_avg_sq"],
                           pieces.get("max_exp_avg_sq"), step=run.step, lr=hyper.lr, beta1=hyper.beta1,
                           beta2=hyper.beta2, eps=hyper.eps, weight_decay=hyper.weight_decay,
                           decoupled_weight_decay=hyper.decoupled, maximize=hyper.maximize,
                           grad_scale=run.grad_scale, param_outs=outs)
        if outs is None and run.param_out is not None:
            run.param_out.copy_(run.master)


def _pieces(run: Run, names: List[str]) -> Tuple[Dict[str, List[torch.Tensor]], List[torch.Tensor]]:
    """The run's master, buffers ``names`` and low-precision destination (``"out"``) as lists the fused kernel
    takes, with the gradients: the flat run itself, or per parameter that has a gradient, its slot's range."""
    whole = {"master": run.master, **{n: run.state[n] for n in names}}
    if run.param_out is not None:
        whole["out"] = run.param_out
    if run.grads is None:
        return {k: [t] for k, t in whole.items()}, [run.grad]
    cut = [(o, g) for o, g in zip(run.offsets, run.grads) if g is not None]
    return {k: [t[o : o + g.numel()] for o, g in cut] for k, t in whole.items()}, [g.reshape(-1) for _, g in cut]


ADAMW = AdamW()

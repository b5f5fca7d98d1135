"""Lion (EvoLved Sign Momentum, Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") as a plain
``torch.optim.Optimizer``: pure torch, any device. It is the reference of zero_offload's offloaded Lion rule
(:mod:`zero_offload.rules.lion`) and what ``zero_offload.offload(zero_offload.Lion, ...)`` offloads.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Tuple, Union

import torch

__all__ = ["Lion", "check_lion_hparams"]


def check_lion_hparams(lr: Any, betas: Any, weight_decay: Any) -> None:
    """Lion's hyperparameter validation, shared by :class:`Lion` and its offloaded rule (one set of messages)."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (a pair (beta1, beta2))")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class Lion(torch.optim.Optimizer):
    r"""Lion: the sign of an interpolated momentum as the update, decoupled weight decay.

    .. math::
        \begin{aligned}
            &c_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t \\
            &\theta_t = \theta_{t-1}(1 - \gamma\lambda) - \gamma\,\mathrm{sign}(c_t) \\
            &m_t = \beta_2 m_{t-1} + (1 - \beta_2) g_t
        \end{aligned}

    with :math:`g_t` negated when ``maximize``. The state of a parameter is ``exp_avg`` (:math:`m`, zeros before
    the first step) only: the update does not depend on the step count, so, like the authors' and the common
    reference implementations, no ``step`` is kept. Lion's steps are ``sign`` steps of size ``lr``: the paper
    suggests an ``lr`` 3-10x smaller and a ``weight_decay`` 3-10x larger than AdamW's.

    Args:
        params (iterable): parameters or parameter groups to optimize.
        lr (float or Tensor): learning rate :math:`\gamma`. Default: 1e-4.
        betas (Tuple[float, float]): :math:`\beta_1` (interpolation of the update) and :math:`\beta_2` (momentum
            decay). Default: (0.9, 0.99).
        weight_decay (float): decoupled weight decay :math:`\lambda`. Default: 0.0.
        maximize (bool): maximize the objective instead of minimizing. Default: False.
        foreach (bool, optional): use the multi-tensor (``torch._foreach_*``) implementation; None: on for CUDA
            tensors, off otherwise (torch's own default). Both give the same result up to rounding of ``lerp``.
    """

    def __init__(self, params: Iterable[Any], lr: Union[float, torch.Tensor] = 1e-4,
                 betas: Tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0, *, maximize: bool = False,
                 foreach: Optional[bool] = None) -> None:
        check_lion_hparams(lr, betas, weight_decay)
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize, foreach=foreach)
        super().__init__(params, defaults)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Perform one optimization step. ``closure`` (optional) re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: List[torch.Tensor] = []
            grads: List[torch.Tensor] = []
            exp_avgs: List[torch.Tensor] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
            foreach = group["foreach"]
            if foreach is None:
                foreach = bool(params) and all(p.is_cuda for p in params)
            impl = _multi_tensor_lion if foreach else _single_tensor_lion
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            lr = lr.item() if isinstance(lr, torch.Tensor) else lr  # (add_'s alpha takes a number)
            impl(params, grads, exp_avgs, lr=lr, beta1=beta1, beta2=beta2,
                 weight_decay=group["weight_decay"], maximize=group["maximize"])
        return loss


def _single_tensor_lion(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor], *,
                        lr: float, beta1: float, beta2: float, weight_decay: float, maximize: bool) -> None:
    for param, grad, exp_avg in zip(params, grads, exp_avgs):
        if maximize:
            grad = -grad
        if torch.is_complex(param):
            param, grad, exp_avg = (torch.view_as_real(t) for t in (param, grad, exp_avg))
        update = exp_avg.lerp(grad, 1 - beta1).sign_()
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        param.add_(update, alpha=-lr)
        exp_avg.lerp_(grad, 1 - beta2)


def _multi_tensor_lion(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor], *,
                       lr: float, beta1: float, beta2: float, weight_decay: float, maximize: bool) -> None:
    if not params:
        return
    params, grads, exp_avgs = ([torch.view_as_real(t) if torch.is_complex(t) else t for t in ts]
                               for ts in (params, grads, exp_avgs))
    if maximize:
        grads = torch._foreach_neg(grads)
    updates = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
    torch._foreach_sign_(updates)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, updates, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta2)

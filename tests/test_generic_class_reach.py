"""Issue 54: what a wrapped class reaches beyond one parameter's state, run through ``zero_offload.offload(cls, ...)``
against the class itself (every step, parameters and state), or refused naming the real reason with nothing
changed:

* state outside the optimizer (a class attribute counting steps): refused as such, not as random draws.
"""

from __future__ import annotations

import pytest
import torch

from zero_offload import offload
from zero_offload.rules.torch_class import Refused


# ----------------------------------------------------------------------------- state outside the optimizer --
class ClassCountedSGD(torch.optim.Optimizer):
    """SGD whose step size decays with a count kept on the class (shared by every instance, never reset)."""

    calls = 0

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        type(self).calls += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / type(self).calls ** 0.5)


class NoisySGD(torch.optim.SGD):
    """SGD with gradient noise from torch's global generator."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.add_(torch.randn_like(p.grad), alpha=0.01)
        return super().step()


def test_a_class_counting_steps_outside_the_optimizer_is_refused_as_such_not_as_random():
    model = torch.nn.Linear(4, 3)
    with pytest.raises(Refused, match="ClassCountedSGD cannot be offloaded faithfully: .*replay .*identical "
                                      ".*without drawing random numbers.*outside the optimizer") as info:
        offload(ClassCountedSGD, model.parameters())
    assert "it draws random numbers" not in str(info.value)
    with pytest.raises(Refused, match="NoisySGD cannot be offloaded faithfully: .*it draws random numbers"):
        offload(NoisySGD, model.parameters(), lr=0.1)

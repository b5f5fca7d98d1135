"""``zero_offload.Lion``, the plain torch optimizer, against Lion's formula written out element by element in Python
floats (Chen et al. 2023, Algorithm 2): ``c = b1*m + (1-b1)*g; p = p*(1 - lr*wd) - lr*sign(c); m = b2*m + (1-b2)*g``.

Both implementations (foreach=False, the reference of the offloaded rule, and foreach=True) are checked every step,
params and ``exp_avg``, over the SIMD tail sizes; then its torch.optim conventions (defaults, validation, the state
dict round trip, LR schedulers, a parameter without a gradient).
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from zero_offload import Lion

SIZES = [1, 7, 15, 17, 4097]
STEPS = 6


def _sign(x: float) -> float:
    return (x > 0) - (x < 0)


def _formula(p, m, g, lr, b1, b2, wd, maximize):
    """One Lion step of one element, in Python floats (float64)."""
    g = -g if maximize else g
    c = b1 * m + (1 - b1) * g
    p = p * (1 - lr * wd) - lr * _sign(c)
    m = b2 * m + (1 - b2) * g
    return p, m


def _grads(n: int, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for _ in range(steps)]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("wd,maximize", [(0.0, False), (0.1, False), (0.3, True)])
def test_lion_matches_formula(n, foreach, wd, maximize):
    lr, b1, b2 = 0.01, 0.9, 0.99
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(n))
    param = torch.nn.Parameter(p0.clone())
    opt = Lion([param], lr=lr, betas=(b1, b2), weight_decay=wd, maximize=maximize, foreach=foreach)
    ps, ms = p0.double().tolist(), [0.0] * n
    for g in _grads(n, STEPS, seed=n + 1):
        param.grad = g.clone()
        opt.step()
        for i in range(n):
            ps[i], ms[i] = _formula(ps[i], ms[i], float(g[i]), lr, b1, b2, wd, maximize)
        torch.testing.assert_close(param.detach(), torch.tensor(ps, dtype=torch.float32))
        torch.testing.assert_close(opt.state[param]["exp_avg"], torch.tensor(ms, dtype=torch.float32))
    assert set(opt.state[param]) == {"exp_avg"}


def test_lion_foreach_matches_single_tensor_on_many_shapes():
    shapes = [(3, 5), (1,), (17,), (2, 3, 4)]
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in shapes]
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.clone()) for t in init]
    opt_a = Lion(a, lr=0.1, weight_decay=0.2, foreach=False)
    opt_b = Lion(b, lr=0.1, weight_decay=0.2, foreach=True)
    for _ in range(STEPS):
        for x, y in zip(a, b):
            x.grad = torch.randn(x.shape, generator=gen)
            y.grad = x.grad.clone()
        opt_a.step()
        opt_b.step()
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)
            torch.testing.assert_close(opt_a.state[x]["exp_avg"], opt_b.state[y]["exp_avg"])


def test_lion_defaults_and_validation():
    opt = Lion([torch.nn.Parameter(torch.zeros(2))])
    assert opt.defaults == dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False, foreach=None)
    p = [torch.nn.Parameter(torch.zeros(2))]
    for kwargs, msg in [(dict(lr=-1.0), "Invalid learning rate: -1.0"),
                        (dict(betas=(1.0, 0.99)), "Invalid beta parameter at index 0: 1.0"),
                        (dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1: -0.1"),
                        (dict(weight_decay=-0.5), "Invalid weight_decay value: -0.5")]:
        with pytest.raises(ValueError, match=msg):
            Lion(p, **kwargs)


def test_lion_skips_params_without_grad_and_refuses_sparse():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = Lion([a, b], lr=0.5)
    a.grad = torch.ones(3)
    opt.step()
    torch.testing.assert_close(a.detach(), torch.full((3,), 0.5))
    torch.testing.assert_close(b.detach(), torch.ones(3))
    assert b not in opt.state
    b.grad = torch.ones(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_lion_state_dict_round_trip_mid_run():
    gen = torch.Generator().manual_seed(3)
    a = torch.nn.Parameter(torch.randn(4, 7, generator=gen))
    b = torch.nn.Parameter(a.detach().clone())
    opt_a = Lion([a], lr=0.02, weight_decay=0.1, foreach=False)
    grads = [torch.randn(4, 7, generator=gen) for _ in range(6)]
    for g in grads[:3]:
        a.grad = g.clone()
        opt_a.step()
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    buf.seek(0)
    b.data.copy_(a.detach())
    opt_b = Lion([b], lr=1.0)  # the loaded param_groups replace these settings
    opt_b.load_state_dict(torch.load(buf))
    assert opt_b.param_groups[0]["lr"] == 0.02 and opt_b.param_groups[0]["weight_decay"] == 0.1
    for g in grads[3:]:
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(opt_a.state[a]["exp_avg"], opt_b.state[b]["exp_avg"])


def test_lion_with_lr_scheduler_and_tensor_lr():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = Lion([p], lr=torch.tensor(0.5))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    total = 0.0
    for _ in range(3):
        p.grad = -torch.ones(3)
        total += float(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert math.isclose(total, 0.5 + 0.25 + 0.125)
    torch.testing.assert_close(p.detach(), torch.full((3,), total))

"""A hostile user's pass on the drop-in promise: ``torch.optim.AdamW(...)`` swapped for ``OffloadOptimizer(...)``
with the same arguments and nothing else changed. What was tried and already behaved (constructor arguments and
their edge values, schedulers, param-group edits, state inspection and state dicts both ways, hooks, closures,
GradScaler, clipping, odd parameters...) is listed in the pass's report; these tests are its findings, each against
``torch.optim.AdamW(foreach=False)`` every step (parameters and state, default fp32 tolerance), or a refusal that
names the problem and changes nothing.

GPU parameters are the stand-ins of tests/cuda_standins.py (the buckets are told their parameters are on ``cuda:0``;
streams and events order nothing), so the host route of a GPU bucket (a separate fp32 master on the host, copied
into the parameter after each update) runs its Python for real on a CPU-only machine.
"""

from __future__ import annotations

import copy

import pytest
import torch

import cuda_standins
from test_optimizer import TinyTransformer, assert_same, loss_fn, param_groups, snapshot
from zero_offload import OffloadOptimizer

STEPS = 5
REPLACE_AT = 2


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch, needs_fused=False)


# -- a GPU parameter whose data is replaced --------------------------------------------------------------------------
def _halve_by_data(model):
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data * 0.5


def _halve_by_vector(model):
    """``torch.nn.utils.vector_to_parameters`` assigns each parameter's ``.data`` (a model averaged, perturbed or
    restored from a flat vector: SAM, evolution strategies, model soups)."""
    vec = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.nn.utils.vector_to_parameters(vec * 0.5, model.parameters())


@pytest.mark.parametrize("replace", [_halve_by_data, _halve_by_vector], ids=["p.data=", "vector_to_parameters"])
@pytest.mark.parametrize("placement", ["host", {"resident": 0.3, "parked": 0.4}], ids=["host", "mix"])
def test_replaced_data_of_a_gpu_parameter_trains_on_as_adamw(cuda_branches, replace, placement):
    """AdamW follows the ``Parameter``: whatever its data was replaced with is what the next step starts from. A GPU
    parameter stepped on the host (a separate fp32 master there) kept training from the old master, writing over
    the replacement without a word (replacement moves no version counter; CPU parameters were followed)."""
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    ours = OffloadOptimizer(param_groups(model), placement=placement, bucket_numel=1000)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    assert any(b.home.kind == "host" and not b.on_cpu for g in ours._buckets for b in g)
    for step in range(STEPS):
        for m, opt in ((model, ours), (ref_model, ref)):
            opt.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
            if step == REPLACE_AT:
                replace(m)
            opt.step()
        assert_same(model, ref_model, ours, ref, f"step {step}")


def test_a_gpu_parameter_replaced_by_another_shape_is_refused_naming_it(cuda_branches):
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model), placement="host", bucket_numel=1000)
    for step in range(2):
        opt.zero_grad()
        loss_fn(model, step, 0, "cpu").backward()
        opt.step()
    before = snapshot(model, opt)
    opt.zero_grad()
    loss_fn(model, 2, 0, "cpu").backward()
    model.tok.weight.data = torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"data was moved, cast or reshaped .* it was \(31, 16\) torch.float32 "
                                           r"on cuda:0 \(stand-in\), it is now \(3,\) torch.float32 on cpu"):
        opt.step()
    now = opt.state_dict()
    for k, entry in before[1]["state"].items():
        for key, value in entry.items():
            assert torch.equal(now["state"][k][key], value), (k, key)

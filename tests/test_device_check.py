"""The GPU-stepped homes (parked, resident, the placement "auto" chooses) and the classes run there, on the CUDA
stand-ins with every tensor's device checked (tests/device_check.py): the model, its data and what is allocated for
the stand-in device count as GPU memory, the optimizer's host buffers as host memory, and an op that mixes them
(which torch refuses on a GPU, and nothing refuses on the stand-ins, where both are CPU tensors) fails the test.
Last session's bug, a parked elementwise class's gradients gathered into a host buffer and handed to a GPU update,
is the kind this catches. Each run is compared with the reference (AdamW foreach=False, the class itself) every
step, parameters and state, at default fp32 tolerance; and the host reads of GPU values that ``zero_offload`` makes
(each a synchronisation on a GPU) are counted: one or two a step (the on-device buckets' norm and inf/nan check, an
edit check after clipping), not one per bucket (these models have 6 to 10)."""

from __future__ import annotations

import copy

import pytest
import torch

import cuda_standins
from device_check import CrossDevice, DeviceCheck
from test_optimizer import TinyTransformer, assert_same, loss_fn, param_groups
from test_placement import GPU_RECIPES
from test_twin_flow import BUCKET
import zero_offload
from zero_offload import OffloadOptimizer, offload

STEPS = 4


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch, needs_fused=False)


def test_the_check_refuses_a_host_tensor_beside_a_gpu_one(cuda_branches):
    """The checker itself: what it counts as GPU memory, what it refuses, what it counts as a host read."""
    OffloadOptimizer([torch.nn.Parameter(torch.ones(8))])  # (the fixture checks that the stand-ins were used)
    p = torch.ones(8, requires_grad=True)
    with DeviceCheck() as check:
        check.mark(p)
        assert p.device.type == "cuda" and p.is_cuda
        made = torch.zeros(8, device=p.device)  # (allocated where p is: on the GPU)
        assert check.on_device(made) and check.on_device(p * 2) and check.on_device(p[2:4])
        with pytest.raises(CrossDevice, match="aten.add"):
            p + torch.zeros(8)  # a host buffer beside a GPU tensor
        with pytest.raises(CrossDevice, match="_foreach_lerp"):
            torch._foreach_lerp([p.detach()], [torch.zeros(8)], 0.5)
        p + torch.tensor(2.0)  # a host scalar: CUDA ops take it
        host = torch.empty(8)
        host.copy_(p.detach())  # a copy is what crosses
        assert not check.on_device(host) and not check.on_device(p.detach().to("cpu"))
        assert check.on_device(host.to(p.device))
        assert not check.reads
        float(p.detach().sum())
        p.tolist()
        assert check.reads["test"] == 2
    cuda_standins.Device()  # (the stand-ins untouched by the check's exit)
    assert torch.zeros(1).device.type == "cpu"


# The tests that need a real GPU, by module and name, with the arguments each is run with.
REAL_GPU_TESTS = {
    "test_park_class.test_muon_parked_on_a_gpu_is_bitwise_muon_on_the_gpu": [()],
    "test_park_factored.test_adafactor_on_a_real_gpu_is_bitwise_adafactor_on_the_gpu": [("parked",), ("resident",)],
    "test_placement.test_each_placement_on_a_gpu_matches_adamw": [(r, p) for r in GPU_RECIPES
                                                                   for p in ("parked", "mix")],
}


@pytest.mark.parametrize("name", list(REAL_GPU_TESTS))
def test_the_real_gpu_tests_of_the_homes_run_on_the_checked_stand_ins(cuda_branches, name):
    """The tests that need a real GPU (the lease plan's ``pytest -m cuda``), rehearsed here: their bodies on the
    stand-ins, devices checked (``.cuda()`` and ``.to("cuda")`` move to the stand-in GPU, every tensor compared on
    one device), so that a mistake of the test itself does not cost a lease."""
    import importlib

    module, test = name.split(".")
    body = getattr(importlib.import_module(module), test)
    cuda_branches.setattr(torch.cuda, "synchronize", lambda device=None: None)
    for args in REAL_GPU_TESTS[name]:
        with DeviceCheck():
            body(*args)


def _flat(groups) -> list:
    return [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]


def _mats(model):
    return [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("tok", "pos"))]


# (ours, the reference) over a model and its copy; clip: clipped by each.
ADAMW_CASES = {
    "mix": dict(placement={"resident": 0.3, "parked": 0.4}),  # (the three homes in one param group)
    "auto": dict(placement="auto"),
    "gpu-fraction-auto": dict(gpu_fraction="auto"),
    "parked-release-amsgrad": dict(placement="parked", release_grads=True, amsgrad=True),
    "parked-not-streamed": dict(placement="parked", stream_grads=False),
}
CLASS_CASES = {
    "lion-parked": (lambda ps: offload(zero_offload.Lion, ps, placement="parked", bucket_numel=BUCKET, foreach=True),
                    lambda ps: zero_offload.Lion(ps, foreach=True), param_groups),
    "sgd-parked": (lambda ps: offload(torch.optim.SGD, ps, lr=0.01, momentum=0.9, placement="parked",
                                      bucket_numel=BUCKET),
                   lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9), param_groups),
    "adagrad-mix": (lambda ps: offload(torch.optim.Adagrad, ps, lr=0.01, placement={"resident": 0.3, "parked": 0.4},
                                       bucket_numel=BUCKET),
                    lambda ps: torch.optim.Adagrad(ps, lr=0.01), param_groups),
    "adafactor-parked": (lambda ps: offload(torch.optim.Adafactor, ps, placement="parked", bucket_numel=BUCKET),
                         lambda ps: torch.optim.Adafactor(ps), param_groups),
    "muon-parked": (lambda ps: offload(torch.optim.Muon, ps, lr=0.02, placement="parked", bucket_numel=BUCKET),
                    lambda ps: torch.optim.Muon(ps, lr=0.02), _mats),
}


def _step(opt, model, step, clip, check=None):
    opt.zero_grad()
    loss_fn(model, step, 0, "cpu" if check is None else "cuda").backward()
    if clip is not None:
        if check is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=False)
        else:
            opt.clip_grad_norm_(clip)
    opt.step()


def _on_gpu(opt) -> list:
    return [b.home.kind for group in opt._buckets for b in group if b.home.on_device]


@pytest.mark.parametrize("case", list(ADAMW_CASES))
def test_adamw_on_the_gpu_keeps_every_tensor_on_its_device(cuda_branches, case):
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False, amsgrad=ADAMW_CASES[case].get("amsgrad", False))
    check = DeviceCheck()
    check.mark(*model.parameters())
    with check:
        opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, **ADAMW_CASES[case])
    for step in range(STEPS + 1):
        with check:
            _step(opt, model, step, 0.5, check)
        _step(ref, ref_model, step, 0.5)
        assert_same(model, ref_model, opt, ref, f"{case} step {step}")
    assert _on_gpu(opt), "no bucket was stepped on the GPU"
    assert check.ours() <= 2 * (STEPS + 1), f"a host read of a GPU value per bucket? {dict(check.reads)}"


@pytest.mark.parametrize("case", list(CLASS_CASES))
def test_a_class_on_the_gpu_keeps_every_tensor_on_its_device(cuda_branches, case):
    make, make_ref, params = CLASS_CASES[case]
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    ref = make_ref(params(ref_model))
    make(params(copy.deepcopy(model)))  # (the class's probe, cached, run outside the check: it runs on the host)
    check = DeviceCheck()
    check.mark(*model.parameters())
    with check:
        opt = make(params(model))
    for step in range(STEPS):
        with check:
            _step(opt, model, step, None, check)
        _step(ref, ref_model, step, None)
        for p, q in zip(_flat(params(model)), _flat(params(ref_model))):
            torch.testing.assert_close(p, q, msg=lambda m: f"{case} step {step}: {m}")
            if not p.requires_grad:  # (Adagrad's constructor makes state for it; ours shows state once stepped)
                continue
            ours, theirs = opt.state[p], ref.state[q]
            assert set(ours) == set(theirs), (case, step)
            for key, value in theirs.items():
                torch.testing.assert_close(torch.as_tensor(ours[key]), torch.as_tensor(value),
                                           msg=lambda m: f"{case} step {step} {key}: {m}")
    assert _on_gpu(opt), "no bucket was stepped on the GPU"
    assert check.ours() <= 2 * STEPS, f"a host read of a GPU value per bucket? {dict(check.reads)}"

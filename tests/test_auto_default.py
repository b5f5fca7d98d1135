"""``placement="auto"`` is the default (issue 52, item 2): on a GPU model it places as ``placement="auto"`` given
explicitly does; where ``"auto"`` cannot run and ``placement`` was not given (compact ``state_dtype``,
``overlap_step``, ``delayed_update``, ``gpu_fraction``, a rule without a GPU update, a CPU model, torch.distributed
without a ``process_group``) it quietly means ``"host"``, as before it became the default; ``"auto"`` given
explicitly keeps those refusals, and under DDP is refused (the replicas would place apart and drift).

On CPU-only machines the GPU is the stand-in of tests/cuda_standins.py. References: ``torch.optim.AdamW
(foreach=False)`` at default fp32 tolerance where the options keep AdamW's arithmetic; where they do not (compact
state, a delayed update, another rule), the same options with ``placement="host"`` given, bit for bit (the default
there is the host placement, nothing else).
"""

from __future__ import annotations

import copy
import logging
from itertools import chain

import pytest
import torch
import torch.distributed as dist

import cuda_standins
import test_distributed as td
from test_optimizer import TinyTransformer, assert_same, param_groups
from test_twin_flow import BUCKET, _train, clipped_step_beside_adamw, fake_gpu_memory, host_only_rule
from zero_offload import OffloadOptimizer


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch)


def _homes(opt):
    return [[b.home.kind for b in group] for group in opt._buckets]


def test_the_signature_and_the_options_say_auto():
    import inspect

    from zero_offload.options import OFFLOAD_OPTIONS

    assert OFFLOAD_OPTIONS["placement"] == "auto"
    assert inspect.signature(OffloadOptimizer).parameters["placement"].default == "auto"


def test_the_default_places_on_a_gpu_model_as_explicit_auto_does(cuda_branches):
    """Same homes after the second step (not before), and both follow AdamW every step, parameters and state."""
    import zero_offload.cost_model as cost_model

    monkeypatch = cuda_branches
    monkeypatch.setattr(cost_model, "measure_copy_rate", lambda device, nbytes=0, up=True: 1e15)
    monkeypatch.setattr(cost_model, "measure_kernel_rate", lambda numel=0: 1e6)
    torch.manual_seed(0)
    model = TinyTransformer()
    models = [model, copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)]
    default = OffloadOptimizer(param_groups(models[0]), bucket_numel=BUCKET, gpu_margin_gib=1.0)
    given = OffloadOptimizer(param_groups(models[1]), bucket_numel=BUCKET, gpu_margin_gib=1.0, placement="auto")
    refs = [torch.optim.AdamW(param_groups(m), foreach=False) for m in models[2:]]
    assert default.options.placement == "auto" and default._placer is not None
    last = max(chain.from_iterable(default._buckets), key=lambda b: b.device_cost())
    fake_gpu_memory(monkeypatch, 2**30 + 2**20 + last.device_cost(), peak=2**20, allocated=0)
    for step in range(5):
        clipped_step_beside_adamw(default, models[0], refs[0], models[2], step)
        clipped_step_beside_adamw(given, models[1], refs[1], models[3], step)
        assert _homes(default) == _homes(given), step
        homes = set(chain.from_iterable(_homes(default)))
        assert (homes == {"host"}) == (step == 0), (step, homes)  # (placed once, after the second step)


# Options with which "auto" cannot run: the default quietly means "host" (kw, whether AdamW is the reference).
QUIET = {
    "bf16_state": (dict(state_dtype=torch.bfloat16), False),
    "int8_state": (dict(state_dtype=torch.int8), False),
    "overlap_step": (dict(overlap_step=True, nonfinite="ignore"), True),
    "delayed_update": (dict(delayed_update=True), False),
    "gpu_fraction": (dict(gpu_fraction=0.3), True),
    "gpu_fraction_0": (dict(gpu_fraction=0.0), True),
}


@pytest.mark.parametrize("name", QUIET)
def test_the_default_means_host_where_auto_cannot_run(cuda_branches, name):
    kw, adamw = QUIET[name]
    torch.manual_seed(0)
    model = TinyTransformer()
    twin_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, **kw)
    twin = OffloadOptimizer(param_groups(twin_model), bucket_numel=BUCKET, placement="host", **kw)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    assert opt.options.placement == "host" and opt._placer is None
    if "gpu_fraction" not in kw:  # ("auto" given with them: today's refusals)
        with pytest.raises(ValueError, match="placement='auto'"):
            OffloadOptimizer(param_groups(copy.deepcopy(model)), bucket_numel=BUCKET, placement="auto", **kw)
    for step in range(4):
        _train(opt, model, 1, start=step)
        _train(twin, twin_model, 1, start=step)
        if adamw:
            _train(ref, ref_model, 1, start=step)
            assert_same(model, ref_model, opt, ref, f"step {step}")
        opt.flush(), twin.flush()  # (delayed_update: both apply their pending update now)
        for p, q in zip(model.parameters(), twin_model.parameters()):
            assert torch.equal(p, q), (name, step)
            for key, value in opt.state[p].items():
                assert torch.equal(value, twin.state[q][key]), (name, step, key)
        assert _homes(opt) == _homes(twin), step
    if name == "gpu_fraction":  # (its alias's homes, as before "auto" was the default)
        assert "resident" in chain.from_iterable(_homes(opt))


def test_the_default_means_host_for_a_rule_without_a_gpu_update(cuda_branches):
    rule = host_only_rule()
    torch.manual_seed(0)
    model = TinyTransformer()
    twin_model = copy.deepcopy(model)
    opt = OffloadOptimizer._with_rule(param_groups(model), rule, dict(rule.defaults), bucket_numel=BUCKET)
    twin = OffloadOptimizer._with_rule(param_groups(twin_model), rule, dict(rule.defaults), bucket_numel=BUCKET,
                                       placement="host")
    assert opt.options.placement == "host"
    with pytest.raises(ValueError, match="placement='auto': HostOnly has no GPU update"):
        OffloadOptimizer._with_rule(param_groups(model), rule, dict(rule.defaults), placement="auto")
    for step in range(3):
        _train(opt, model, 1, start=step)
        _train(twin, twin_model, 1, start=step)
        for p, q in zip(model.parameters(), twin_model.parameters()):
            assert torch.equal(p, q) and all(torch.equal(v, twin.state[q][k]) for k, v in opt.state[p].items())


def test_a_class_that_is_not_elementwise_is_refused_by_default_as_before():
    """The default does not step Muon on the GPU behind the user's back: refused, saying placement='parked' runs
    it, as when the default was the host."""
    import zero_offload

    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        pytest.skip("this torch has no torch.optim.Muon")
    with pytest.raises(ValueError, match="placement='parked' runs it"):
        zero_offload.offload(muon, [torch.nn.Parameter(torch.randn(8, 6))], lr=0.02)


def test_a_cpu_model_is_placed_on_the_host_without_touching_cuda(caplog):
    """Nothing to place: no placer, no measurement, nothing pinned, no CUDA initialised, no placement logged;
    AdamW's trajectory."""
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="zero_offload"):
        opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET)
        ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
        for step in range(4):
            _train(opt, model, 1, start=step)
            _train(ref, ref_model, 1, start=step)
            assert_same(model, ref_model, opt, ref, f"step {step}")
    assert opt.options.placement == "host" and opt._placer is None
    assert opt.estimate_host_memory().pinned_bytes == 0
    assert not torch.cuda.is_initialized()
    assert not [r for r in caplog.records if "placement" in r.getMessage()], caplog.records


# -- DDP: torch.distributed initialised, no process_group (gloo, world 2) ------------------------------------------
def _ddp_worker(rank, world):
    """Under DDP the default is the host placement (each rank would otherwise measure its own machine); "auto" given
    is refused naming the fixes; with stream_grads=True (nothing reduces the gradients after backward, as under
    accelerate's FSDP2 plugin before it shards the model) it is taken."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    # First a CPU model sharded over a process_group: the default places nothing, so no placer and no exchange.
    model, ref_model = td._make(rank)
    opt = OffloadOptimizer(model.parameters(), lr=1e-2, bucket_numel=128, process_group=dist.group.WORLD, timeout=30)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    for step in range(3):
        td._step(model, opt, step, rank, world)
        td._ref_step(ref_model, ref, step)
        td._compare(model, ref_model, f"sharded CPU model, step {step}")
    out["cpu_group"] = (opt.options.placement, opt._placer is None)
    cuda_standins.install_in_rank()
    model, ref_model = td._make(rank)
    ddp = DDP(model, find_unused_parameters=True)
    opt = OffloadOptimizer(model.parameters(), lr=1e-2, bucket_numel=128)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    for step in range(4):
        td._step(ddp, opt, step, rank, world, clip=0.5)
        td._ref_step(ref_model, ref, step, clip=0.5)
        td._compare(model, ref_model, f"step {step}")
        for p, q in zip(model.parameters(), ref_model.parameters()):
            for key, value in ref.state[q].items():
                torch.testing.assert_close(opt.state[p][key], value, msg=lambda m: f"step {step} {key}: {m}")
    out["default"] = (opt.options.placement, sorted(set(chain.from_iterable(_homes(opt)))), opt._placer is None)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        OffloadOptimizer(model.parameters(), placement="auto")
    except ValueError as exc:
        out["auto"] = str(exc)
    try:
        OffloadOptimizer(model.parameters(), gpu_fraction="auto")
    except ValueError as exc:
        out["fraction"] = str(exc)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    out["fixed_fraction"] = OffloadOptimizer(model.parameters(), gpu_fraction=0.5).options.gpu_fraction
    out["streamed"] = OffloadOptimizer(model.parameters(), placement="auto", stream_grads=True).options.placement
    out["parked"] = OffloadOptimizer(model.parameters(), placement="parked").options.placement
    return out


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_under_ddp_the_default_is_the_host_and_auto_is_refused():
    """Under DDP (no process_group) the default steps on the host; placement='auto' and gpu_fraction='auto' are
    refused, naming the drift and the fixes; fixed homes and shares are taken."""
    for rank, out in td.launch(_ddp_worker, 2).items():
        assert out["cpu_group"] == ("host", True), (rank, out["cpu_group"])
        assert out["default"] == ("host", ["host"], True), (rank, out["default"])
        message = out.get("auto", "")
        assert "placement='auto'" in message and "(world size 2)" in message and "drift" in message, message
        assert "process_group=" in message and "'parked'" in message, message
        message = out.get("fraction", "")  # (gpu_fraction="auto", placement's alias, likewise)
        assert "gpu_fraction='auto'" in message and "drift" in message and "gpu_fraction=0.1" in message, message
        assert out["fixed_fraction"] == 0.5
        assert out["streamed"] == "auto" and out["parked"] == "parked"

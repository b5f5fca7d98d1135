"""The state follows the ``Parameter``, not its storage, as ``torch.optim.AdamW``'s does: a parameter whose data is
replaced on its own device and dtype (``model.to()`` onto the device it is on, which copies: accelerate's and the HF
Trainer's ``model.to(torch.device("cpu", 0))``; ``p.data = ...``) trains on with its state, against AdamW
(foreach=False) given the same replacement, parameters and state every step; a move or a cast is refused naming
what changed, with nothing changed."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from test_optimizer import TinyTransformer, assert_same, loss_fn, param_groups, snapshot, trained
from zero_offload import OffloadOptimizer

STEPS = 6
REPLACE_AT = 2


def _to_cpu0(model):
    model.to(torch.device("cpu", 0))


def _clone_data(model):
    for p in model.parameters():
        p.data = p.data.clone()


def _new_values(model):
    """New values for two parameters (a checkpoint assigned by ``p.data = ...``)."""
    gen = torch.Generator().manual_seed(7)
    for p in list(model.parameters())[:2]:
        p.data = torch.randn(p.shape, generator=gen) * 0.05


def _beside_adamw(model, kw, replace, after_backward=True, device="cpu", prepare=None):
    """Ours (``kw``) over ``model`` and AdamW (foreach=False) over its copy, both models' data replaced by
    ``replace(model)`` at step ``REPLACE_AT`` (after its backward, or before it): equal every step. ``prepare(model)``
    runs on ours' model before the optimizer is built."""
    ref_model = copy.deepcopy(model)
    if prepare is not None:
        prepare(model)
    ours = OffloadOptimizer(param_groups(model), **kw)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    for step in range(STEPS):
        for m, opt in ((model, ours), (ref_model, ref)):
            opt.zero_grad()
            if step == REPLACE_AT and not after_backward:
                replace(m)
            loss_fn(m, step, 0, device).backward()
            if step == REPLACE_AT and after_backward:
                replace(m)
            opt.step()
        assert_same(model, ref_model, ours, ref, f"step {step}")
    return ours


@pytest.mark.parametrize("replace", [_to_cpu0, _clone_data, _new_values], ids=["to_cpu0", "clone_data", "new_values"])
@pytest.mark.parametrize("after_backward", [False, True], ids=["before_backward", "after_backward"])
@pytest.mark.parametrize("kw", [{}, {"bucket_numel": 1000}], ids=["default", "small_buckets"])
def test_replaced_data_trains_on_as_adamw(replace, after_backward, kw):
    torch.manual_seed(0)
    _beside_adamw(TinyTransformer(), kw, replace, after_backward)


def test_replaced_data_of_a_bf16_model_keeps_its_masters_where_the_values_are_the_same():
    """A bf16 CPU model: ``model.to()`` onto its own device keeps each fp32 master (the copy rounds to it) and the
    moments; a parameter given other values takes them as its master, as a loaded one does. Reference: AdamW
    (foreach=False) over fp32 copies of the masters (0.25 for the replaced parameter), with ours' moments and step
    counts, stepped with the bf16 gradients upcast."""
    torch.manual_seed(0)
    model = TinyTransformer().to(torch.bfloat16)
    opt = OffloadOptimizer(param_groups(model))
    for step in range(2):
        opt.zero_grad()
        loss_fn(model, step, 0, "cpu").backward()
        opt.step()
    before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters() if opt.state[p]}
    model.to(torch.device("cpu", 0))
    first = next(model.parameters())
    first.data = torch.full_like(first, 0.25)
    opt.zero_grad()
    loss_fn(model, 2, 0, "cpu").backward()
    copies = {p: torch.nn.Parameter(torch.full_like(before[p]["master"], 0.25) if p is first
                                    else before[p]["master"].clone()) for p in before}
    ref = torch.optim.AdamW([{**g, "params": [copies[p] for p in g["params"] if p in copies]}
                             for g in opt.param_groups], foreach=False)
    for p, q in copies.items():
        q.grad = None if p.grad is None else p.grad.float()
        ref.state[q] = {k: v.clone() for k, v in before[p].items() if k != "master"}
    assert any(p.grad is not None for p in before) and first.grad is not None
    assert any(not torch.equal(s["master"], s["master"].to(torch.bfloat16).float()) for s in before.values())
    opt.step()
    ref.step()
    for p, q in copies.items():
        torch.testing.assert_close(opt.state[p]["master"], q.detach())
        torch.testing.assert_close(p, q.detach().to(torch.bfloat16))
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], ref.state[q][key])


@pytest.mark.parametrize("change,expected", [
    (lambda m: m.double(), "it was torch.float32 on cpu, it is now torch.float64 on cpu"),
    (lambda m: setattr(m.tok.weight, "data", torch.zeros(3)), r"it was \(31, 16\) torch.float32 on cpu, it is "
                                                              r"now \(3,\) torch.float32 on cpu"),
], ids=["cast", "reshaped"])
def test_a_cast_or_reshaped_parameter_is_refused_naming_it_and_nothing_changes(change, expected):
    model, opt = trained()
    snap = snapshot(model, opt)
    change(model)
    with pytest.raises(RuntimeError, match="data was moved, cast or reshaped after the optimizer was built: "
                                           + expected):
        opt.step()
    now = opt.state_dict()
    for k, entry in snap[1]["state"].items():
        for key, value in entry.items():
            assert torch.equal(now["state"][k][key], value), (k, key)


# ------------------------------------------------------------------------------------------- an orphaned optimizer --
def _gradless_warnings(record):
    return [w for w in record if "has ever had a gradient" in str(w.message)]


def test_an_optimizer_over_another_copy_of_the_model_warns_once_naming_the_likely_causes():
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(copy.deepcopy(model)))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(2):
            opt.zero_grad()
            loss_fn(model, step, 0, "cpu").backward()
            opt.step()
        assert not _gradless_warnings(record)
        for step in range(2, 6):
            opt.zero_grad()
            loss_fn(model, step, 0, "cpu").backward()
            opt.step()
    (warning,) = _gradless_warnings(record)
    message = str(warning.message)
    n = len(list(model.parameters()))
    assert f"step() was called 3 times and none of its {n} parameters has ever had a gradient" in message, message
    assert "built before fully_shard" in message and "another copy of the model" in message, message
    assert warning.filename == __file__  # (it points at the caller's step())


def test_steps_without_gradients_before_training_starts_do_not_warn():
    """A loop that calls step() before its first backward (a scheduler warm-up, gradient accumulation's first
    calls) and then trains: no warning, there or later."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt.step()
        opt.step()
        for step in range(4):
            opt.zero_grad()
            loss_fn(model, step, 0, "cpu").backward()
            opt.step()
        for _ in range(4):
            opt.zero_grad()
            opt.step()
    assert not _gradless_warnings(record)


def test_an_optimizer_built_before_fully_shard_warns(tmp_path):
    """FSDP2 (world 1, gloo) replaces the parameters of the modules it shards: an optimizer built before
    ``fully_shard`` steps parameters that get no gradient."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = TinyTransformer()
        opt = OffloadOptimizer(param_groups(model))
        fully_shard(model)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for step in range(3):
                opt.zero_grad()
                model.zero_grad()
                loss_fn(model, step, 0, "cpu").backward()
                opt.step()
        (warning,) = _gradless_warnings(record)
        assert "built before fully_shard" in str(warning.message)
    finally:
        dist.destroy_process_group()

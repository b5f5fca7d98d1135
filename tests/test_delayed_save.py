"""Saving a ``delayed_update`` run changes nothing, and what its checkpoint resumes into (issue 18, item 5).

Three claims, each against a reference run of the same data:

* a run that calls ``state_dict()`` / ``sharded_state_dict()`` with an update pending is bitwise the run that does
  not (parameters and state, every step after);
* its checkpoint, loaded into a fresh delayed optimizer after the model, is bitwise the state of the run that
  called ``flush()`` at the save, and resumes as that run (default fp32 tolerance: a fresh optimizer's first
  ``clip_grad_norm_`` sums the gradients in another order, which moves the last bit with several threads);
* loaded into ``torch.optim.AdamW`` (after writing each ``param`` into its parameter) or into an optimizer without
  ``delayed_update``, it is the flushed run's state, and the two continue alike (default fp32 tolerance).

Each runs on CPU models and through the CUDA branches (``cuda_standins``: the pending update runs in the worker
thread and is uploaded at the next ``step()``), with full and DCP state dicts. ``delayed_update`` does not
combine with a ``process_group``; its checkpoint loading into a sharded optimizer is checked at gloo world 2.
"""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch

import cuda_standins
from test_optimizer import TinyTransformer, assert_same, loss_fn
from zero_offload import OffloadOptimizer

LR = 1e-2
SAVE_AT = 4


@pytest.fixture(params=["cpu", "cuda_branches"])
def where(request, monkeypatch):
    if request.param == "cuda_branches":
        cuda_standins.install(monkeypatch.setattr)
    return request.param


def _make(dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    model = TinyTransformer().to(dtype)
    return model, OffloadOptimizer(model.parameters(), lr=LR, delayed_update=True, release_grads=False, **kw)


def _step(model, opt, step):
    opt.zero_grad()
    loss_fn(model, step, 0, "cpu").backward()
    opt.clip_grad_norm_(0.5)
    opt.step()


def _settle(opt):
    """Wait for a pending update the worker runs (CUDA path), so its buffers may be read; changes nothing."""
    pending = getattr(opt._mode, "_pending", None)
    if pending is not None and pending.job is not None:
        pending.job.result()


def _assert_identical(model, opt, ref_model, ref, where, exact=True):
    """Bitwise (``exact``; else default fp32 tolerance): every parameter and every state tensor."""
    _settle(opt)
    _settle(ref)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        if not exact:
            torch.testing.assert_close(p, q, msg=lambda m: f"{where}, {name}: {m}")
        else:
            assert torch.equal(p, q), f"{where}, {name}: max diff {(p.float() - q.float()).abs().max()}"
        actual, expected = opt.state.get(p, {}), ref.state.get(q, {})
        assert set(actual) == set(expected), f"{where}, {name}: state keys {set(actual)} vs {set(expected)}"
        for key, value in expected.items():
            if not exact:
                torch.testing.assert_close(actual[key], value, msg=lambda m: f"{where}, {name}, {key}: {m}")
            else:
                assert torch.equal(actual[key], value), f"{where}, {name}, {key}"


def _save(model, opt, how="state_dict"):
    """The checkpoint as bytes, then loaded back: nothing in it can alias the live buffers."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": getattr(opt, how)()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("how", ["state_dict", "sharded_state_dict"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_saving_a_delayed_run_changes_nothing(where, how, dtype):
    model, opt = _make(dtype, amsgrad=True)
    ref_model, ref = _make(dtype, amsgrad=True)
    for step in range(11):
        _step(model, opt, step)
        _step(ref_model, ref, step)
        if step in (0, SAVE_AT, SAVE_AT + 1, 8):  # the first step (no state yet), and twice in a row
            _save(model, opt, how)
            _assert_identical(model, opt, ref_model, ref, f"right after saving at step {step}")
        _assert_identical(model, opt, ref_model, ref, f"step {step}")


def _flushed_reference(dtype):
    """The run that calls ``flush()`` at the save, and the live run's checkpoint taken there."""
    model, opt = _make(dtype)
    ref_model, ref = _make(dtype)
    for step in range(SAVE_AT + 1):
        _step(model, opt, step)
        _step(ref_model, ref, step)
    ckpt = _save(model, opt)
    ref.flush()
    return ckpt, ref_model, ref


def _check_checkpoint(ckpt, ref_model, ref):
    """The checkpoint holds the flushed run's state, and each updated parameter's value after the update as
    ``param``; the model's own checkpoint is one step behind."""
    params = list(ref_model.parameters())
    behind = 0
    for i, p in enumerate(params):
        entry, expected = ckpt["opt"]["state"].get(i, {}), ref.state.get(p, {})
        assert set(entry) - {"param"} == set(expected), f"param {i}: {set(entry)} vs {set(expected)}"
        for key, value in expected.items():
            assert torch.equal(entry[key], value), f"param {i}, {key}"
        if "param" in entry:
            assert torch.equal(entry["param"], p), f"param {i}: value after the pending update"
            behind += not torch.equal(list(ckpt["model"].values())[i], p)
    assert behind > 0, "the model's parameters should be one update behind the optimizer's checkpoint"


def _resume_beside(model, opt, ref_model, ref, steps):
    """The loaded run and the flushed reference, step by step: equal at load, then within fp32 tolerance (a
    fresh optimizer's first clip may sum the norm in another order)."""
    _assert_identical(model, opt, ref_model, ref, "loaded")
    for step in range(SAVE_AT + 1, SAVE_AT + 1 + steps):
        _step(model, opt, step)
        _step(ref_model, ref, step)
        _assert_identical(model, opt, ref_model, ref, f"resumed step {step}", exact=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_resumed_delayed_run_equals_the_run_flushed_at_the_save(where, dtype):
    ckpt, ref_model, ref = _flushed_reference(dtype)
    _check_checkpoint(ckpt, ref_model, ref)
    model, opt = _make(dtype, seed=1)
    model.load_state_dict(ckpt["model"])  # the model first, as every training loop restores it
    opt.load_state_dict(ckpt["opt"])
    _resume_beside(model, opt, ref_model, ref, 7)


def test_delayed_checkpoint_loads_into_adamw_and_a_non_delayed_optimizer(where):
    ckpt, ref_model, ref = _flushed_reference(torch.float32)
    torch.manual_seed(1)
    ours_model, adamw_model = TinyTransformer(), TinyTransformer()
    ours_model.load_state_dict(ckpt["model"])
    ours = OffloadOptimizer(ours_model.parameters(), lr=LR)
    ours.load_state_dict(ckpt["opt"])
    # torch.optim.AdamW knows nothing of ``param``: write it into the parameters (the recipe in docs/checkpoints.md).
    adamw_model.load_state_dict(ckpt["model"])
    sd = copy.deepcopy(ckpt["opt"])
    with torch.no_grad():
        for i, p in enumerate(adamw_model.parameters()):
            if "param" in sd["state"].get(i, {}):
                p.copy_(sd["state"][i].pop("param"))
    adamw = torch.optim.AdamW(adamw_model.parameters(), lr=LR, foreach=False)
    adamw.load_state_dict(sd)
    _assert_identical(ours_model, ours, ref_model, ref, "loaded without delayed_update")
    assert_same(adamw_model, ref_model, adamw, ref, "loaded into AdamW")
    for step in range(SAVE_AT + 1, SAVE_AT + 8):
        for model, opt in ((ours_model, ours), (adamw_model, adamw)):
            opt.zero_grad()
            loss_fn(model, step, 0, "cpu").backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=False)
            opt.step()
        assert_same(ours_model, adamw_model, ours, adamw, f"step {step}")


@pytest.mark.parametrize("target", ["fresh", "pending"])
def test_delayed_dcp_checkpoint_resumes_as_the_run_flushed_at_the_save(where, target, tmp_path):
    """``pending``: the optimizer loaded into has an update pending itself when it makes the dict for
    ``dcp.load``, which then holds copies (and, on the CUDA path, ``param`` is the host slot, not the parameter)."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    model, opt = _make()
    ref_model, ref = _make()
    for step in range(SAVE_AT + 1):
        _step(model, opt, step)
        _step(ref_model, ref, step)
    dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=os.path.join(tmp_path, "dcp"), no_dist=True)
    saved_model = copy.deepcopy(model.state_dict())
    ref.flush()
    resumed_model, resumed = _make(seed=1)
    if target == "pending":
        for step in (97, 98):
            _step(resumed_model, resumed, step)
    resumed_model.load_state_dict(saved_model)
    sd = {"optim": resumed.sharded_state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(tmp_path, "dcp"), no_dist=True)
    resumed.load_sharded_state_dict(sd["optim"])
    _resume_beside(resumed_model, resumed, ref_model, ref, 5)


# -------------------------------------------------------------------- into a sharded optimizer (gloo world 2) --
def _sharded_resume_worker(rank, world, path):
    import torch.distributed as dist
    from test_distributed import BUCKET_NUMEL, Net, _compare, _ref_step, _step, groups

    saved = torch.load(path, weights_only=True)
    model, ref_model = Net(), Net()
    model.load_state_dict(saved["model"])
    ref_model.load_state_dict(saved["model"])
    opt = OffloadOptimizer(groups(model), lr=LR, bucket_numel=BUCKET_NUMEL, process_group=dist.group.WORLD,
                           timeout=30)
    opt.load_state_dict(saved["opt"])
    ref = OffloadOptimizer(groups(ref_model), lr=LR, bucket_numel=BUCKET_NUMEL)  # one process, the whole batch
    ref.load_state_dict(saved["opt"])
    full = opt.state_dict()  # gathered: a collective
    for i, p in enumerate(model.parameters()):  # bitwise the flushed run, every rank
        assert torch.equal(p, saved["flushed_params"][i]), f"rank {rank}, param {i}"
        expected = saved["flushed_state"][i]
        assert set(full["state"][i]) == set(expected), f"rank {rank}, param {i}: {set(full['state'][i])}"
        for key, value in expected.items():
            assert torch.equal(full["state"][i][key], value), f"rank {rank}, param {i}, {key}"
    for step in range(SAVE_AT + 1, SAVE_AT + 6):
        _step(model, opt, step, rank, world, clip=0.5)
        _ref_step(ref_model, ref, step, clip=0.5)
        _compare(model, ref_model, f"rank {rank}, step {step}")
    return True


def test_delayed_checkpoint_loads_into_a_sharded_optimizer(tmp_path):
    """``delayed_update`` does not combine with a ``process_group``, but its checkpoint loads into a sharded
    optimizer: each rank writes ``param`` into its parameters and its piece of the state (the flushed run's)."""
    from test_distributed import BUCKET_NUMEL, Net, _ref_step, groups, launch

    torch.manual_seed(0)
    model, ref_model = Net(), Net()
    ref_model.load_state_dict(model.state_dict())
    opt = OffloadOptimizer(groups(model), lr=LR, bucket_numel=BUCKET_NUMEL, delayed_update=True)
    ref = OffloadOptimizer(groups(ref_model), lr=LR, bucket_numel=BUCKET_NUMEL, delayed_update=True)
    for step in range(SAVE_AT + 1):
        _ref_step(model, opt, step, clip=0.5)
        _ref_step(ref_model, ref, step, clip=0.5)
    saved = {"model": model.state_dict(), "opt": opt.state_dict()}
    ref.flush()
    saved["flushed_params"] = [p.detach() for p in ref_model.parameters()]
    saved["flushed_state"] = ref.state_dict()["state"]
    torch.save(saved, tmp_path / "ckpt.pt")
    launch(_sharded_resume_worker, 2, str(tmp_path / "ckpt.pt"), timeout=120)


def _moments(opt):
    """The fp32 moments and steps of ``opt.state_dict()``, by parameter index (compact state shows them only there)."""
    return {i: {k: v.clone() for k, v in entry.items() if k != "param"} for i, entry in opt.state_dict()["state"].items()}


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.int8], ids=["bf16_state", "int8_state"])
def test_saving_a_delayed_compact_run_changes_nothing(where, state_dtype):
    """Compact moments: the pending update is previewed into copies of the codes and scales (CPU) or read after the
    worker (CUDA path), dequantised for the checkpoint, and the run goes on bitwise as one that never saves."""
    model, opt = _make(state_dtype=state_dtype)
    ref_model, ref = _make(state_dtype=state_dtype)
    for step in range(8):
        _step(model, opt, step)
        _step(ref_model, ref, step)
        if step in (0, SAVE_AT, SAVE_AT + 1):
            ckpt = _save(model, opt)
            _assert_identical(model, opt, ref_model, ref, f"right after saving at step {step}")
        _assert_identical(model, opt, ref_model, ref, f"step {step}")
    ref.flush()  # the checkpoint of the last save is the state the flushed run has
    model2, opt2 = _make(state_dtype=state_dtype)
    for step in range(SAVE_AT + 2):
        _step(model2, opt2, step)
    opt2.flush()
    expected = _moments(opt2)
    for i, entry in ckpt["opt"]["state"].items():
        for key, value in expected[i].items():
            assert torch.equal(entry[key], value), f"param {i}, {key}"


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.int8], ids=["bf16_state", "int8_state"])
def test_clearing_compact_state_restarts_as_a_fresh_optimizer(state_dtype):
    """``opt.state.clear()`` (the Adam reset) on compact state: zero moments and scales, step 1 next, exactly as an
    optimizer built fresh at that point (the reference)."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(model.parameters(), lr=LR, state_dtype=state_dtype)
    for step in range(3):
        opt.zero_grad()
        loss_fn(model, step, 0, "cpu").backward()
        opt.step()
    opt.state.clear()
    ref_model = copy.deepcopy(model)
    ref = OffloadOptimizer(ref_model.parameters(), lr=LR, state_dtype=state_dtype)
    for step in range(3, 6):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
            o.step()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(p, q), f"step {step}"
        got, expected = _moments(opt), _moments(ref)
        assert got.keys() == expected.keys()
        for i in expected:
            for key, value in expected[i].items():
                assert torch.equal(got[i][key], value), f"step {step}, param {i}, {key}"

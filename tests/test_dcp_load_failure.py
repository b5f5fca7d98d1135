"""A ``dcp.load`` that fails part way (a truncated data file) changes nothing (issue 36, section 3).

``sharded_state_dict()`` hands DCP views of the live buffers; a load used to write into them directly, so a read
that failed after the first items had left the moments (and, with ``delayed_update``, the parameters) half
overwritten. Now a load writes into staging, which ``load_sharded_state_dict()`` commits. Each case: a failed load
leaves parameters, state and param groups bit for bit as before it, and the run then goes on as
``torch.optim.AdamW(foreach=False)``'s; a good load afterwards gives the checkpoint's state and goes on as AdamW
loaded from the same point. In one process (``no_dist``) and over gloo at world 2.
"""

from __future__ import annotations

import copy
import glob
import os
import warnings

import pytest
import torch
import torch.nn as nn

import cuda_standins
from aliasing import lies_in
from test_optimizer import assert_same
from zero_offload import OffloadOptimizer

dcp = pytest.importorskip("torch.distributed.checkpoint")
LR = 0.05


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(17, 17) for _ in range(6)]).to(dtype)


def _step(model, opt, step):
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 17, generator=gen), torch.randn(8, 17, generator=gen)
    dtype = next(model.parameters()).dtype
    opt.zero_grad()
    (model(x.to(dtype)).float() - y).pow(2).mean().backward()
    opt.step()


def _truncate(path):
    """Cut every data file of the checkpoint at two thirds: the items before the cut read, the next one fails."""
    files = glob.glob(os.path.join(path, "*.distcp"))
    assert files
    for f in files:
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) * 2 // 3)


def _snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _assert_unchanged(model, opt, snap, where):
    params, sd = snap
    for k, (p, q) in enumerate(zip(model.parameters(), params)):
        assert torch.equal(p, q), f"{where}: parameter {k} changed"
    now = opt.state_dict()
    assert now["param_groups"] == sd["param_groups"], where
    assert now["state"].keys() == sd["state"].keys(), where
    for k, entry in sd["state"].items():
        for name, value in entry.items():
            assert torch.equal(now["state"][k][name], value), f"{where}: state {k} {name} changed"


def _load(opt, path):
    sd = {"optim": opt.sharded_state_dict()}
    dcp.load(sd, checkpoint_id=path, no_dist=not torch.distributed.is_initialized())
    opt.load_sharded_state_dict(sd["optim"])


def _load_fails(opt, path):
    with pytest.raises(BaseException) as info:  # (DCP's CheckpointException is no Exception subclass)
        _load(opt, path)
    assert "distcp" in str(info.value) or "zip" in str(info.value) or "read" in str(info.value), info.value


# ``delayed``: on the CPU the dict of a run with an update pending holds private copies (nothing live to stage); on
# the CUDA path the state is live and ``param`` is the host's upload slot.
KINDS = {"fp32": dict(), "bf16": dict(dtype=torch.bfloat16), "delayed": dict(kw=dict(delayed_update=True)),
         "cuda_standin": dict(standin=True), "cuda_standin_bf16": dict(standin=True, dtype=torch.bfloat16),
         "cuda_standin_delayed": dict(standin=True, kw=dict(delayed_update=True))}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_truncated_checkpoint_fails_to_load_and_changes_nothing(monkeypatch, tmp_path, kind):
    spec = KINDS[kind]
    if spec.get("standin"):
        cuda_standins.install(monkeypatch.setattr)
    dtype = spec.get("dtype", torch.float32)
    model = _model(dtype)
    opt = OffloadOptimizer(model.parameters(), lr=LR, amsgrad=True, bucket_numel=700, **spec.get("kw", {}))
    ref_model = _model()  # AdamW on fp32 (for the fp32 kinds)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, amsgrad=True, foreach=False)
    exact = dtype == torch.float32 and "delayed" not in kind  # (a delayed run is a step behind AdamW's)
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist=True says so
    for step in range(3):
        _step(model, opt, step)
        _step(ref_model, ref, step)
    for path in (good, bad):
        dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=path, no_dist=True)
    saved = copy.deepcopy(opt.state_dict())
    saved_model, saved_ref = copy.deepcopy(model.state_dict()), copy.deepcopy(ref.state_dict())
    saved_ref_model = copy.deepcopy(ref_model.state_dict())
    _truncate(bad)
    for step in range(3, 5):
        _step(model, opt, step)
        _step(ref_model, ref, step)
    snap = _snapshot(model, opt)
    _load_fails(opt, bad)
    _assert_unchanged(model, opt, snap, "after the failed load")
    for step in range(5, 7):
        _step(model, opt, step)
        _step(ref_model, ref, step)
        if exact:
            assert_same(model, ref_model, opt, ref, f"after the failed load, step {step}")
    # A good checkpoint then loads (in place of the live state), as AdamW's does.
    model.load_state_dict(saved_model)
    before = opt.host_buffers()[0]["exp_avg"]
    ptr = before.data_ptr()
    _load(opt, good)
    # The staged moments became the buffer by trading memory (nothing copied): the same tensor, other memory,
    # which the state entries still view. (Not the CPU's delayed run: its dict held private copies, copied in.)
    assert (before.data_ptr() != ptr or kind == "delayed") and opt.host_buffers()[0]["exp_avg"] is before
    first = next(iter(model.parameters()))
    entry = opt.state[first]["exp_avg"]
    assert lies_in(entry, [before])
    got, params = opt.state_dict(), list(model.parameters())
    for k, entry in saved["state"].items():
        for name, value in entry.items():  # (``param``: the value after the pending update, now the parameter's)
            now = params[k] if name == "param" else got["state"][k][name]
            torch.testing.assert_close(now, value, rtol=0, atol=0, msg=f"{k} {name}")
    ref_model.load_state_dict(saved_ref_model)
    ref.load_state_dict(saved_ref)
    for step in range(3, 6):
        _step(model, opt, step)
        _step(ref_model, ref, step)
        if exact:
            assert_same(model, ref_model, opt, ref, f"after the good load, step {step}")


def _sharded_worker(rank, world, path):
    import torch.distributed as dist
    from test_distributed import _ckpt_opt, _compare, _make, _ref_step, _step as _sharded_step, groups

    model, ref_model = _make(rank)
    opt = _ckpt_opt(model, process_group=dist.group.WORLD)
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, amsgrad=True, foreach=False)
    for step in range(3):
        _sharded_step(model, opt, step, rank, world)
        _ref_step(ref_model, ref, step)
    dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=path)
    dist.barrier()
    if rank == 0:
        _truncate(path)
    dist.barrier()
    for step in range(3, 5):
        _sharded_step(model, opt, step, rank, world)
        _ref_step(ref_model, ref, step)
    params = [p.detach().clone() for p in model.parameters()]
    before = {k: {n: v.clone() for n, v in e.items()} for k, e in opt.sharded_state_dict()["state"].items()
              for e in [{n: getattr(v, "local", v) for n, v in e.items()}]}
    with pytest.raises(BaseException):
        _load(opt, path)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params)), "a parameter changed"
    now = opt.sharded_state_dict()["state"]
    for k, entry in before.items():
        for n, v in entry.items():
            assert torch.equal(getattr(now[k][n], "local", now[k][n]), v), f"rank {rank}: state {k} {n} changed"
    for step in range(5, 8):
        _sharded_step(model, opt, step, rank, world)
        _ref_step(ref_model, ref, step)
        _compare(model, ref_model, f"after the failed load, step {step}")
    return True


def test_a_truncated_checkpoint_fails_to_load_on_every_rank_and_changes_nothing(tmp_path):
    from test_distributed import launch

    launch(_sharded_worker, 2, str(tmp_path / "ckpt"))

"""``load_state_dict()`` between backward and ``step()`` (issue 36, section 3) against ``torch.optim.AdamW``.

AdamW keeps ``.grad`` over a load: the next ``step()`` updates the loaded state with the gradients backward already
computed (and a clip already applied to them). Ours keeps what backward already sent to the host (with
``release_grads`` the host buffer holds the only copy) and a pending ``clip_grad_norm_``. Before the fix the load
ended the step: ``release_grads`` then stepped 0 of 12 parameters, or only the second micro-batch, and a pending
clip was dropped. Each scenario runs with the model on the CPU and on the CUDA stand-ins, every
step compared with AdamW at default tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import cuda_standins
from test_optimizer import assert_same
from zero_offload import OffloadOptimizer

LR = 0.05


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(17, 17) for _ in range(6)])  # 12 parameters


def _loss(model, step, micro):
    gen = torch.Generator().manual_seed(100 * step + micro)
    x, y = torch.randn(8, 17, generator=gen), torch.randn(8, 17, generator=gen)
    return (model(x) - y).pow(2).mean()


def _clip(opt, model, ours):
    if ours:
        return opt.clip_grad_norm_(0.05)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=False)


def _train_step(model, opt, step, ours, *, load=None, where=None):
    """One step (two micro-batches for a load between them); ``load`` (a state dict) is loaded at ``where``."""
    opt.zero_grad()
    for micro in range(2 if where == "between_micro_batches" else 1):
        _loss(model, step, micro).backward()
        if where == "between_micro_batches" and micro == 0:
            opt.load_state_dict(copy.deepcopy(load))
    if where == "after_clip":
        _clip(opt, model, ours)
    if where in ("after_backward", "after_clip"):
        opt.load_state_dict(copy.deepcopy(load))
    opt.step()


KWS = {"release": dict(stream_grads=True, release_grads=True), "streamed": dict(stream_grads=True),
       "at_step": dict()}


@pytest.mark.parametrize("device", ["cpu", "cuda_standin"])
@pytest.mark.parametrize("kw", list(KWS), ids=list(KWS))
@pytest.mark.parametrize("where", ["after_backward", "between_micro_batches", "after_clip"])
def test_a_load_between_backward_and_step_keeps_the_gradients_as_adamw(monkeypatch, device, kw, where):
    if device == "cuda_standin":
        if kw == "at_step":
            pytest.skip("a CUDA model streams by default")
        cuda_standins.install(monkeypatch.setattr)
    model = _model()
    ref_model = copy.deepcopy(model)
    ours = OffloadOptimizer(model.parameters(), lr=LR, bucket_numel=700, **KWS[kw])
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, foreach=False)
    ckpt = None
    for step in range(6):
        if step == 2:
            ckpt = copy.deepcopy(ref.state_dict())  # the reference's state: the same checkpoint for both
        at = where if step == 4 else None
        before = [p.detach().clone() for p in model.parameters()]
        _train_step(model, ours, step, True, load=ckpt, where=at)
        _train_step(ref_model, ref, step, False, load=ckpt, where=at)
        moved = sum(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert moved == 12, f"step {step}: {moved} of 12 parameters moved"
        assert_same(model, ref_model, ours, ref, f"{where}, step {step}")


def _overlap_pair():
    """(model, its copy, ours with ``overlap_step`` over the model, AdamW over the copy)."""
    model = _model()
    ref_model = copy.deepcopy(model)
    ours = OffloadOptimizer(model.parameters(), lr=LR, bucket_numel=700, stream_grads=True, overlap_step=True,
                            nonfinite="ignore")
    return model, ref_model, ours, torch.optim.AdamW(ref_model.parameters(), lr=LR, foreach=False)


def _backward_both(step, model, ours, ref_model, ref):
    for m, opt in ((model, ours), (ref_model, ref)):
        opt.zero_grad()
        _loss(m, step, 0).backward()


def test_overlap_step_refuses_a_load_after_backward_and_changes_nothing():
    """With ``overlap_step`` the step's update already ran during backward, from the state being replaced, and its
    parameters were written: the load is refused, naming why, changing nothing, and the run goes on as AdamW's
    (which did not load)."""
    model, ref_model, ours, ref = _overlap_pair()
    for step in range(3):
        _backward_both(step, model, ours, ref_model, ref)
        if step == 1:
            ckpt = copy.deepcopy(ref.state_dict())
            for entry in ckpt["state"].values():
                entry["exp_avg"].mul_(2)
            # The updates backward launched may still be writing in the worker: the snapshot is taken once they
            # are done (step() waits for them the same way), or the comparison races them.
            ours._mode.settle()
            params = [p.detach().clone() for p in model.parameters()]
            saved = copy.deepcopy(ours.state_dict())
            with pytest.raises(RuntimeError, match="overlap_step=True.*already ran during backward"):
                ours.load_state_dict(ckpt)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
            now = ours.state_dict()
            assert now["param_groups"] == saved["param_groups"]
            assert all(torch.equal(now["state"][k][n], v) for k, e in saved["state"].items() for n, v in e.items())
        ours.step()
        ref.step()
        assert_same(model, ref_model, ours, ref, f"step {step}")


@pytest.mark.parametrize("save", ["state_dict", "sharded_state_dict"])
def test_overlap_step_saves_after_the_updates_backward_launched(monkeypatch, save):
    """A save between backward and ``step()`` with ``overlap_step`` (every bucket's update launched in backward,
    here held up in the worker) waits for those updates: what it returns, copied at once, is the state after
    them, which ``step()`` then only waits for: AdamW's after its step."""
    import time

    real = OffloadOptimizer._early_update

    def slow(self, lane):
        time.sleep(0.05)
        real(self, lane)

    monkeypatch.setattr(OffloadOptimizer, "_early_update", slow)
    model, ref_model, ours, ref = _overlap_pair()
    for step in range(3):
        _backward_both(step, model, ours, ref_model, ref)
        saved = copy.deepcopy(getattr(ours, save)()["state"])  # (the copy is what torch.save would write)
        ours.step()
        ref.step()
        assert_same(model, ref_model, ours, ref, f"step {step}")
        for i, p in enumerate(ref_model.parameters()):  # (DCP's entries: flat, keyed by the index as a string)
            got = saved[i] if save == "state_dict" else saved[str(i)]
            for name in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got[name].reshape(p.shape), ref.state[p][name], msg=f"step {step}, {i}")


def _sharded_worker(rank, world):
    """Sharded over gloo, gradients reduce-scattered in backward and released: a load after the first of two
    micro-batches, and one after backward (each rank loads its piece of the reference's state)."""
    import torch.distributed as dist
    from test_distributed import _make, groups, loss_on, rows_of

    model, ref_model = _make(rank)
    opt = OffloadOptimizer(groups(model), lr=1e-2, bucket_numel=200, stream_grads=True, release_grads=True,
                           process_group=dist.group.WORLD)
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, foreach=False)
    ckpt = None
    for step in range(6):
        if step == 2:
            ckpt = copy.deepcopy(ref.state_dict())
        for m, o, rows in ((model, opt, rows_of(rank, world)), (ref_model, ref, slice(None))):
            o.zero_grad()
            for micro in range(2):
                (loss_on(m, step, micro, rows) / 2).backward()
                if (step, micro) in ((3, 0), (4, 1)):
                    o.load_state_dict(copy.deepcopy(ckpt))
            o.step()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), msg=lambda msg: f"step {step}, {name}: {msg}")
    return True


def test_a_sharded_load_between_backward_and_step_keeps_the_reduced_gradients():
    from test_distributed import launch

    launch(_sharded_worker, 2)

"""``opt.clip_grad_norm_`` where the loop's order, or its arguments, are not the usual ones (issue 54), against
``torch.optim.AdamW(foreach=False)`` with ``torch.nn.utils.clip_grad_norm_`` called in the same order: parameters
and both moments every step, default tolerance. Where the fused clip cannot do what torch's order gives, the step
is refused with an error naming the order needed, and the parameters, the state and the gradients are left as they
were (then the loop goes on in that order, and must follow the reference).

Each body runs with the gradients read at ``step()`` and streamed from backward hooks, with and without
``release_grads``; test_cuda_branches.py runs them through the GPU routes' code.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from test_optimizer import TinyTransformer, assert_same, assert_unchanged, loss_fn, param_groups, snapshot
from zero_offload import OffloadOptimizer

# How the gradients reach the optimizer: read at step(), streamed in backward, streamed and released.
FEEDS = [dict(stream_grads=False), dict(stream_grads=True), dict(stream_grads=True, release_grads=True)]
FEED_IDS = ["read_at_step", "streamed", "streamed_released"]


def _pair(ours_kw=None, ref_kw=None):
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    ours = OffloadOptimizer(param_groups(model), **(ours_kw or {}))
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False, **(ref_kw or {}))
    return model, ours, ref_model, ref


def _torch_clip(model, max_norm, norm_type=2.0):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type, foreach=False)


def _grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _assert_same_grads(before, model):
    for i, (g, p) in enumerate(zip(before, model.parameters())):
        assert (g is None) == (p.grad is None), i
        if g is not None:
            assert torch.equal(g, p.grad), i


def _assert_same_nan(model, ref_model, ours, ref, where):
    """:func:`assert_same` where NaN equals NaN (torch's clip of a NaN norm makes every gradient NaN)."""
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, equal_nan=True, msg=lambda m: f"{where}, {name}: {m}")
        for key, value in ref.state.get(q, {}).items():
            torch.testing.assert_close(ours.state[p][key], value, equal_nan=True,
                                       msg=lambda m: f"{where}, {name}, {key}: {m}")


# ------------------------------------------------------------------------------- a backward after the clip --
def backward_after_clip_is_refused(ours_kw, steps=4):
    """A second micro-batch's backward after ``opt.clip_grad_norm_``: torch's clip would have scaled the first
    micro-batch's gradients and added the second's unclipped; the fused coefficient cannot, so ``step()`` refuses,
    naming the order, and so does a second clip (whose norm would be of the unclipped sum); neither changes
    anything. After ``zero_grad()`` the loop runs the step again in that order and follows AdamW with torch's clip
    in the same order."""
    model, ours, ref_model, ref = _pair(ours_kw)
    refused = r"the gradients changed after opt\.clip_grad_norm_.*after the last backward of the step, right before"
    for step in range(steps):
        ours.zero_grad()
        loss_fn(model, step, 0, "cpu").backward()
        ours.clip_grad_norm_(0.5)
        loss_fn(model, step, 1, "cpu").backward()
        before, grads = snapshot(model, ours), _grads(model)
        with pytest.raises(RuntimeError, match="OffloadOptimizer.step: " + refused):
            ours.step()
        with pytest.raises(RuntimeError, match="OffloadOptimizer.clip_grad_norm_: " + refused):
            ours.clip_grad_norm_(0.5)
        with pytest.raises(RuntimeError, match=refused):  # (the first clip is still pending)
            ours.step()
        assert_unchanged(before, model, ours)
        _assert_same_grads(grads, model)
        for m, o in ((model, ours), (ref_model, ref)):
            o.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
            loss_fn(m, step, 1, "cpu").backward()
        torch.testing.assert_close(ours.clip_grad_norm_(0.5), _torch_clip(ref_model, 0.5))
        ours.step()
        ref.step()
        assert_same(model, ref_model, ours, ref, f"step {step}")


@pytest.mark.parametrize("ours_kw", FEEDS, ids=FEED_IDS)
def test_backward_after_clip_is_refused_and_changes_nothing(ours_kw):
    backward_after_clip_is_refused(ours_kw)


def test_gradient_edited_after_clip_is_refused():
    """An edit of ``.grad`` after the clip (here torch's own clip on top of ours) is refused alike."""
    model, ours, _, _ = _pair()
    loss_fn(model, 0, 0, "cpu").backward()
    ours.clip_grad_norm_(0.5)
    _torch_clip(model, 0.1)
    before = snapshot(model, ours)
    with pytest.raises(RuntimeError, match="gradients changed after"):
        ours.step()
    assert_unchanged(before, model, ours)


# ------------------------------------------------------------------- a non-finite norm under "ignore" --
def nonfinite_clip_under_ignore_matches_torch(ours_kw, max_norm, bad, steps=4):
    """``nonfinite="ignore"`` applies inf/NaN gradients as AdamW does: after torch's clip of a NaN total norm
    (a NaN gradient, or an inf one with ``max_norm=inf``) every gradient is NaN, and so are the parameters and
    moments AdamW then updates; an inf gradient with a finite ``max_norm`` gives a coefficient of 0 (inf * 0 =
    NaN where it was)."""
    model, ours, ref_model, ref = _pair(dict(nonfinite="ignore", **ours_kw))
    for step in range(steps):
        for m, o in ((model, ours), (ref_model, ref)):
            o.zero_grad()
            loss = loss_fn(m, step, 0, "cpu")
            if step == 1:  # one element's gradient is `bad` (the loss too, which nothing reads)
                loss = loss + m.ff1.weight[0, 0] * bad
            loss.backward()
        ours.clip_grad_norm_(max_norm)
        _torch_clip(ref_model, max_norm)
        ours.step()
        ref.step()
        _assert_same_nan(model, ref_model, ours, ref, f"step {step}")
    assert math.isnan(float(model.head.weight.detach()[0, 0]))


@pytest.mark.parametrize("ours_kw", FEEDS, ids=FEED_IDS)
@pytest.mark.parametrize("max_norm,bad", [(0.5, math.nan), (0.5, math.inf), (math.inf, math.inf)],
                         ids=["nan_grad", "inf_grad", "inf_grad_inf_max_norm"])
def test_nonfinite_gradient_clipped_under_ignore_matches_torch(ours_kw, max_norm, bad):
    nonfinite_clip_under_ignore_matches_torch(ours_kw, max_norm, bad)


# -------------------------------------------------------------------------------- max_norm, norm_type --
@pytest.mark.parametrize("max_norm", [math.nan, -1.0, -math.inf, torch.tensor(math.nan)],
                         ids=["nan", "negative", "-inf", "nan_tensor"])
def test_invalid_max_norm_is_refused_and_changes_nothing(max_norm):
    """torch's clip turns every gradient NaN for ``max_norm=nan`` and flips their signs for a negative one;
    ours refuses both with a ValueError naming max_norm. The clip pending from before is kept, and the step
    follows AdamW with torch's clip of that ``max_norm``."""
    model, ours, ref_model, ref = _pair()
    loss_fn(model, 0, 0, "cpu").backward()
    loss_fn(ref_model, 0, 0, "cpu").backward()
    ours.clip_grad_norm_(0.5)
    before, grads = snapshot(model, ours), _grads(model)
    with pytest.raises(ValueError, match="Invalid max_norm"):
        ours.clip_grad_norm_(max_norm)
    assert_unchanged(before, model, ours)
    _assert_same_grads(grads, model)
    _torch_clip(ref_model, 0.5)
    ours.step()
    ref.step()
    assert_same(model, ref_model, ours, ref, "after the refused clip")


@pytest.mark.parametrize("norm_type", [0.0, -1.0, -math.inf, math.nan])
def test_norm_types_torch_computes_but_we_do_not_are_refused(norm_type):
    """torch's clip takes any ``vector_norm`` order (0: the count of non-zeros, negative ones); ours takes 2,
    inf and finite p > 0 and refuses the rest naming norm_type, changing nothing."""
    model, ours, _, _ = _pair()
    loss_fn(model, 0, 0, "cpu").backward()
    before = snapshot(model, ours)
    with pytest.raises(ValueError, match="Invalid norm_type"):
        ours.clip_grad_norm_(1.0, norm_type)
    assert_unchanged(before, model, ours)
    ours.step()  # no clip pending


@pytest.mark.parametrize("ours_kw", FEEDS, ids=FEED_IDS)
@pytest.mark.parametrize("max_norm,norm_type", [(math.inf, 2.0), (0.0, 2.0), (math.inf, math.inf), (0.05, "inf"),
                                                (0.2, 1.0), (0.3, 2.5)])
def test_max_norm_and_norm_type_edges_match_torch(ours_kw, max_norm, norm_type):
    """``max_norm=inf`` clips nothing, 0 zeroes every gradient (AdamW still decays and counts the step), and the
    norm types torch and ours share agree, returned norm included."""
    model, ours, ref_model, ref = _pair(ours_kw)
    for step in range(4):
        ours.zero_grad()
        ref.zero_grad()
        loss_fn(model, step, 0, "cpu").backward()
        loss_fn(ref_model, step, 0, "cpu").backward()
        norm = ours.clip_grad_norm_(max_norm, norm_type)
        torch.testing.assert_close(norm, _torch_clip(ref_model, max_norm, norm_type))
        ours.step()
        ref.step()
        assert_same(model, ref_model, ours, ref, f"step {step}")


# ---------------------------------------------------------------------------------- the GradScaler's order --
def scaler_order_matches_torch(ours_kw, order, steps=8):
    """``opt.clip_grad_norm_`` before or after ``scaler.unscale_(opt)``, or with no ``unscale_`` (the scaler's
    step unscales): torch's clip of still-scaled gradients takes the scaled norm's coefficient, and ours does the
    same, whichever unscales them after it; an inf at one step is skipped by both."""
    model, ours, ref_model, ref = _pair(ours_kw)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3) for _ in range(2)]
    for step in range(steps):
        norms = []
        for m, o, sc in ((model, ours, scalers[0]), (ref_model, ref, scalers[1])):
            o.zero_grad()
            loss = loss_fn(m, step, 0, "cpu")
            if step == 5:
                loss = loss + m.ff1.weight[0, 0] * math.inf
            sc.scale(loss).backward()
            if order == "unscale_clip":
                sc.unscale_(o)
            norms.append(o.clip_grad_norm_(0.5) if o is ours else _torch_clip(m, 0.5))
            if order == "clip_unscale":
                sc.unscale_(o)
            sc.step(o)
            sc.update()
        assert scalers[0].get_scale() == scalers[1].get_scale(), step
        if step != 5:
            torch.testing.assert_close(norms[0], norms[1], msg=lambda m: f"step {step}: {m}")
        assert_same(model, ref_model, ours, ref, f"{order} step {step}")


@pytest.mark.parametrize("ours_kw", FEEDS[:2], ids=FEED_IDS[:2])  # (a GradScaler needs the gradients kept)
@pytest.mark.parametrize("order", ["clip_unscale", "clip_no_unscale", "unscale_clip"])
def test_clip_before_or_after_unscale_matches_torch(ours_kw, order):
    scaler_order_matches_torch(ours_kw, order)


def test_backward_after_clip_under_a_scaler_is_refused_and_the_retry_matches_torch():
    """The refusal inside ``scaler.step``: ``GradScaler`` deletes the ``grad_scale`` and ``found_inf`` it set on
    the optimizer only when ``step()`` returns, and its next ``step`` would multiply its scale by one left there;
    they go with the refusal, so the step run again in the right order follows AdamW with torch's clip."""
    model, ours, ref_model, ref = _pair(dict(stream_grads=True))
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3) for _ in range(2)]
    for step in range(4):
        ours.zero_grad()
        scalers[0].scale(loss_fn(model, step, 0, "cpu")).backward()
        ours.clip_grad_norm_(0.5)
        scalers[0].scale(loss_fn(model, step, 1, "cpu")).backward()
        before = snapshot(model, ours)
        with pytest.raises(RuntimeError, match="the gradients changed after opt.clip_grad_norm_"):
            scalers[0].step(ours)
        assert_unchanged(before, model, ours)
        assert not hasattr(ours, "grad_scale") and not hasattr(ours, "found_inf")
        for m, o, sc in ((model, ours, scalers[0]), (ref_model, ref, scalers[1])):
            o.zero_grad()
            sc.scale(loss_fn(m, step, 0, "cpu")).backward()
            sc.scale(loss_fn(m, step, 1, "cpu")).backward()
            sc.unscale_(o)
            o.clip_grad_norm_(0.5) if o is ours else _torch_clip(m, 0.5)
            sc.step(o)
            sc.update()
        assert_same(model, ref_model, ours, ref, f"step {step}")

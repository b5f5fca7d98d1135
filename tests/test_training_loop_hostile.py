"""A hostile user's training loops around ``OffloadOptimizer``, each run beside ``torch.optim.AdamW(foreach=False)``
(parameters and state compared every step, default fp32 tolerance): interruptions (a user's hook raising
``KeyboardInterrupt`` half way through a streamed backward, a closure raising after its backward), a parameter
frozen and unfrozen mid-run, and optimizers sharing a model (rebuilt while the old one lives on, two over the same
parameters). The findings are refusals that name the problem and change nothing (a parameter that is a view of
another's data; an optimizer with ``release_grads`` that would take the gradients another live optimizer steps
with), a warning where ``overlap_step`` had already updated buckets of a step the loop skipped, and, sharded over
gloo, a backward interrupted at different points on the ranks: refused on every rank instead of gloo aborting one.

GPU placements run on the CUDA stand-ins of tests/cuda_standins.py (streams and events order nothing; the
Python of the GPU routes runs for real on the CPU).
"""

from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch
import torch.nn as nn

import cuda_standins
from test_optimizer import TinyTransformer, assert_same, assert_unchanged, loss_fn, param_groups, snapshot
from zero_offload import OffloadOptimizer

STEPS = 6


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch, needs_fused=False)


# Each: (runs on the stand-ins, the optimizer's keywords).
PLACEMENTS = {
    "cpu-stream": (False, dict(stream_grads=True, bucket_numel=1000)),
    "cpu-release": (False, dict(stream_grads=True, release_grads=True, bucket_numel=1000)),
    "host-release": (True, dict(placement="host", release_grads=True, bucket_numel=1000)),
    "mix": (True, dict(placement={"resident": 0.3, "parked": 0.4}, bucket_numel=1000)),
}
RELEASING = ["cpu-release", "host-release"]


def _kw(request, name):
    standin, kw = PLACEMENTS[name]
    if standin:
        request.getfixturevalue("cuda_branches")
    return kw


def _models():
    """The model and a copy of it for AdamW."""
    torch.manual_seed(0)
    model = TinyTransformer()
    return model, copy.deepcopy(model)


def _beside_adamw(kw):
    """The models, ours over the first (``kw``) and AdamW over the copy."""
    model, ref_model = _models()
    return model, ref_model, OffloadOptimizer(param_groups(model), **kw), \
        torch.optim.AdamW(param_groups(ref_model), foreach=False)


def _step(model, opt, step, micro=0):
    opt.zero_grad()
    loss_fn(model, step, micro, "cpu").backward()
    opt.step()


class Interrupt:
    """A user's tensor hook on ``ln1.weight`` (mid-model: the buckets of the head and the MLP have streamed when
    it runs) that raises ``KeyboardInterrupt`` while armed."""

    def __init__(self, model):
        self.armed = False
        model.ln1.weight.register_hook(self)

    def __call__(self, grad):
        if self.armed:
            raise KeyboardInterrupt
        return grad


class ClosureFailed(Exception):
    pass


def _interrupted_step(model, opt, step, hook):
    """One step of the loop below: a backward interrupted at step 1 (skipped, as the loop's ``except`` does), a
    closure that raises after its backward at step 2, ``ff1`` and ``head`` frozen from step 3 to step 4."""
    if step in (3, 5):
        for p in (model.ff1.weight, model.head.weight):
            p.requires_grad_(step == 5)
    hook.armed = step == 1

    def closure():
        opt.zero_grad()
        loss = loss_fn(model, step, 0, "cpu")
        loss.backward()
        if step == 2:
            raise ClosureFailed
        return loss

    try:
        if step == 2:
            opt.step(closure)
        else:
            _step(model, opt, step)
    except (KeyboardInterrupt, ClosureFailed):
        pass


@pytest.mark.parametrize("placement", ["cpu-stream", "host-release", "mix"])
def test_interrupted_steps_and_a_frozen_parameter_train_on_as_adamw(request, placement):
    """A ``KeyboardInterrupt`` raised by a user's hook after half the buckets have streamed, a closure that raises
    after its backward, parameters frozen mid-run and unfrozen later: after each, training goes on as AdamW's that
    met the same (the interrupted steps skipped, the frozen parameters not stepped)."""
    kw = _kw(request, placement)
    model, ref_model, ours, ref = _beside_adamw(kw)
    hooks = Interrupt(model), Interrupt(ref_model)
    for step in range(STEPS + 1):
        for m, opt, hook in ((model, ours, hooks[0]), (ref_model, ref, hooks[1])):
            _interrupted_step(m, opt, step, hook)
        assert_same(model, ref_model, ours, ref, f"step {step}")


# -- a parameter over another's memory -------------------------------------------------------------------------------
def _trained_model():
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model))
    _step(model, opt, 0)
    return model, opt


@pytest.mark.parametrize("how", ["slice", "whole", "transposed"])
def test_a_parameter_over_a_view_of_another_is_refused_naming_both(how):
    """``nn.Parameter(w.data[:5])`` (or over all of ``w``'s data, or its transpose) shares ``w``'s elements. AdamW
    steps them once per parameter; each of ours gets a slot of its own, so the two silently stopped sharing (the
    view stepped apart from the elements it viewed). Refused at construction, naming both."""
    w = nn.Parameter(torch.randn(10, 4))
    view = {"slice": lambda d: d[:5], "whole": lambda d: d, "transposed": lambda d: d.t()}[how]
    v = nn.Parameter(view(w.data))
    before = w.detach().clone()
    with pytest.raises(ValueError, match=r"param group 0, parameter 1 \(shape .*\) shares memory with param group "
                                         r"0, parameter 0 .* a view of the other's data"):
        OffloadOptimizer([w, v])
    assert torch.equal(w, before) and v.data_ptr() >= w.data_ptr()  # (not rebound: nothing was laid out)
    with pytest.raises(ValueError, match=r"param group 1, parameter 0 \(shape .*\) shares memory with param group 0"):
        OffloadOptimizer([{"params": [w]}, {"params": [v]}])


def test_a_param_group_over_a_view_of_a_parameter_is_refused_and_changes_nothing():
    """The same for ``add_param_group`` mid-run (a CPU parameter is a view of our buffer then): the optimizer is
    unchanged. A parameter of its own storage next to it in memory (another optimizer's buffer) is taken."""
    model, opt = _trained_model()
    before = snapshot(model, opt)
    view = nn.Parameter(model.head.weight.data[3:5])
    with pytest.raises(ValueError, match=r"param group 2, parameter 0 \(shape \(2, 16\)\) shares memory with param "
                                         r"group 0, parameter \d+ \(shape \(31, 16\)\)"):
        opt.add_param_group({"params": [view]})
    assert_unchanged(before, model, opt)
    other = TinyTransformer()
    OffloadOptimizer(other.parameters())  # its parameters now lie side by side in one buffer
    opt.add_param_group({"params": list(other.parameters())[:3]})


# -- optimizers sharing a model --------------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", ["cpu-stream", "mix"])
def test_two_live_optimizers_over_one_model_each_step_as_adamw(request, placement):
    """An optimizer rebuilt while the old one lives on (a scheduler still holds it), both stepped: each as an AdamW
    beside it (what the refusal below must not refuse, without ``release_grads``)."""
    kw = _kw(request, placement)
    model, ref_model = _models()
    ours = [OffloadOptimizer(param_groups(model), **kw) for _ in range(2)]
    ref = [torch.optim.AdamW(param_groups(ref_model), foreach=False) for _ in range(2)]
    for step in range(4):
        for m, opts in ((model, ours), (ref_model, ref)):
            _step(m, opts[step % 2], step)
        assert_same(model, ref_model, ours[step % 2], ref[step % 2], f"step {step}")


@pytest.mark.parametrize("placement", ["cpu-stream", "cpu-release"])
def test_parameters_swapped_by_module_conversion_train_on_as_adamw(request, placement):
    """``model.to()`` swaps each parameter's contents where torch is told to
    (``torch.__future__.set_swap_module_params_on_conversion``, and always for FSDP2's DTensor parameters), and
    ``torch.utils.swap_tensors`` refuses a tensor that has a weak reference: the optimizer keeps none on them."""
    kw = _kw(request, placement)
    model, ref_model, ours, ref = _beside_adamw(kw)
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for step in range(3):
            for m in (model, ref_model):
                m.to("cpu")
            for m, opt in ((model, ours), (ref_model, ref)):
                _step(m, opt, step)
            assert_same(model, ref_model, ours, ref, f"step {step}")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize("placement", RELEASING)
def test_an_optimizer_releasing_gradients_another_live_one_steps_with_is_refused(request, placement):
    """With ``release_grads`` an optimizer's hooks set ``.grad`` to None once it is on its way to their host buffer:
    an old optimizer still alive (a scheduler refers to it) over the same parameters took every gradient, and the
    new one stepped without them, silently. The first hook of the backward refuses it, naming the parameter,
    before any copy; once the old optimizer is dropped, training goes on as AdamW's."""
    kw = _kw(request, placement)
    model, ref_model = _models()
    old = OffloadOptimizer(param_groups(model), **kw)
    scheduler = torch.optim.lr_scheduler.StepLR(old, 10)
    _step(model, old, 0)
    _step(ref_model, torch.optim.AdamW(param_groups(ref_model), foreach=False), 0)
    ours = OffloadOptimizer(param_groups(model), **kw)  # (a fresh state from step 1 on, beside a fresh AdamW)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    before = snapshot(model, ours), snapshot(model, old)
    ours.zero_grad()
    with pytest.raises(RuntimeError, match=r"param group \d, parameter \d+ is also optimized by another live "
                                           r"OffloadOptimizer, and this one has release_grads=True"):
        loss_fn(model, 1, 0, "cpu").backward()
    assert not ours._transport.moved and not old._transport.moved  # (refused before any copy)
    ours.zero_grad()
    old.zero_grad()
    assert_unchanged(before[0], model, ours)
    assert_unchanged(before[1], model, old)
    del old, scheduler
    gc.collect()
    for step in range(1, 4):
        for m, opt in ((model, ours), (ref_model, ref)):
            _step(m, opt, step)
        assert_same(model, ref_model, ours, ref, f"step {step}")


@pytest.mark.parametrize("old_kw,new_kw", [("cpu-release", "cpu-release"), ("cpu-stream", "cpu-release"),
                                            ("cpu-release", "cpu-stream"), ("host-release", "host-release")])
def test_an_optimizer_rebuilt_over_an_uncollected_old_one_steps_as_adamw(request, old_kw, new_kw):
    """The usual rebuild (``opt = OffloadOptimizer(...)`` again, a scheduler with it): the old optimizer is no longer
    referred to, but lives on in its reference cycles until the cyclic collector runs (disabled here, as after a
    long run the optimizer sits in the oldest generation). It is no other holder: not refused, as AdamW is not;
    the new one steps as a fresh AdamW, the old one's hooks taking nothing."""
    old_kw, new_kw = _kw(request, old_kw), _kw(request, new_kw)
    model, ref_model = _models()
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        opt = OffloadOptimizer(param_groups(model), **old_kw)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 10)
        ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
        for step in range(2):
            for m, o in ((model, opt), (ref_model, ref)):
                _step(m, o, step)
            scheduler.step()
        assert_same(model, ref_model, opt, ref, "old")
        opt = OffloadOptimizer(param_groups(model), **new_kw)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 10)
        ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
        for step in range(2, 5):
            for m, o in ((model, opt), (ref_model, ref)):
                _step(m, o, step)
            scheduler.step()
            assert_same(model, ref_model, opt, ref, f"step {step}")
    finally:
        if was:
            gc.enable()


def test_an_optimizer_dropped_while_the_holders_of_its_parameters_are_looked_at_breaks_no_look():
    """An optimizer's finaliser runs wherever the cyclic collector does: also inside the look a releasing
    optimizer's first hook takes at the holders of its parameters (an allocation there may trigger a collection).
    Dropped there, it must not change the set being looked at (was: ``RuntimeError: Set changed size during
    iteration`` out of the user's backward); the one left steps as AdamW."""
    from zero_offload import holders
    model, ref_model = _models()
    kw = PLACEMENTS["cpu-release"][1]
    old = OffloadOptimizer(param_groups(model), **kw)
    ours = OffloadOptimizer(param_groups(model), **kw)
    first = next(iter(model.parameters()))
    for _ in holders._HOLDERS[id(first)]:  # (the look, and the finaliser run in the middle of it)
        old._unhook()
    del old
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    for step in range(3):
        for m, opt in ((model, ours), (ref_model, ref)):
            _step(m, opt, step)
        assert_same(model, ref_model, ours, ref, f"step {step}")


@pytest.mark.parametrize("placement", RELEASING)
def test_an_optimizer_built_over_gradients_another_has_taken_is_refused(request, placement, caplog):
    """Built between a releasing optimizer's backward and its ``step()``, a new optimizer over the same parameters
    would step without the gradients the old one holds: refused at construction, naming the parameter. Dropping
    the old one there loses them, and says so; after that the new one is built and steps as AdamW."""
    kw = _kw(request, placement)
    model, ref_model = _models()
    old = OffloadOptimizer(param_groups(model), **kw)
    loss_fn(model, 0, 0, "cpu").backward()
    with pytest.raises(ValueError, match=r"param group 0, parameter 0 \(shape .*\): its gradient of the last "
                                         r"backward was taken by a live OffloadOptimizer with release_grads=True"):
        OffloadOptimizer(param_groups(model), **kw)
    with caplog.at_level(logging.WARNING, logger="zero_offload"):
        del old
        gc.collect()
    assert "those gradients are lost with it" in caplog.text
    ours = OffloadOptimizer(param_groups(model), **kw)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    for step in range(1, 3):
        for m, opt in ((model, ours), (ref_model, ref)):
            _step(m, opt, step)
        assert_same(model, ref_model, ours, ref, f"step {step}")


# -- a step abandoned after overlap_step's updates in backward -------------------------------------------------------
@pytest.mark.parametrize("how", ["interrupted", "zero_grad"])
def test_a_step_abandoned_after_overlap_steps_updates_says_which_buckets_stepped(cuda_branches, how, caplog):
    """With ``overlap_step`` each bucket is updated in backward as its gradients arrive, so a step skipped after
    its backward (``zero_grad()`` instead of ``step()``), or after a backward a hook interrupted half way, has
    already stepped some buckets: AdamW skipping it steps none. That went unsaid; now a warning names them. The
    buckets backward had not reached are AdamW's that skipped the step, and training goes on without an error."""
    model, ref_model, ours, ref = _beside_adamw(dict(placement="host", bucket_numel=1000, overlap_step=True,
                                                     nonfinite="ignore"))
    hook = Interrupt(model)
    for step in range(2):
        for m, opt in ((model, ours), (ref_model, ref)):
            _step(m, opt, step)
        assert_same(model, ref_model, ours, ref, f"step {step}")
    assert "overlap_step=True): a step abandoned" not in caplog.text
    ours.zero_grad()
    hook.armed = how == "interrupted"
    try:
        loss_fn(model, 2, 0, "cpu").backward()
    except KeyboardInterrupt:
        pass
    hook.armed = False
    updated = [lane.bucket for lane in ours._mode._jobs]
    stepped = {id(p) for b in updated for p in b.params if p.grad is not None}
    assert updated and len(updated) < len(ours._lanes[0]) + len(ours._lanes[1]) or how == "zero_grad"
    with caplog.at_level(logging.WARNING, logger="zero_offload"):
        ours.zero_grad()
    assert f"had already updated {len(updated)} bucket(s) during backward" in caplog.text
    assert all(b.label(0) in caplog.text for b in updated)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        # (assert_close's default fp32 tolerance; a step moves each element by about lr, 1e-3, far beyond it)
        assert torch.allclose(p, q, rtol=1.3e-6, atol=1e-5) != (id(p) in stepped), name
    _step(model, ours, 3)


# -- a sharded backward that raised on every rank, at different points -----------------------------------------------
def _abandoned_sharded_worker(rank, world, kw):
    import test_distributed as td
    import torch.distributed as dist

    model, ref_model = td._make(rank, seed_ours=rank)
    opt = OffloadOptimizer(td.groups(model), lr=1e-2, bucket_numel=td.BUCKET_NUMEL, process_group=dist.group.WORLD,
                           timeout=30, placement="host", stream_grads=True, **kw)
    ref = torch.optim.AdamW(td.groups(ref_model), lr=1e-2, foreach=False)
    armed = [False]

    def interrupt(grad):
        if armed[0]:
            raise KeyboardInterrupt
        return grad

    model.w1.register_hook(interrupt)  # (how much of the backward ran before it depends on each rank's data)
    for step in range(4):
        try:
            opt.zero_grad()
        except RuntimeError as exc:
            return step, "zero_grad", str(exc)
        armed[0] = step == 2
        try:
            td.loss_on(model, step, 0, td.rows_of(rank, world)).backward()
        except KeyboardInterrupt:
            continue  # (the loop skips the step, as after an out-of-memory backward)
        except RuntimeError as exc:
            return step, "backward", str(exc)
        finally:
            armed[0] = False
        opt.step()
        td._ref_step(ref_model, ref, step)
        td._compare(model, ref_model, f"step {step}")
    return None


@pytest.mark.parametrize("release", [False, True], ids=["stream", "release"])
def test_a_sharded_backward_interrupted_at_different_points_is_refused_on_every_rank(release):
    """Each rank's backward interrupted by a user's hook at step 2, after the buckets its own data had completed:
    rank 1 had begun reduce-scattering, rank 0 had not. The loop skipped the step and went on, so rank 0's next
    backward met rank 1's abandoned collectives: gloo aborted rank 1's process (``EnforceNotMet``, exit -6) and
    rank 0 failed on the broken connection. Now ``zero_grad()`` after a backward that raised meets the other ranks
    first, and every rank raises, naming where each is."""
    import test_distributed as td

    results = td.launch(_abandoned_sharded_worker, 2, dict(release_grads=release))
    assert results[0][:2] == (3, "zero_grad") and results[1][:2] == (2, "backward"), results
    for rank, (_, _, message) in results.items():
        assert ("rank 0 is in zero_grad(), abandoning a backward that raised on this rank (after 0 streamed "
                "backwards); rank 1 is in backward 1 of this step, reduce-scattering its gradients") in message, \
            (rank, message)


@pytest.mark.parametrize("placement", ["cpu-stream", "host-release"])
def test_a_sparse_gradient_streamed_in_backward_is_refused_and_training_goes_on(request, placement):
    """``nn.Embedding(sparse=True)`` (``tok``) for one step: where its bucket streams, the copy's check raises in backward,
    naming the parameter; nothing is updated (AdamW raises at ``step()`` after updating the groups before the
    embedding's: the reference here skips the step), and once the gradient is dense again training goes on as
    AdamW's."""
    kw = _kw(request, placement)
    model, ref_model, ours, ref = _beside_adamw(kw)
    for step in range(4):
        model.tok.sparse = step == 2
        if step == 2:
            ours.zero_grad()
            with pytest.raises(RuntimeError, match=r"sparse gradients \(param group 1, parameter 2 has a "
                                                   r"torch.sparse_coo gradient\)"):
                loss_fn(model, step, 0, "cpu").backward()
        else:
            for m, opt in ((model, ours), (ref_model, ref)):
                _step(m, opt, step)
        assert_same(model, ref_model, ours, ref, f"step {step}")


@pytest.mark.parametrize("placement", RELEASING)
def test_with_release_grads_only_the_optimizers_zero_grad_discards_a_backward(request, placement):
    """Released gradients live in the host buffer, out of the module's sight: ``model.zero_grad()`` between two
    backwards leaves the first one's, and ``step()`` applies both (AdamW that zeroed nothing in between: the
    documented difference), where ``opt.zero_grad()`` discards it (AdamW after its ``zero_grad()``)."""
    kw = _kw(request, placement)
    model, ref_model, ours, ref = _beside_adamw(kw)
    for step, discard in enumerate([lambda m, opt: m.zero_grad(), lambda m, opt: opt.zero_grad()]):
        for m, opt in ((model, ours), (ref_model, ref)):
            opt.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
            if opt is ours or step == 1:  # (AdamW keeps the first backward where ours keeps it)
                discard(m, opt)
            loss_fn(m, step, 1, "cpu").backward()
            opt.step()
        assert_same(model, ref_model, ours, ref, f"step {step}")

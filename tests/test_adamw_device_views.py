"""AdamW's update on the GPU (a parked or resident bucket, :meth:`zero_offload.rules.adamw.AdamW.update_on_device`)
steps the home's per-parameter views of the master and the moments (:attr:`~zero_offload.rules.base.Run.views`, cut
once, not per step), each gradient as autograd left it (no reshape), and writes a bf16 parameter from its master in
one copy of the run's flat range. What that saves is host time per parameter (benchmarks/parked_overhead.py); what
it must not change:

* the result: torch's fused AdamW (``torch.optim.AdamW(fused=True)``, the kernel the GPU update calls), bit for bit,
  parameters and every state tensor after every step: fp32 and bf16 parameters (the fp32 masters against AdamW on
  fp32 copies), parked and resident, two groups, parameters without a gradient in some steps (they keep their
  values), amsgrad switched on mid-run (its buffer added: its views cut then), a channels-last parameter (its
  gradient read from its slot, flat) and a 0-d one;
* what the kernel receives: the same view objects from step to step (a view cut anew each step fails), parked ones
  inside the memory that step's reload filled, the fp32 gradients the ``.grad`` tensors themselves, and per
  parameter the same sizes and strides in every list (CUDA's fused kernel refuses anything else; torch's CPU kernel,
  which stands in for it here, does not check).

Lion steps the same views (tests/test_parked_overhead.py): a channels-last parameter, whose gradient comes flat from
its slot, made its multi-tensor update raise (the sizes did not broadcast); now it equals ``zero_offload.Lion``.

On CPU-only machines the GPU is the stand-in of tests/cuda_standins.py.
"""

from __future__ import annotations

from itertools import chain

import pytest
import torch

import cuda_standins
from zero_offload import Lion, OffloadOptimizer, offload
from zero_offload.state.layout import _dense  # (elements filling consecutive memory, in some order)

# (the 4-d one channels-last; a 0-d one; tail sizes)
SHAPES = [(12, 20), (20,), (4, 3, 2, 5), (7,), (3, 5, 2), (), (130,), (1, 9), (65,), (16, 16)]
CHANNELS_LAST = 2
BUCKET = 512  # (several buckets of several parameters)
# Gradients not streamed: every step reads each where it is (the channels-last one from its slot). Streamed, once that
# one's slot exists its bucket's gradients are copied into the flat buffer at step() (a flat run: no views).
OPTIONS = dict(bucket_numel=BUCKET, stream_grads=False)
KW = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
SECOND = dict(weight_decay=0.0, maximize=True, lr=3e-3)
NO_GRAD = {2: {1, 5, 7}, 4: {0, CHANNELS_LAST}}  # step -> parameters without a gradient then
AMSGRAD_ON = 3  # the step from which the second group runs amsgrad


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch)


def _params(dtype, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, shape in enumerate(SHAPES):
        t = torch.randn(shape, generator=gen).to(device, dtype)
        if i == CHANNELS_LAST:
            t = t.to(memory_format=torch.channels_last)
        out.append(torch.nn.Parameter(t))
    return out


def _groups(params):
    half = len(params) // 2
    return [{"params": params[:half]}, {"params": params[half:], **SECOND}]


def _buckets(opt):
    return list(chain.from_iterable(opt._buckets))


def _set_grads(ours, theirs, step):
    """The same gradient values on both sides (ours in the parameters' dtype, AdamW's those values in fp32), each laid
    out like its parameter (channels-last for that one, as autograd gives it); none for ``NO_GRAD[step]``."""
    gen = torch.Generator().manual_seed(100 + step)
    for i, (p, q) in enumerate(zip(ours, theirs)):
        g = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
        absent = i in NO_GRAD.get(step, ())
        p.grad = None if absent else torch.empty_like(p).copy_(g)
        q.grad = None if absent else torch.empty_like(q).copy_(g.float())


def _same(ours, opt, theirs, ref, what):
    """Bit for bit: each parameter (a bf16 one as its master rounded), its state (a bf16 one's master: AdamW's fp32
    parameter), the keys AdamW shows."""
    for i, (p, q) in enumerate(zip(ours, theirs)):
        assert torch.equal(p, q.to(p.dtype)), f"{what}: parameter {i} {tuple(p.shape)}"
        mine, theirs_ = opt.state[p], ref.state[q]
        extra = {"master"} if p.dtype != torch.float32 else set()
        assert set(mine) == set(theirs_) | extra, (what, i, sorted(mine), sorted(theirs_))
        for key, value in theirs_.items():  # (a parked bucket's state on the host, AdamW's on the GPU)
            assert torch.equal(mine[key].to(value.device), value), f"{what}: {key!r} of parameter {i}"
        if extra:
            assert torch.equal(mine["master"].to(q.device), q), f"{what}: the master of parameter {i}"


def _step(opt, what):
    """``opt.step()``; an error it raises is reported by its message alone: the frames' tensors (a parked step's
    device copies, their memory given back as the step ended) must not be printed."""
    try:
        opt.step()
    except RuntimeError as e:
        pytest.fail(f"{what}: {type(e).__name__}: {e}", pytrace=False)


def _into(view, twin):
    """Whether ``view`` lies inside the memory ``twin``'s storage holds now."""
    lo = twin.untyped_storage().data_ptr()
    hi = lo + twin.untyped_storage().nbytes()
    return lo <= view.data_ptr() and view.data_ptr() + view.numel() * view.element_size() <= hi


def _laid_out_alike(lists):
    """CUDA's fused AdamW's check (``check_fast_path_restrictions``): per parameter, every list's tensor of one dtype,
    dense, with the same sizes and strides (a size-1 dimension's stride free)."""
    for tensors in zip(*lists):
        first = tensors[0]
        for t in tensors:
            if t.dtype != torch.float32 or not _dense(t) or t.shape != first.shape:
                return False
            if any(s != 1 and a != b for s, a, b in zip(t.shape, t.stride(), first.stride())):
                return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("placement", ["parked", "resident"])
def test_adamw_on_the_gpu_steps_the_homes_views_bitwise_torchs_fused_adamw(cuda_branches, monkeypatch, placement,
                                                                          dtype):
    """Bitwise ``torch.optim.AdamW(fused=True)`` every step, and what the kernel receives, as the module docstring
    says (the views the same objects from step to step: on main, cut anew at every update, this failed)."""
    _beside_fused(monkeypatch, placement, dtype, "cpu")


# -- on a real GPU (skipped without one; in the lease plan's `pytest -m cuda`) --------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("placement", ["parked", "resident"])
def test_adamw_on_a_gpu_steps_the_homes_views_bitwise_torchs_fused_adamw(monkeypatch, placement, dtype):
    """The same on a GPU, against AdamW's fused CUDA kernel there: its own check refuses tensors not laid out alike
    (the channels-last parameter's gradient, read from its slot, flat)."""
    _beside_fused(monkeypatch, placement, dtype, "cuda")


def _beside_fused(monkeypatch, placement, dtype, device):
    fused, calls, recording = torch._fused_adamw_, [], [False]

    def spy(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, *args, **kw):
        if recording[0]:
            calls.append(dict(master=list(params), grads=list(grads), exp_avg=list(exp_avgs),
                              exp_avg_sq=list(exp_avg_sqs), max_exp_avg_sq=list(max_exp_avg_sqs)))
        return fused(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, *args, **kw)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    ours = _params(dtype, device)
    theirs = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]  # (clone keeps channels-last)
    opt = OffloadOptimizer(_groups(ours), placement=placement, **OPTIONS, **KW)
    ref = torch.optim.AdamW(_groups(theirs), fused=True, **KW)
    buckets = _buckets(opt)
    assert {b.home.kind for b in buckets} == {placement} and len(buckets) > 2
    assert ours[CHANNELS_LAST].is_contiguous(memory_format=torch.channels_last)
    seen = {}  # buffer name -> the view objects passed at the last step that passed any (kept alive: ids stay theirs)
    for step in range(6):
        if step == AMSGRAD_ON:
            for o in (opt, ref):
                o.param_groups[1]["amsgrad"] = True
            for q in ref.param_groups[1]["params"]:  # (AdamW's state gets the zero buffer ours starts it with)
                ref.state[q]["max_exp_avg_sq"] = torch.zeros_like(q)
        _set_grads(ours, theirs, step)
        before = [p.detach().clone() for p in ours]
        calls.clear()
        recording[0] = True
        _step(opt, f"step {step}")
        recording[0] = False
        # (checked before AdamW steps: what the kernel received, while our step's buffers are as it left them)
        # (Booleans only in the asserts: a parked step's device copies have given their memory back, and a failure's
        # report of the tensors themselves would read it.)
        alike = [_laid_out_alike([c[k] for k in ("master", "grads", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
                                  if c[k]]) for c in calls]
        assert alike and all(alike), (step, alike)
        stepped = sum(len(c["master"]) for c in calls)
        assert stepped == len(ours) - len(NO_GRAD.get(step, ())), step
        if dtype == torch.float32:  # (read where autograd left them: the .grad tensors, or a slot's range)
            grads = {id(p.grad) for p in ours if p.grad is not None}
            from_slot = CHANNELS_LAST not in NO_GRAD.get(step, ())  # (that one's is its slot's range)
            as_left = sum(id(g) in grads for c in calls for g in c["grads"])
            assert as_left == stepped - from_slot, step
        for name in ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            now = [t for c in calls for t in c[name]]
            if name in seen and now:
                ids = {id(t) for t in seen[name]}
                kept = all(id(t) in ids for t in now)
                assert kept, f"step {step}: views of {name!r} cut anew"
            if len(now) == len(ours) or (name == "max_exp_avg_sq" and now and name not in seen):
                seen[name] = now
        if placement == "parked":
            assert all(b.home.twins is None for b in buckets)  # (given back after each step)
        ref.step()
        _same(ours, opt, theirs, ref, f"step {step}")
        for i in NO_GRAD.get(step, ()):
            assert torch.equal(ours[i], before[i]), (step, i)
    assert set(seen) == {"master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}


def test_parked_views_are_inside_the_memory_each_reload_filled(cuda_branches, monkeypatch):
    """Parked, bf16: the master and moment views the kernel steps lie in the device copies brought up for that step
    (the memory given to the last reload held by another tensor meanwhile, NaN, which must stay so)."""
    fused, problems, reloads = torch._fused_adamw_, [], []
    ours = _params(torch.bfloat16)
    opt = OffloadOptimizer(_groups(ours), placement="parked", **OPTIONS, **KW)
    buckets = _buckets(opt)

    def spy(params, grads, exp_avgs, exp_avg_sqs, *args, **kw):
        up = [b.home.twins for b in buckets if b.home.twins is not None]
        for name, views in (("master", params), ("exp_avg", exp_avgs), ("exp_avg_sq", exp_avg_sqs)):
            if not all(any(_into(v, twins[name]) for twins in up) for v in views):
                problems.append(name)
        reloads.extend(twins["exp_avg"].untyped_storage().data_ptr() for twins in up)
        return fused(params, grads, exp_avgs, exp_avg_sqs, *args, **kw)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    blockers = []
    for step in range(4):
        _set_grads(ours, [torch.nn.Parameter(p.detach().float()) for p in ours], step)
        _step(opt, f"step {step}")
        assert not problems, (step, problems)
        assert all(torch.isnan(b).all() for b in blockers), "written into memory given back"
        blockers = [torch.full((b.home.store.flat["exp_avg"].numel(),), float("nan")) for b in buckets]
    assert len(set(reloads)) > len(buckets), "every reload was given the same memory: the test proves nothing"


@pytest.mark.parametrize("placement", ["parked", "resident"])
def test_lion_on_the_gpu_steps_a_channels_last_parameter_as_lion(cuda_branches, placement):
    """A channels-last parameter's gradient is read from its slot, flat: laid out as the views of the master and
    ``exp_avg`` now (it raised before: the sizes did not broadcast). Bitwise ``zero_offload.Lion`` every step."""
    kw = dict(lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1)
    ours = _params(torch.float32)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = offload(Lion, ours, placement=placement, **OPTIONS, **kw)
    ref = Lion(theirs, **kw)
    for step in range(4):
        _set_grads(ours, theirs, step)
        _step(opt, f"step {step}")
        ref.step()
        for i, (p, q) in enumerate(zip(ours, theirs)):
            assert torch.equal(p, q), (step, i)
            assert torch.equal(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"]), (step, i)

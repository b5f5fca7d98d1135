"""``offload(torch.optim.Adafactor, placement="parked" | "resident")``: a class whose per-parameter state is not shaped
like the parameter (Adafactor's row and column factors of a matrix's second moment, ``variance`` of a vector) steps
each parameter whole with its own code on the GPU, its state held in the bucket's shaped buffer
(zero_offload/state/shaped.py: parked on the host between steps, or kept on the device). Against
``torch.optim.Adafactor`` stepping the same parameters: parameters and every state tensor (keys, shapes, values),
bit for bit, every step; checkpoints both ways; what still cannot be parked, refused naming the entry.

On CPU-only machines the GPU is the stand-in of tests/cuda_standins.py (the class runs its CPU code on both sides);
the last test runs on a real GPU, skipped without one.
"""

from __future__ import annotations

import io
from itertools import chain

import pytest
import torch

import cuda_standins
import test_park_class as park_class
from test_park_class import _clone, _homes, _loss, _step_both
from zero_offload import offload

# 1-D, 2-D and 3-D parameters (Adafactor factors the last two dimensions of a >2-D one), odd sizes, sizes at SIMD
# and alignment tails (7, 17 and 4097 elements), a row and a column; several parameters per bucket.
SHAPES = [(7,), (5, 7), (17,), (3, 4, 5), (1, 9), (11, 1), (4097,), (2, 3, 17), (64, 17), (130,)]
BUCKET = 2048
SECOND = dict(lr=0.02, beta2_decay=-0.6, eps=(1e-30, 1e-2), d=1.5, weight_decay=0.05, maximize=True)


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch, needs_fused=False)


def _params(shapes=SHAPES, seed=0):
    return park_class._params(shapes, seed)


def _groups(params, second=SECOND):
    """Two param groups: the first half with the defaults (and weight decay), the rest with ``second``'s."""
    half = len(params) // 2
    return [{"params": params[:half], "weight_decay": 0.1}, {"params": params[half:], **second}]


def _same(ours, opt, theirs, ref, what):
    for i, (p, q) in enumerate(zip(ours, theirs)):
        assert torch.equal(p, q), f"{what}: parameter {i} {tuple(p.shape)} differs by {(p - q).abs().max()}"
        mine, want = opt.state[p], ref.state[q]
        assert set(mine) == set(want), (what, i, set(mine), set(want))
        for key, value in want.items():
            assert mine[key].shape == value.shape, (what, i, key, mine[key].shape, value.shape)
            assert torch.equal(mine[key].cpu(), value.cpu()), (  # (on the host: a parked bucket's state is there)
                f"{what}: state {key!r} of parameter {i} {tuple(p.shape)}")


def _saved(o):
    buf = io.BytesIO()
    torch.save(o.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("placement", ["parked", "resident"])
def test_adafactor_on_the_gpu_is_bitwise_adafactor_every_step(cuda_branches, placement):
    ours, theirs = _params(), _params()
    opt = offload(torch.optim.Adafactor, _groups(ours), placement=placement, bucket_numel=BUCKET)
    ref = torch.optim.Adafactor(_groups(theirs))
    homes = _homes(opt)
    assert len(homes) > 3 and set(homes) == {placement}, homes
    for step in range(6):
        _step_both(ours, opt, theirs, ref, step, lr=0.005 if step == 3 else None)
        _same(ours, opt, theirs, ref, f"step {step}")
    # The factored state is what Adafactor keeps: a matrix's row and column factors, a vector's variance.
    assert opt.state[ours[1]]["row_var"].shape == (5, 1) and opt.state[ours[1]]["col_var"].shape == (1, 7)
    assert opt.state[ours[3]]["row_var"].shape == (3, 4, 1) and opt.state[ours[3]]["col_var"].shape == (3, 1, 5)
    assert set(opt.state[ours[0]]) == {"step", "variance"}
    # Where the state lives: the bucket's shaped buffer only (no per-element buffer), far smaller than the
    # parameters for the matrices; a parked bucket parks it (reloads and writes it back with its other buffers).
    for bucket in chain.from_iterable(opt._buckets):
        store = bucket.home.store
        assert store.flat == {} and store.shaped.flat is not None, (store.names, bucket.shapes)
        if placement == "parked":
            assert any(t is store.shaped.flat for t in bucket.home.parked().values())
    held = sum(b.home.store.shaped.flat.numel() for b in chain.from_iterable(opt._buckets))
    assert held < sum(p.numel() for p in ours), held


def test_adafactor_parked_under_a_gradscaler_is_bitwise_adafactor_under_one(cuda_branches):
    """GradScaler's unscale (a power of two: exact either way) and its overflow verdict (step 2 skipped)."""
    ours, theirs = _params(), _params()
    opt = offload(torch.optim.Adafactor, ours, placement="parked", bucket_numel=BUCKET)
    park_class.scaled_run(ours, opt, theirs, torch.optim.Adafactor(theirs), _same)


def test_a_bf16_model_parked_steps_its_fp32_masters_as_adafactor_steps_fp32_parameters(cuda_branches):
    """The class steps the fp32 masters (parked with the factors); the bf16 parameters are them rounded."""
    park_class.bf16_masters_run(torch.optim.Adafactor, _params(), BUCKET, weight_decay=0.1)


def test_an_edited_or_removed_opt_state_entry_takes_effect_as_in_adafactor(cuda_branches):
    """``opt.state`` as in the class: an entry removed restarts its parameter (fresh factors, step 1 next), a factor
    written into an entry is what the next step reads."""
    ours, theirs = _params(), _params()
    opt = offload(torch.optim.Adafactor, ours, placement="parked", bucket_numel=BUCKET)
    ref = torch.optim.Adafactor(theirs)
    for step in range(5):
        if step == 2:
            for o, ps in ((opt, ours), (ref, theirs)):
                del o.state[ps[1]]
                o.state[ps[3]]["col_var"] = torch.full((3, 1, 5), 0.25)
        _step_both(ours, opt, theirs, ref, step)
        _same(ours, opt, theirs, ref, f"step {step}")
    assert float(opt.state[ours[1]]["step"]) == 3 and float(opt.state[ours[0]]["step"]) == 5


@pytest.mark.parametrize("saved_at,loaded_at", [("parked", "resident"), ("resident", "parked")])
def test_adafactor_checkpoints_load_into_the_class_and_back_in_any_gpu_home(cuda_branches, saved_at, loaded_at):
    ours, theirs = _params(), _params()
    opt = offload(torch.optim.Adafactor, _groups(ours), placement=saved_at, bucket_numel=BUCKET)
    ref = torch.optim.Adafactor(_groups(theirs))
    for step in range(3):
        _step_both(ours, opt, theirs, ref, step)
    mine, want = _saved(opt), _saved(ref)
    # The same state dict as the class's: keys, shapes and values; the same param groups.
    assert mine["param_groups"] == want["param_groups"]
    assert mine["state"].keys() == want["state"].keys()
    for k, entry in want["state"].items():
        assert mine["state"][k].keys() == entry.keys(), k
        for key, value in entry.items():
            assert mine["state"][k][key].shape == value.shape and torch.equal(mine["state"][k][key], value), (k, key)
    # Ours into the class, and the class's into ours (in the other home): each goes on as the one it came from.
    loaded_params = _clone(ours)
    loaded = torch.optim.Adafactor(_groups(loaded_params))
    loaded.load_state_dict(mine)
    back_params = _clone(theirs)
    back = offload(torch.optim.Adafactor, _groups(back_params), placement=loaded_at, bucket_numel=BUCKET)
    back.load_state_dict(want)
    for step in range(3, 6):
        _step_both(ours, opt, loaded_params, loaded, step)
        _same(ours, opt, loaded_params, loaded, f"loaded into Adafactor, step {step}")
        _step_both(back_params, back, theirs, ref, step)
        _same(back_params, back, theirs, ref, f"loaded from Adafactor, step {step}")


def test_a_state_dict_of_the_wrong_factors_is_refused_leaving_the_state_as_it_was(cuda_branches):
    ours = _params()
    opt = offload(torch.optim.Adafactor, ours, placement="parked", bucket_numel=BUCKET)
    opt.zero_grad()
    _loss(ours, 0).backward()
    opt.step()
    good = _saved(opt)
    before = {k: {n: v.clone() for n, v in e.items()} for k, e in _saved(opt)["state"].items()}
    cases = [
        (lambda sd: sd["state"][1].__setitem__("row_var", torch.zeros(1, 7)),
         r"row_var has shape \(1, 7\), Adafactor keeps \(5, 1\)"),
        (lambda sd: sd["state"][1].pop("col_var"), r"lacks \['col_var'\]"),
        (lambda sd: sd["state"][0].__setitem__("row_var", torch.zeros(7)), r"has \['row_var'\], which Adafactor keeps "
         "for no parameter of 1 dimensions"),
    ]
    for edit, match in cases:
        sd = _saved(opt)
        edit(sd)
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)
        after = _saved(opt)["state"]
        assert all(torch.equal(after[k][n], v) for k, e in before.items() for n, v in e.items())
    opt.load_state_dict(good)


class _ListStateAdafactor(torch.optim.Adafactor):
    """Adafactor that also keeps a Python list per parameter."""

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p].setdefault("history", []).append(1.0)
        return out


class _ReshapingAdafactor(torch.optim.Adafactor):
    """Adafactor that keeps a tensor whose shape changes between steps: the parameter's mean over its first dimension
    after the first step, a copy of the whole parameter after the others (each shape alone one a bucket could hold)."""

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                first = "seen" not in self.state[p]
                self.state[p]["seen"] = p.mean(0, keepdim=True) if first else p.clone()
        return out


class _SharedAdafactor(torch.optim.Adafactor):
    """Adafactor that keeps a running sum of each parameter's gradients in one tensor shared by all of them (each
    parameter's entry a view of it)."""

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        params = [p for g in self.param_groups for p in g["params"]]
        if "total" not in self.state[params[0]]:
            shared = torch.zeros(sum(p.numel() for p in params))
            for p, piece in zip(params, shared.split([p.numel() for p in params])):
                self.state[p]["total"] = piece.view_as(p)
        for p in params:
            self.state[p]["total"].add_(p.grad)
        return out


class _FixedSizeAdafactor(torch.optim.Adafactor):
    """Adafactor that keeps, for a matrix, a (1, 6) tensor whatever the matrix's shape: on the probe's first (4, 6)
    stand-in it looks like a column factor; the second set of stand-ins shows it is not one."""

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                if p.dim() == 2:
                    self.state[p].setdefault("table", torch.zeros(1, 6))
        return out


@pytest.mark.parametrize("cls,match", [
    (_ListStateAdafactor, r"Nor can it be parked.*'history' of a parameter of shape .* as a list"),
    (_ReshapingAdafactor, r"Nor can it be parked.*state changes between steps.*'seen'"),
    (_SharedAdafactor, r"Nor can it be parked.*shares its state 'total'"),
    (_FixedSizeAdafactor, r"Nor can it be parked.*'table' has shape \(1, 6\) for a parameter of shape \(5, 3\)"),
])
def test_state_a_parked_bucket_cannot_hold_is_refused_naming_the_entry(cuda_branches, cls, match):
    ours = [torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(5, 6)),
            torch.nn.Parameter(torch.randn(6))]
    park_class.refused_then_free(cls, ours, match, torch.optim.Adafactor, bucket_numel=BUCKET)


@pytest.mark.parametrize("placement", ["host", {"parked": 0.5}, "auto"])
def test_adafactor_is_refused_where_a_bucket_would_be_stepped_on_the_host(cuda_branches, placement):
    park_class.refused_then_free(torch.optim.Adafactor, _params(), r"Adafactor.*placement=.parked. runs it",
                                 torch.optim.Adafactor, placement, BUCKET)


def test_adafactor_parked_with_its_buckets_sharded_is_refused(cuda_branches):
    """Over a process_group (here: the group laid out as rank 0 of 2 would lay it out), or under FSDP2 (laid out over
    shards), a bucket holds a rank's pieces of parameters, which Adafactor's own code would step as if whole."""
    from zero_offload.buckets import Placement, allocate_group

    ours = _params()
    opt = offload(torch.optim.Adafactor, ours, placement="parked", bucket_numel=BUCKET)
    group = {**opt.param_groups[0], "params": _clone(ours)}
    with pytest.raises(ValueError, match=r"Adafactor.*with a process_group .* pieces of its parameters"):
        allocate_group(group, 0, opt.options, Placement(cut=(2, 0)), opt._rule)
    # FSDP2: the bucket holds each rank's shard of a parameter (here its first row), not the parameter.
    shards = [p.detach()[:1].clone() for p in group["params"]]
    with pytest.raises(ValueError, match=r"Adafactor.*with FSDP2 .* pieces of its parameters"):
        allocate_group(group, 0, opt.options, Placement(data=shards, units=[0] * len(shards)), opt._rule)


@pytest.mark.cuda  # (in the lease plan's `pytest -m cuda`; skipped without a GPU, tests/conftest.py)
@pytest.mark.parametrize("placement", ["parked", "resident"])
def test_adafactor_on_a_real_gpu_is_bitwise_adafactor_on_the_gpu(placement):
    ours = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    theirs = _clone(ours)
    opt = offload(torch.optim.Adafactor, _groups(ours), placement=placement, bucket_numel=BUCKET)
    ref = torch.optim.Adafactor(_groups(theirs))
    assert set(_homes(opt)) == {placement}
    for step in range(4):
        _step_both(ours, opt, theirs, ref, step)
        torch.cuda.synchronize()
        _same(ours, opt, theirs, ref, f"step {step}")

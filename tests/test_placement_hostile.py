"""A hostile user of the placement options (``placement``, ``gpu_fraction``, ``gpu_margin_gib``), the plan before
building (``OffloadOptimizer.estimate_host_memory(params, ...)``) and the planner's ``--placement``: each bad value
is refused with a ValueError (an argparse error for the planner) that names it, the model as it was; never a
traceback from deep inside, never a number for a setting the constructor would refuse.

What was tried and already behaved is listed in the report of the hostile pass; these tests are its findings.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuda_standins
from test_optimizer import TinyTransformer, loss_fn, param_groups
from test_twin_flow import BUCKET, check_refused
from zero_offload import OffloadOptimizer, offload
from zero_offload.report import main


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch, needs_fused=False)


# -- gpu_margin_gib -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("margin", [1e300, float(2**1023), 10**400])
@pytest.mark.parametrize("placement", [dict(placement="parked"), dict(placement="auto"), dict(gpu_fraction="auto"),
                                       dict()])
def test_a_margin_too_large_to_count_in_bytes_is_refused(margin, placement):
    """1e300 GiB is finite, but not as bytes (the room checks count bytes): it was an OverflowError from the
    transport's set-up, for every placement."""
    check_refused(dict(gpu_margin_gib=margin, **placement), r"Invalid gpu_margin_gib: .*finite")


def test_a_margin_large_but_countable_still_builds():
    """The line is where the bytes overflow a float, not lower: a margin no GPU has (1e12 GiB) is a valid way to
    say "never bring anything up in backward"."""
    opt = OffloadOptimizer(param_groups(TinyTransformer()), bucket_numel=BUCKET, placement="parked",
                           gpu_margin_gib=1e12)
    assert opt.options.gpu_margin_gib == 1e12


# -- placement and gpu_fraction that only compare equal to a valid value ------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(placement=np.array(["parked"])), "Invalid placement"),
    (dict(placement=np.array(["auto"])), "Invalid placement"),
    (dict(gpu_fraction=np.array(["auto"])), "Invalid gpu_fraction"),
])
def test_a_one_element_array_is_not_a_home(kw, match):
    """A 1-element array compares equal to the string it holds, so the check passed it and the optimizer failed
    later (``TypeError: unhashable type``) or took it as the string."""
    check_refused(kw, match)


# -- the plan before building ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(bucket_numel=0), "Invalid bucket_numel: 0"),
    (dict(bucket_numel=-5, placement="parked"), "Invalid bucket_numel: -5"),
    (dict(bucket_numel=2.5), "Invalid bucket_numel: 2.5"),
    (dict(placement="parked", delayed_update=True), "placement='parked' and delayed_update=True are not combined"),
    (dict(placement={"parked": 0.5}, delayed_update=2), "are not combined"),
    (dict(delayed_update=-1), "Invalid delayed_update"),
])
def test_the_plan_before_building_refuses_what_the_constructor_refuses(kw, match):
    """The plan checked ``state_dtype`` and the GPU options alone: a bucket_numel of 0 or -5 gave a plan (one
    bucket per parameter), and so did a GPU placement with ``delayed_update``, both of which the constructor
    refuses. Both now raise the constructor's very error."""
    model = TinyTransformer()
    with pytest.raises(ValueError, match=match):
        OffloadOptimizer(param_groups(model), **kw)
    with pytest.raises(ValueError, match=match):
        OffloadOptimizer.estimate_host_memory(param_groups(model), **kw)


@pytest.mark.parametrize("world_size", [0, -2, 2.5, True, "2"])
def test_the_plan_refuses_a_world_size_that_is_not_a_number_of_ranks(world_size):
    """0 was a ZeroDivisionError, -2 a negative number of bytes, 2.5 bytes in halves."""
    with pytest.raises(ValueError, match=f"Invalid world_size: {world_size!r}"):
        OffloadOptimizer.estimate_host_memory(param_groups(TinyTransformer()), world_size=world_size)


def test_the_plan_refuses_delayed_update_with_a_process_group():
    """The constructor refuses ``delayed_update`` with a ``process_group``: so does the plan for ``world_size`` > 1
    (it gave a number); with one rank it plans as before."""
    params = param_groups(TinyTransformer())
    with pytest.raises(ValueError, match="delayed_update are not yet combined with a process_group"):
        OffloadOptimizer.estimate_host_memory(params, world_size=2, delayed_update=True)
    alone = OffloadOptimizer.estimate_host_memory(params, delayed_update=True)
    assert alone.total_bytes == OffloadOptimizer(params, delayed_update=True).estimate_host_memory().total_bytes


# -- the planner ----------------------------------------------------------------------------------------------------
def test_the_planner_refuses_a_home_given_twice(capsys):
    """``--placement resident=0.5,resident=0.3`` planned resident=0.3 without a word (the dict kept the last)."""
    with pytest.raises(SystemExit) as exc:
        main(["--params", "7B", "--placement", "resident=0.5,resident=0.3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --placement: Invalid placement: 'resident=0.5,resident=0.3' (the share of 'resident' given " \
           "twice)" in err, err


# -- nonfinite="raise" in a class's parked bucket -------------------------------------------------------------------
def test_a_nonfinite_gradient_in_a_parked_muon_bucket_names_muon_and_changes_nothing(cuda_branches):
    """The error told the user to pass ``nonfinite='ignore'`` "to apply them as torch.optim.AdamW would" for any
    class: it names the class now. Nothing changed (parameters, state), the state brought up for the step is let
    go, and the next steps are torch's Muon's, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((5, 7), (30, 30), (40, 40))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = offload(torch.optim.Muon, params, lr=0.02, placement="parked", bucket_numel=1024, nonfinite="raise")
    ref = torch.optim.Muon(twins, lr=0.02)

    def step(o, ps, s, inf=False):
        o.zero_grad()
        sum((torch.tanh(p) * (s + 1)).sum() ** 2 for p in ps).backward()
        if inf:
            ps[2].grad[0, 0] = float("inf")
        o.step()

    def same():
        for p, q in zip(params, twins):
            assert torch.equal(p, q)
            assert opt.state[p].keys() == ref.state[q].keys()
            for k, v in ref.state[q].items():
                assert torch.equal(opt.state[p][k], v), k

    for s in range(2):
        step(opt, params, s)
        step(ref, twins, s)
        same()
    with pytest.raises(RuntimeError, match=r"parameter 2 of shape \(40, 40\).*as torch\.optim\.Muon would"):
        step(opt, params, 2, inf=True)  # (the reference never sees this step)
    same()
    assert all(b.home.twins is None for g in opt._buckets for b in g), "the state brought up was kept"
    for s in range(2, 4):
        step(opt, params, s)
        step(ref, twins, s)
        same()


def test_adamws_nonfinite_error_still_names_adamw(cuda_branches):
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement="parked", nonfinite="raise")
    next(model.parameters()).grad = torch.full_like(next(model.parameters()), float("nan"))
    with pytest.raises(RuntimeError, match=r"as torch\.optim\.AdamW would"):
        opt.step()


# -- an offload option inside a param group -------------------------------------------------------------------------
@pytest.mark.parametrize("key,value", [("placement", "parked"), ("gpu_fraction", 1.0), ("bucket_numel", 8),
                                       ("nonfinite", "raise")])
def test_an_offload_option_in_a_param_group_is_refused_not_ignored(cuda_branches, key, value):
    """``[{"params": embeddings, "placement": "parked"}, ...]`` built every bucket on the host without a word (torch
    keeps unknown group keys; every group takes the constructor's options). Refused now, naming the key, at
    construction (the model as it was), in ``add_param_group`` and in a loaded state dict's group (the optimizer as
    it was: its groups, its homes, its state), for AdamW and for a wrapped class."""
    model = TinyTransformer()
    before = [p.detach().clone() for p in model.parameters()]
    groups = param_groups(model)
    groups[0][key] = value
    with pytest.raises(ValueError, match=f"{key}={value!r} in a param group: {key} is an option of the whole"):
        OffloadOptimizer(groups, bucket_numel=BUCKET, placement="parked")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))

    for make in (lambda ps: OffloadOptimizer(ps, bucket_numel=BUCKET, placement="parked"),
                 lambda ps: offload(torch.optim.SGD, ps, lr=0.1, momentum=0.9, bucket_numel=BUCKET,
                                    placement="parked")):
        torch.manual_seed(0)
        model, extra = TinyTransformer(), torch.nn.Linear(16, 4)
        opt = make(param_groups(model))
        opt.zero_grad()
        loss_fn(model, 0, 0, "cpu").backward()
        opt.step()
        homes = [[b.home.kind for b in g] for g in opt._buckets]
        state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
        with pytest.raises(ValueError, match=f"{key}={value!r} in a param group"):
            opt.add_param_group({"params": list(extra.parameters()), key: value})
        sd = opt.state_dict()
        sd["param_groups"][1][key] = value
        with pytest.raises(ValueError, match=f"param group 1: {key}={value!r} in a param group"):
            opt.load_state_dict(sd)
        assert len(opt.param_groups) == 2 and [[b.home.kind for b in g] for g in opt._buckets] == homes
        assert all(key not in g for g in opt.param_groups)
        assert {id(p) for p in opt.state} == set(state)
        for p, s in opt.state.items():
            for k, v in s.items():
                assert torch.equal(v, state[id(p)][k]), k

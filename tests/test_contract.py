"""The ``torch.optim`` contract beyond the update itself (issue 15): what users do to ``param_groups`` and
``opt.state`` between steps, compared step by step with ``torch.optim.AdamW(foreach=False)`` where AdamW defines
the behaviour, and refused with an error that says what to do where this optimizer cannot follow.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
import torch
import torch.nn as nn

from zero_offload import OffloadOptimizer

SIZES = (1, 7, 17, 4097)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _params(device="cpu"):
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(n).to(device)) for n in SIZES]


def _pair(device="cpu", **kw):
    """Our optimizer (parameters on ``device``) and AdamW (on the CPU) over equal copies of the same parameters."""
    ours_p, ref_p = _params(device), _params()
    return ours_p, OffloadOptimizer(ours_p, lr=0.01, **kw), ref_p, torch.optim.AdamW(ref_p, lr=0.01,
                                                                                   **{"foreach": False, **kw})


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype).to(p.device)


def _assert_same(ours_p, ours, ref_p, ref, what):
    for k, (p, q) in enumerate(zip(ours_p, ref_p)):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), msg=lambda m: f"{what}: param {k}: {m}")
        assert (p in ours.state) == (q in ref.state), f"{what}: param {k} has state in one optimizer only"
        for key, value in ref.state.get(q, {}).items():
            torch.testing.assert_close(ours.state[p][key].cpu(), value,
                                       msg=lambda m: f"{what}: param {k} {key}: {m}")


def _steps(ours_p, ours, ref_p, ref, steps, first=0):
    for step in range(first, first + steps):
        _grads(ours_p, step)
        _grads(ref_p, step)
        ours.step()
        ref.step()
        _assert_same(ours_p, ours, ref_p, ref, f"step {step}")


# ---------------------------------------------------------------------------------------------- defect 1 --
@pytest.mark.parametrize("edit", ["replace", "append", "setitem", "param_groups_append"])
def test_editing_a_groups_params_is_refused_at_step_and_changes_nothing(edit):
    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    opt = OffloadOptimizer([a], lr=0.1)
    if edit == "replace":
        opt.param_groups[0]["params"] = [b]
    elif edit == "append":
        opt.param_groups[0]["params"].append(b)
    elif edit == "setitem":
        opt.param_groups[0]["params"][0] = b
    else:
        opt.param_groups.append(dict(opt.param_groups[0], params=[b]))
    a.grad, b.grad = torch.ones(4), torch.ones(4)
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.step()
    assert torch.equal(a.detach(), torch.ones(4)) and torch.equal(b.detach(), torch.ones(4))  # nothing trained
    assert not opt.state
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.state_dict()


def test_restoring_or_copying_a_groups_params_goes_on_as_adamw():
    ours_p, ours, ref_p, ref = _pair()
    _steps(ours_p, ours, ref_p, ref, 2)
    ours.param_groups[0]["params"] = list(ours.param_groups[0]["params"])  # the same parameters: accepted
    _steps(ours_p, ours, ref_p, ref, 1, first=2)
    extra = nn.Parameter(torch.ones(3))
    ours.param_groups[0]["params"].append(extra)
    with pytest.raises(RuntimeError, match="edited"):
        ours.step()
    ours.param_groups[0]["params"].pop()  # restored: goes on where it was
    _steps(ours_p, ours, ref_p, ref, 2, first=3)


def test_an_added_group_is_not_an_edit():
    ours_p, ours, ref_p, ref = _pair()
    _steps(ours_p, ours, ref_p, ref, 1)
    for params, opt in ((ours_p, ours), (ref_p, ref)):
        params.append(nn.Parameter(torch.full((5,), 0.5)))
        opt.add_param_group({"params": [params[-1]], "lr": 0.02})
    _steps(ours_p, ours, ref_p, ref, 2, first=1)


# ---------------------------------------------------------------------------------------------- defect 2 --
def _reset(opt, params, how):
    p = params[1]
    if how == "clear":
        opt.state.clear()
    elif how == "del":
        del opt.state[p]
    elif how == "empty":
        opt.state[p] = {}
    elif how == "new_state":
        opt.state = defaultdict(dict)
    elif how == "pop":
        opt.state.pop(p)
    elif how == "update":
        opt.state[p].update(exp_avg=torch.full_like(p, 0.25), step=torch.tensor(7.0))
    elif how == "assign":
        opt.state[p]["exp_avg_sq"] = torch.full_like(p, 2.0)
    elif how == "assign_step":
        opt.state[p]["step"] = torch.tensor(1.0)
    elif how == "zero_in_place":
        opt.state[p]["exp_avg"].zero_()


@pytest.mark.parametrize("how", ["clear", "del", "empty", "new_state", "pop", "update", "assign", "assign_step",
                                 "zero_in_place"])
@pytest.mark.parametrize("kw", [{}, dict(amsgrad=True)], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("device", DEVICES)
def test_resetting_or_editing_state_does_what_it_does_for_adamw(how, kw, device):
    ours_p, ours, ref_p, ref = _pair(device, **kw)
    _steps(ours_p, ours, ref_p, ref, 3)
    _reset(ours, ours_p, how)
    _reset(ref, ref_p, how)
    _steps(ours_p, ours, ref_p, ref, 3, first=3)
    if how in ("clear", "new_state"):
        assert ours.state[ours_p[0]]["step"].item() == 3.0  # restarted at 1
    # and the saved state is the edited one, in AdamW's format
    sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert all(type(v) is dict for v in sd["state"].values())
    for k, entry in ref_sd["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(sd["state"][k][key], value)


@pytest.mark.parametrize("kw", [{}, dict(delayed_update=True),
                                dict(stream_grads=True, overlap_step=True, nonfinite="ignore")],
                         ids=["default", "delayed_update", "overlap_step"])
def test_state_clear_restarts_every_mode(kw):
    """The recipe for resetting Adam, in each schedule: the pending update (delayed) belongs to the state before
    the reset; an update run during backward (overlap) sees the reset."""
    torch.manual_seed(0)
    model = nn.Linear(7, 5)
    ref_model = copy.deepcopy(model)
    ours = OffloadOptimizer(model.parameters(), lr=0.01, **kw)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.01, foreach=False)
    x = torch.randn(4, 7)
    for step in range(6):
        for m, o in ((model, ours), (ref_model, ref)):
            o.zero_grad()
            (m(x) * (step + 1)).square().sum().backward()
            o.step()
            if step == 2:
                o.state.clear()
    ours.flush()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert ours.state[p]["step"].item() == ref.state[q]["step"].item() == 3.0
        if not kw.get("delayed_update"):  # whose forward sees parameters one step stale: not AdamW's trajectory
            torch.testing.assert_close(p, q)
            torch.testing.assert_close(ours.state[p]["exp_avg"], ref.state[q]["exp_avg"])


def test_low_precision_state_reset_takes_the_master_from_the_parameter():
    p = nn.Parameter(torch.randn(17, dtype=torch.bfloat16))
    opt = OffloadOptimizer([p], lr=0.01)
    for _ in range(2):
        p.grad = torch.ones_like(p)
        opt.step()
    opt.state.clear()
    with torch.no_grad():
        p.fill_(0.5)  # a master restarted from the parameter, not from the old fp32 value
    p.grad = torch.zeros_like(p)
    opt.step()
    assert opt.state[p]["step"].item() == 1.0
    torch.testing.assert_close(opt.state[p]["master"], torch.full((17,), 0.5 * (1 - 0.01 * 0.01)))


@pytest.mark.parametrize("bad, match", [(dict(exp_avg=torch.zeros(3)), "shape"), (dict(step=torch.tensor(-1.0)),
                                                                                      "invalid step"),
                                        (dict(master=torch.zeros(7)), "keys")])
def test_a_bad_state_edit_raises_at_step_and_changes_nothing(bad, match):
    ours_p, ours, ref_p, ref = _pair()
    _steps(ours_p, ours, ref_p, ref, 2)
    before = {k: v.clone() for k, v in ours.state[ours_p[1]].items()}
    params = [p.detach().clone() for p in ours_p]
    ours.state[ours_p[1]].update(bad)
    _grads(ours_p, 2)
    with pytest.raises(ValueError, match=match):
        ours.step()
    assert all(torch.equal(p, q) for p, q in zip(ours_p, params))
    for k, v in before.items():
        if k not in bad:
            assert torch.equal(ours.state[ours_p[1]][k], v)


def test_state_edits_are_noticed_without_a_per_parameter_check():
    """The per-step check is one flag read: untouched state costs nothing per parameter."""
    ours_p, ours, _, _ = _pair()
    _grads(ours_p, 0)
    ours.step()
    assert type(ours.state).__name__ == "StateMap" and not ours.state.flag.changed
    _ = ours.state[ours_p[0]]["exp_avg"]  # reading is not an edit
    assert not ours.state.flag.changed
    ours.state[ours_p[0]]["exp_avg"] = ours.state[ours_p[0]]["exp_avg"]
    assert ours.state.flag.changed


# ------------------------------------------------------------------------------- refusals at the front door --
@pytest.mark.parametrize("kw", [dict(lr=torch.tensor(0.01), foreach=True),
                                dict(betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True),
                                dict(fused=True, foreach=True), dict(fused=True, differentiable=True),
                                dict(differentiable=True)],
                         ids=["tensor_lr_foreach", "tensor_betas_foreach", "fused_foreach", "fused_differentiable",
                              "differentiable"])
def test_flag_combinations_adamw_refuses_raise_its_errors(kw):
    p = nn.Parameter(torch.randn(3))
    if kw != dict(differentiable=True):
        with pytest.raises(Exception) as expected:
            torch.optim.AdamW([p], **kw)
    else:  # AdamW accepts the flag, then fails at step() on a leaf that requires grad
        ref = torch.optim.AdamW([p], **kw)
        p.grad = torch.ones(3)
        with pytest.raises(Exception) as expected:
            ref.step()
    with pytest.raises(type(expected.value)) as got:
        OffloadOptimizer([nn.Parameter(torch.randn(3))], **kw)
    if kw != dict(differentiable=True):
        assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("drop", ["maximize", "amsgrad", "foreach"])
def test_loading_an_older_state_dict_sets_missing_flags_as_adamw(drop):
    ours_p, ours, ref_p, ref = _pair(maximize=True, amsgrad=True, foreach=False)
    _steps(ours_p, ours, ref_p, ref, 2)
    for opt in (ours, ref):
        sd = opt.state_dict()
        for group in sd["param_groups"]:
            del group[drop]
        opt.load_state_dict(sd)
    assert ours.param_groups[0][drop] == ref.param_groups[0][drop]
    _steps(ours_p, ours, ref_p, ref, 2, first=2)


@pytest.mark.parametrize("case, match", [("float64", "float64"), ("meta", "meta device"), ("duplicate", "twice")])
def test_refused_parameters_say_why_and_what_to_do(case, match):
    p = nn.Parameter(torch.randn(3, dtype=torch.float64 if case == "float64" else torch.float32,
                                 device="meta" if case == "meta" else "cpu"))
    with pytest.raises(ValueError, match=match):
        OffloadOptimizer([p, p] if case == "duplicate" else [p])

"""A hostile user's pass on the drop-in promise: ``torch.optim.AdamW(...)`` swapped for ``OffloadOptimizer(...)``
with the same arguments and nothing else changed. What was tried and already behaved (constructor arguments and
their edge values, schedulers, param-group edits, state inspection and state dicts both ways, hooks, closures,
GradScaler, clipping, odd parameters...) is listed in the pass's report; these tests are its findings, each against
``torch.optim.AdamW(foreach=False)`` every step (parameters and state, default fp32 tolerance), or a refusal that
names the problem and changes nothing.

GPU parameters are the stand-ins of tests/cuda_standins.py (the buckets are told their parameters are on ``cuda:0``;
streams and events order nothing), so the host route of a GPU bucket (a separate fp32 master on the host, copied
into the parameter after each update) runs its Python for real on a CPU-only machine.
"""

from __future__ import annotations

import copy

import pytest
import torch

import cuda_standins
from test_optimizer import TinyTransformer, assert_same, assert_unchanged, loss_fn, param_groups, snapshot
from zero_offload import OffloadOptimizer

STEPS = 5
REPLACE_AT = 2


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch, needs_fused=False)


# -- a GPU parameter whose data is replaced --------------------------------------------------------------------------
def _halve_by_data(model):
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data * 0.5


def _halve_by_vector(model):
    """``torch.nn.utils.vector_to_parameters`` assigns each parameter's ``.data`` (a model averaged, perturbed or
    restored from a flat vector: SAM, evolution strategies, model soups)."""
    vec = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.nn.utils.vector_to_parameters(vec * 0.5, model.parameters())


def _options(request, placement):
    """The optimizer's keywords for ``placement`` ("cpu": a CPU model; else that placement on the CUDA stand-ins)."""
    if placement == "cpu":
        return {}
    request.getfixturevalue("cuda_branches")
    return dict(placement=placement, bucket_numel=1000)


def _pair(request, placement, **hyper):
    """A TinyTransformer and its copy, ours over one and AdamW (foreach=False) over the other, with ``hyper``."""
    kw = _options(request, placement)
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    ours = OffloadOptimizer(param_groups(model), **hyper, **kw)
    ref = torch.optim.AdamW(param_groups(ref_model), **hyper, foreach=False)
    return model, ref_model, ours, ref, kw


def _replace_beside_adamw(make, placement, replace, device):
    """Ours (``placement``, some bucket a GPU one stepped on the host) and AdamW over ``make()`` and its copy, both
    models' data replaced by ``replace`` after backward at step ``REPLACE_AT``: equal every step."""
    torch.manual_seed(0)
    model = make()
    ref_model = copy.deepcopy(model)
    ours = OffloadOptimizer(param_groups(model), placement=placement, bucket_numel=1000)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    assert any(b.home.kind == "host" and not b.on_cpu for g in ours._buckets for b in g)
    for step in range(STEPS):
        for m, opt in ((model, ours), (ref_model, ref)):
            opt.zero_grad()
            loss_fn(m, step, 0, device).backward()
            if step == REPLACE_AT:
                replace(m)
            opt.step()
        assert_same(model, ref_model, ours, ref, f"step {step}")


@pytest.mark.parametrize("replace", [_halve_by_data, _halve_by_vector], ids=["p.data=", "vector_to_parameters"])
@pytest.mark.parametrize("placement", ["host", {"resident": 0.3, "parked": 0.4}], ids=["host", "mix"])
def test_replaced_data_of_a_gpu_parameter_trains_on_as_adamw(cuda_branches, replace, placement):
    """AdamW follows the ``Parameter``: whatever its data was replaced with is what the next step starts from. A GPU
    parameter stepped on the host (a separate fp32 master there) kept training from the old master, writing over
    the replacement without a word (replacement moves no version counter; CPU parameters were followed)."""
    _replace_beside_adamw(TinyTransformer, placement, replace, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("replace", [_halve_by_data, _halve_by_vector], ids=["p.data=", "vector_to_parameters"])
def test_replaced_data_of_a_parameter_on_a_real_gpu_trains_on_as_adamw(replace):
    """The same on a GPU: a host-stepped bucket's master, copies on the side streams (skipped without one)."""
    _replace_beside_adamw(lambda: TinyTransformer().cuda(), "host", replace, "cuda")


def _two_steps_then_backward(**kw):
    """Ours (``kw``) over a TinyTransformer, two steps taken and the third's backward run: the model, the optimizer
    and a snapshot of both before that backward."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model), **kw)
    for step in range(2):
        opt.zero_grad()
        loss_fn(model, step, 0, "cpu").backward()
        opt.step()
    before = snapshot(model, opt)
    opt.zero_grad()
    loss_fn(model, 2, 0, "cpu").backward()
    return model, opt, before


def test_a_gpu_parameter_replaced_by_another_shape_is_refused_naming_it(cuda_branches):
    model, opt, before = _two_steps_then_backward(placement="host", bucket_numel=1000)
    model.tok.weight.data = torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"data was moved, cast or reshaped .* it was \(31, 16\) torch.float32 "
                                           r"on cuda:0 \(stand-in\), it is now \(3,\) torch.float32 on cpu"):
        opt.step()
    now = opt.state_dict()
    for k, entry in before[1]["state"].items():
        for key, value in entry.items():
            assert torch.equal(now["state"][k][key], value), (k, key)


@pytest.mark.parametrize("how", ["view", "slice"])
@pytest.mark.parametrize("placement", ["cpu", "host", "parked"])
def test_a_parameter_reshaped_over_its_own_storage_is_refused_naming_it(request, placement, how):
    """``p.data = p.data[:3]`` or ``p.data = p.data.view(-1)`` changes the parameter's shape but not where its data
    is, so watching the data's address alone missed it: a GPU parameter stepped on the host ran its update and then
    failed in the upload with torch's bare size mismatch (the state already stepped); one bound to its slot (CPU,
    parked) was stepped as if nothing had happened. AdamW refuses such a parameter (its moments keep the old shape):
    refused at the next step, naming both shapes, nothing changed."""
    model, opt, before = _two_steps_then_backward(**_options(request, placement))
    w = model.tok.weight
    kept = w.data
    w.data = w.data[:3] if how == "slice" else w.data.view(-1)
    now = r"\(3, 16\)" if how == "slice" else r"\(496,\)"
    with pytest.raises(RuntimeError, match=rf"data was moved, cast or reshaped .* it was \(31, 16\) torch.float32 "
                                           rf"on .*, it is now {now} torch.float32 on .* \(a parameter of shape "
                                           r"\(31, 16\)"):
        opt.step()
    w.data = kept
    assert_unchanged(before, model, opt)


# -- a wrapper's own keys in a parameter's state entry ---------------------------------------------------------------
class SlowWeights:
    """A Lookahead-style wrapper as timm's ``Lookahead`` is written: after every ``k``-th step of its base optimizer
    it pulls each parameter towards slow weights kept in the base optimizer's own state entry
    (``base.state[p]["lookahead_slow_buff"]``), so they travel with the base's ``state_dict()``."""

    def __init__(self, base, alpha=0.5, k=2):
        self.base, self.alpha, self.k, self.steps = base, alpha, k, 0

    @torch.no_grad()
    def step(self):
        self.base.step()
        self.steps += 1
        if self.steps % self.k:
            return
        for group in self.base.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                entry = self.base.state[p]
                if "lookahead_slow_buff" not in entry:
                    entry["lookahead_slow_buff"] = p.detach().clone()
                slow = entry["lookahead_slow_buff"]
                slow.add_(p - slow, alpha=self.alpha)
                p.copy_(slow)


def _assert_same_with_slow(model, ref_model, ours, ref, where):
    for p, q in zip(model.parameters(), ref_model.parameters()):
        slow, got = ref.state.get(q, {}).get("lookahead_slow_buff"), ours.state.get(p, {})
        assert (slow is None) == ("lookahead_slow_buff" not in got), (where, sorted(got))
        if slow is not None:
            torch.testing.assert_close(got["lookahead_slow_buff"], slow, msg=lambda m: f"{where}: {m}")
    assert_same(model, ref_model, ours, ref, where)


def _slow_run(model, opt, steps, start=0, wrapper=None):
    wrapper = wrapper or SlowWeights(opt)
    for step in range(start, start + steps):
        opt.zero_grad()
        loss_fn(model, step, 0, "cpu").backward()
        wrapper.step()
    return wrapper


@pytest.mark.parametrize("placement", ["cpu", "host", "parked", "auto"])
def test_a_wrappers_keys_in_the_state_entries_are_kept_as_adamw_keeps_them(request, placement):
    """A key that is none of AdamW's in ``opt.state[p]`` (a wrapper's: timm's Lookahead keeps its slow weights
    there) stays there, and ``state_dict()`` and ``load_state_dict()`` carry it, both ways with AdamW. It made the
    next ``step()`` raise ValueError (an entry with an unknown key), and a loaded state dict with one was refused as
    another optimizer's. On the CUDA stand-ins too: ``"auto"`` moves buckets to a GPU home after its second step,
    and the entries it shows then keep the key."""
    model, ref_model, ours, ref, kw = _pair(request, placement)
    wrappers = [SlowWeights(ours), SlowWeights(ref)]
    for step in range(STEPS):
        _slow_run(model, ours, 1, step, wrappers[0])
        _slow_run(ref_model, ref, 1, step, wrappers[1])
        _assert_same_with_slow(model, ref_model, ours, ref, f"step {step}")
    if placement == "auto":  # (moved after the second step: the entries shown since then are new ones)
        assert any(b.home.kind != "host" for g in ours._buckets for b in g)
    # Both ways through a state dict: ours into AdamW, AdamW's into ours; each resumes as the other.
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert ours_sd["state"].keys() == ref_sd["state"].keys()
    for k, entry in ref_sd["state"].items():
        assert ours_sd["state"][k].keys() == entry.keys(), k
        torch.testing.assert_close(ours_sd["state"][k]["lookahead_slow_buff"], entry["lookahead_slow_buff"])
    into_ref_model, into_ours_model = copy.deepcopy(model), copy.deepcopy(ref_model)
    into_ref = torch.optim.AdamW(param_groups(into_ref_model), foreach=False)
    into_ref.load_state_dict(copy.deepcopy(ours_sd))
    into_ours = OffloadOptimizer(param_groups(into_ours_model), **kw)
    into_ours.load_state_dict(copy.deepcopy(ref_sd))
    _assert_same_with_slow(into_ours_model, ref_model, into_ours, ref, "loaded")
    for opt, m in ((ref, ref_model), (into_ref, into_ref_model), (into_ours, into_ours_model)):
        _slow_run(m, opt, 3, STEPS)
    _assert_same_with_slow(into_ours_model, ref_model, into_ours, ref, "resumed in ours")
    _assert_same_with_slow(into_ref_model, ref_model, into_ref, ref, "resumed in AdamW")


def test_a_loaded_entry_of_another_optimizer_is_still_refused():
    """The keys of another optimizer's state (SGD's ``momentum_buffer``, no ``step``): refused at load, naming
    them, as before; foreign keys are kept only beside a whole AdamW entry."""
    torch.manual_seed(0)
    model = TinyTransformer()
    sgd = torch.optim.SGD(param_groups(model), lr=0.1, momentum=0.9)
    opt = OffloadOptimizer(param_groups(copy.deepcopy(model)))
    loss_fn(model, 0, 0, "cpu").backward()
    sgd.step()
    sd = sgd.state_dict()
    sd["param_groups"] = opt.state_dict()["param_groups"]
    with pytest.raises(ValueError, match=r"has keys \['momentum_buffer'\] that are not Adam\(W\) state .* another "
                                         r"optimizer\?"):
        opt.load_state_dict(sd)
    assert not opt.state


# -- a typo of one of our keys is not a wrapper's key ----------------------------------------------------------------
TYPOS = ["exp_avgs", "Exp_avg", "exp_avg_sqr", "steps"]


@pytest.mark.parametrize("typo", TYPOS)
def test_a_typo_of_a_state_key_put_into_an_entry_is_refused_naming_it(typo):
    """Keys beside AdamW's are kept as a wrapper's own, but one that reads as a misspelling of a key of the rule
    (``opt.state[p]["exp_avgs"] = ...`` meant for ``exp_avg``) is refused at the next step, naming it and the key it
    resembles, the state left as it was. It was kept without a word (the edit it stood for never happening)."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model))
    loss_fn(model, 0, 0, "cpu").backward()
    opt.step()
    before = snapshot(model, opt)
    p = model.tok.weight
    opt.state[p][typo] = torch.zeros_like(p)
    opt.zero_grad()
    loss_fn(model, 1, 0, "cpu").backward()
    with pytest.raises(ValueError, match=rf"{typo!r}.*did you mean '(exp_avg|exp_avg_sq|step)'"):
        opt.step()
    del opt.state[p][typo]
    assert_unchanged(before, model, opt)


@pytest.mark.parametrize("typo", TYPOS)
@pytest.mark.parametrize("with_wrappers", [False, True], ids=["alone", "beside-a-wrappers-key"])
def test_a_loaded_entry_with_a_typo_of_a_state_key_is_refused_naming_it(typo, with_wrappers):
    """The same at load: an AdamW state dict whose entry holds a misspelt key beside its whole state (alone, or
    beside a wrapper's genuine key) is refused naming the key, nothing loaded. It was loaded, the key kept."""
    torch.manual_seed(0)
    model = TinyTransformer()
    ref = torch.optim.AdamW(param_groups(model), foreach=False)
    loss_fn(model, 0, 0, "cpu").backward()
    ref.step()
    sd = copy.deepcopy(ref.state_dict())
    sd["state"][0][typo] = torch.zeros_like(sd["state"][0]["exp_avg"])
    if with_wrappers:
        sd["state"][0]["lookahead_slow_buff"] = torch.ones_like(sd["state"][0]["exp_avg"])
    opt = OffloadOptimizer(param_groups(copy.deepcopy(model)))
    with pytest.raises(ValueError, match=rf"parameter id 0 .*{typo!r}.*did you mean '(exp_avg|exp_avg_sq|step)'"):
        opt.load_state_dict(sd)
    assert not opt.state


def test_a_wrappers_key_beside_whole_state_still_loads_and_is_kept():
    """The rule that refuses typos keeps what is plainly a wrapper's: Lookahead's slow weights, a non-tensor value,
    a key that is not a string, each beside a whole AdamW entry, loaded as AdamW loads them (no string value:
    torch's loader rebuilds an iterable value item by item, which turns a str into the text of a generator)."""
    torch.manual_seed(0)
    model = TinyTransformer()
    ref = torch.optim.AdamW(param_groups(model), foreach=False)
    loss_fn(model, 0, 0, "cpu").backward()
    ref.step()
    sd = ref.state_dict()
    extra = {"lookahead_slow_buff": torch.ones_like(sd["state"][0]["exp_avg"]), "ema_decay": 0.99, 7: 3}
    sd["state"][0].update(extra)
    ours = OffloadOptimizer(param_groups(copy.deepcopy(model)))
    ours.load_state_dict(copy.deepcopy(sd))
    ref.load_state_dict(copy.deepcopy(sd))
    p, q = next(iter(ours.state)), next(iter(ref.state))
    assert set(ours.state[p]) == set(ref.state[q])
    for k in extra:
        if isinstance(extra[k], torch.Tensor):
            torch.testing.assert_close(ours.state[p][k], ref.state[q][k])
        else:
            assert ours.state[p][k] == ref.state[q][k]


@pytest.mark.parametrize("entry", [[1, 2], None, torch.zeros(3)], ids=["list", "None", "tensor"])
def test_a_loaded_entry_that_is_not_a_dict_is_refused_naming_it(entry):
    """A parameter's loaded entry that is no dict is refused as before the wrappers' keys came in, naming it
    (``... is a list, not a dict``), nothing loaded. Reading its wrapper's keys first made it an AttributeError."""
    torch.manual_seed(0)
    model = TinyTransformer()
    ref = torch.optim.AdamW(param_groups(model), foreach=False)
    loss_fn(model, 0, 0, "cpu").backward()
    ref.step()
    sd = ref.state_dict()
    sd["state"][0] = entry
    opt = OffloadOptimizer(param_groups(copy.deepcopy(model)))
    with pytest.raises(ValueError, match=rf"parameter id 0 .* is a {type(entry).__name__}, not a dict"):
        opt.load_state_dict(sd)
    assert not opt.state


def _sharded_load_worker(rank, world):
    import test_distributed as td
    import torch.distributed as dist

    model, ref_model = td._make(rank)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False)
    td.loss_on(ref_model, 0, 0, slice(None)).backward()
    ref.step()
    sd = ref.state_dict()
    sd["state"][0]["lookahead_slow_buff"] = torch.ones_like(sd["state"][0]["exp_avg"])
    opt = OffloadOptimizer(model.parameters(), process_group=dist.group.WORLD, timeout=30)
    try:
        opt.load_state_dict(sd)
    except ValueError as exc:
        return str(exc), len(opt.state)
    return None, len(opt.state)


def test_a_wrappers_key_loaded_into_a_sharded_optimizer_is_refused_saying_why():
    """A wrapper's key is kept only where a bucket is whole in one process; a sharded optimizer refuses it, at the
    next step (an edit) and at load alike, and says so both times. The load's message called it another
    optimizer's state, which sends the user looking for a wrong checkpoint."""
    import test_distributed as td

    results = td.launch(_sharded_load_worker, 2)
    for rank, (message, entries) in results.items():
        assert message is not None and entries == 0, (rank, message)
        assert "lookahead_slow_buff" in message and "not sharded over ranks" in message, (rank, message)


# -- an entry read, or emptied, before a step ----------------------------------------------------------------------
def _read_and_empty(model, opt):
    """``opt.state[p]`` read for a parameter never stepped (the defaultdict makes ``{}``), and, once some have
    state, one entry emptied (``opt.state[p] = {}``: the parameter restarts at its next step)."""
    params = list(model.parameters())
    opt.state[params[0]]
    _ = opt.state[params[3]].get("step")
    return params


@pytest.mark.parametrize("placement", ["cpu", "parked"])
def test_an_empty_entry_is_listed_and_loaded_as_adamw_lists_it(request, placement):
    """Merely reading ``opt.state[p]`` before ``p``'s first step leaves ``{}`` there, and AdamW's ``state_dict()``
    lists ``{i: {}}``; ours left it out, and our loader refused AdamW's state dict with one ("lacks ['step', ...]").
    Both ways through a state dict, then every step against AdamW, an emptied entry of a stepped parameter too."""
    model, ref_model, ours, ref, kw = _pair(request, placement)
    for m, opt in ((model, ours), (ref_model, ref)):
        _read_and_empty(m, opt)
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert len(ref_sd["state"]) == 2 and not any(ref_sd["state"].values())
    assert ours_sd["state"] == ref_sd["state"]
    into_ours_model = copy.deepcopy(ref_model)
    into_ours = OffloadOptimizer(param_groups(into_ours_model), **kw)
    into_ours.load_state_dict(copy.deepcopy(ref_sd))
    assert into_ours.state_dict()["state"] == ref_sd["state"]
    for p, q in zip(into_ours_model.parameters(), ref_model.parameters()):
        assert (p in into_ours.state, into_ours.state.get(p)) == (q in ref.state, ref.state.get(q))
    into_ref_model = copy.deepcopy(model)
    into_ref = torch.optim.AdamW(param_groups(into_ref_model), foreach=False)
    into_ref.load_state_dict(copy.deepcopy(ours_sd))
    runs = ((model, ours), (ref_model, ref), (into_ours_model, into_ours), (into_ref_model, into_ref))
    for step in range(STEPS):
        for m, opt in runs:
            opt.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
            opt.step()
            if step == 1:
                opt.state[list(m.parameters())[2]] = {}  # (restarts at the next step, listed as {} until then)
        assert_same(model, ref_model, ours, ref, f"step {step}")
        assert_same(into_ours_model, ref_model, into_ours, ref, f"loaded, step {step}")
        assert_same(into_ref_model, ref_model, into_ref, ref, f"into AdamW, step {step}")
        empty = [{k for k, v in opt.state_dict()["state"].items() if not v} for opt in (ours, ref)]
        assert empty[0] == empty[1] and len(empty[1]) == (step == 1), f"step {step}"
        assert ours.state_dict()["state"].keys() == ref.state_dict()["state"].keys()


# -- a loaded step's dtype -----------------------------------------------------------------------------------------
def _steps_as(sd, dtype):
    for entry in sd["state"].values():
        entry["step"] = entry["step"].to(dtype)
    return sd


@pytest.mark.parametrize("placement", ["cpu", "parked"])
@pytest.mark.parametrize("dtype,saved_flag", [(torch.int64, None), (torch.float64, None), (torch.int64, "fused"),
                                              (torch.int64, "capturable")],
                         ids=["int64", "float64", "int64-fused", "int64-capturable"])
def test_a_loaded_steps_dtype_is_kept_as_adamw_keeps_it(request, placement, dtype, saved_flag):
    """torch's loader keeps a ``step`` tensor as it is (``_process_value_according_to_param_policy``), unless the
    saved group is ``fused`` or ``capturable`` (float32 then), and AdamW counts on in that dtype: ``opt.state`` and
    ``state_dict()`` show it. Ours made every loaded step float32. (A checkpoint with int64 steps: a converter's,
    DeepSpeed's, an older torch's counted as integers.)"""
    kw = _options(request, placement)
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    for step in range(2):
        ref.zero_grad()
        loss_fn(ref_model, step, 0, "cpu").backward()
        ref.step()
    sd = _steps_as(ref.state_dict(), dtype)
    if saved_flag is not None:
        for group in sd["param_groups"]:
            group[saved_flag] = True
    model.load_state_dict(ref_model.state_dict())
    ours = OffloadOptimizer(param_groups(model), **kw)
    ours.load_state_dict(copy.deepcopy(sd))
    ref.load_state_dict(copy.deepcopy(sd))
    for group in ref.param_groups:  # (the reference steps as it did; the flag decided the loaded step's dtype only)
        group["fused"], group["capturable"] = None, False
    want = torch.float32 if saved_flag is not None else dtype
    for step in range(2, 2 + STEPS):
        assert_same(model, ref_model, ours, ref, f"step {step}")
        for p, q in zip(model.parameters(), ref_model.parameters()):
            if q in ref.state:
                assert ref.state[q]["step"].dtype == want
                assert ours.state[p]["step"].dtype == want, f"step {step}"
        ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
        for k, entry in ref_sd["state"].items():
            assert ours_sd["state"][k]["step"].dtype == entry["step"].dtype == want, f"step {step}, {k}"
            assert ours_sd["state"][k]["step"].item() == entry["step"].item()
        for m, opt in ((model, ours), (ref_model, ref)):
            opt.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
            opt.step()


# -- amsgrad's max_exp_avg_sq, where AdamW's state has none ----------------------------------------------------------
def _amsgrad_steps(model, ref_model, ours, ref, steps, first=0, between=None):
    """Steps of both, parameters and state (keys included) compared every step, ``state_dict()``'s keys too."""
    for step in range(first, first + steps):
        if between is not None:
            between(step)
        for m, opt in ((model, ours), (ref_model, ref)):
            opt.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
            opt.step()
        assert_same(model, ref_model, ours, ref, f"step {step}")
        _same_keys(ours, ref, f"step {step}")


def _same_keys(ours, ref, where):
    ours_sd, ref_sd = ours.state_dict()["state"], ref.state_dict()["state"]
    assert {k: sorted(e) for k, e in ours_sd.items()} == {k: sorted(e) for k, e in ref_sd.items()}, where


@pytest.mark.parametrize("placement", ["cpu", "parked"])
def test_amsgrad_switched_off_before_the_first_step_keeps_no_max_exp_avg_sq(request, placement):
    """Built with ``amsgrad=True`` and switched off in a group before the first step: AdamW's state holds no
    ``max_exp_avg_sq`` for that group's parameters; ours showed a zero one (the bucket had allocated it)."""
    model, ref_model, ours, ref, _ = _pair(request, placement, amsgrad=True)
    for opt in (ours, ref):
        opt.param_groups[0]["amsgrad"] = False
    _amsgrad_steps(model, ref_model, ours, ref, STEPS)
    assert any("max_exp_avg_sq" in e for e in ref.state.values())  # (group 1 kept amsgrad)


@pytest.mark.parametrize("placement", ["cpu", "parked"])
def test_a_state_dict_saved_without_amsgrad_loads_without_max_exp_avg_sq(request, placement):
    """A state dict saved without amsgrad, loaded into an optimizer built with it (the loaded groups say
    ``amsgrad=False``): AdamW's entries are the loaded ones; ours showed a zero ``max_exp_avg_sq`` beside them.
    A saved one with amsgrad loads with it (both ways)."""
    model, ref_model, ours, ref, kw = _pair(request, placement, amsgrad=False)
    _amsgrad_steps(model, ref_model, ours, ref, 2)
    for saved_by in (ref, ours):
        for amsgrad in (True, False):
            sd = copy.deepcopy(saved_by.state_dict())
            into_model = copy.deepcopy(model)
            into = OffloadOptimizer(param_groups(into_model), amsgrad=amsgrad, **kw)
            into.load_state_dict(sd)
            assert not any("max_exp_avg_sq" in e for e in into.state.values())
            _same_keys(into, ref, "loaded")
    into_ref_model = copy.deepcopy(ref_model)
    into_ref = torch.optim.AdamW(param_groups(into_ref_model), amsgrad=True, foreach=False)
    into_ref.load_state_dict(copy.deepcopy(ref.state_dict()))
    ours = OffloadOptimizer(param_groups(model), amsgrad=True, **kw)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    _amsgrad_steps(model, into_ref_model, ours, into_ref, 3, first=2)


@pytest.mark.parametrize("placement", ["cpu", "parked"])
def test_amsgrad_switched_on_later_shows_max_exp_avg_sq_from_that_step(request, placement):
    """Switched on after some steps: AdamW raises ``KeyError: 'max_exp_avg_sq'`` (docs/differences.md); ours starts
    it at zero at that step, and shows it from then on: as AdamW given that zero buffer at the switch (its
    parameters never stepped before get it at their first step, as AdamW gives it)."""
    model, ref_model, ours, ref, _ = _pair(request, placement, amsgrad=True)
    for opt in (ours, ref):
        opt.param_groups[1]["amsgrad"] = False
    _amsgrad_steps(model, ref_model, ours, ref, 2)

    aux = {ref_model.aux.bias}  # (a gradient every third step only: its first update with amsgrad on is later)

    def switch_on(step):
        if step == 2:
            for opt in (ours, ref):
                opt.param_groups[1]["amsgrad"] = True
        for p in ref.param_groups[1]["params"]:  # (the zero buffer at each parameter's first update since)
            if p in ref.state and "max_exp_avg_sq" not in ref.state[p] and (p not in aux or step % 3 == 0):
                ref.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)

    _amsgrad_steps(model, ref_model, ours, ref, 3, first=2, between=switch_on)


# -- sharded over a process group: a GPU parameter's data replaced by another shape or strides ---------------------
REPLACEMENTS = {
    "same": lambda t: t.clone(),  # (followed, as AdamW follows it)
    "reshaped": lambda t: t.reshape(t.shape[1], t.shape[0]).clone(),  # (as many elements, another shape)
    "strided": lambda t: t.t().contiguous().t(),  # (the same shape and values, column-major)
}


def _sharded_replace_worker(rank, world, how):
    import test_distributed as td
    import torch.distributed as dist

    cuda_standins.install_in_rank()
    model, ref_model = td._make(rank, seed_ours=rank)
    opt = OffloadOptimizer(td.groups(model), lr=1e-2, bucket_numel=128, process_group=dist.group.WORLD,
                           placement="host", timeout=30)
    ref = torch.optim.AdamW(td.groups(ref_model), lr=1e-2, foreach=False)
    assert all(not b.on_cpu and b.home.kind == "host" and b.sharded for g in opt._buckets for b in g)
    for step in range(4):
        for m, o, rows in ((model, opt, td.rows_of(rank, world)), (ref_model, ref, slice(None))):
            o.zero_grad()
            td.loss_on(m, step, 0, rows).backward()
            if step == 2:  # (after backward: the forward reads the parameter as it was)
                m.w1.data = REPLACEMENTS[how](m.w1.data)
        if step == 2 and how != "same":
            before = copy.deepcopy(opt.state_dict()["state"])
            with pytest.raises(RuntimeError) as err:
                opt.step()
            after = opt.state_dict()["state"]
            for k, entry in before.items():
                for key, value in entry.items():
                    assert torch.equal(after[k][key], value), (k, key)
            return str(err.value)
        opt.step()
        ref.step()
        td._compare(model, ref_model, f"{how}, step {step}")
        sd, rsd = opt.state_dict()["state"], ref.state_dict()["state"]
        assert sd.keys() == rsd.keys()
        for k, entry in rsd.items():
            for key, value in entry.items():
                torch.testing.assert_close(sd[k][key], value, msg=lambda m: f"{how}, step {step}, {k} {key}: {m}")
    return None


@pytest.mark.parametrize("how", list(REPLACEMENTS))
def test_a_sharded_gpu_parameter_replaced_by_another_shape_or_strides_is_refused_naming_it(how):
    """Sharded (gloo, world 2, GPU stand-ins, stepped on the host): a parameter's data replaced (``p.data = t``) was
    checked for its number of elements only, so a same-size replacement of another shape or strides went on, its
    elements read and written in another order than the shard's. Refused now, as the unsharded path refuses it,
    naming what changed, nothing changed; one of the same shape and strides is followed, as AdamW follows it."""
    import test_distributed as td

    results = td.launch(_sharded_replace_worker, 2, how)
    if how == "same":
        assert results == {0: None, 1: None}
        return
    want = {"reshaped": "it was (17, 7) torch.float32 on cuda:0 (stand-in), it is now (7, 17) torch.float32",
            "strided": "it was (17, 7) with strides (7, 1)"}[how]
    for rank in (0, 1):
        assert "data was moved, cast or reshaped" in results[rank] and want in results[rank], results[rank]


def _sharded_entries_worker(rank, world):
    """The three state-dict edges above, sharded (CPU, gloo): ``state_dict()`` is gathered from the buffers there,
    not packed from ``opt.state``."""
    import test_distributed as td
    import torch.distributed as dist

    def build(amsgrad):
        model, ref_model = td._make(rank, seed_ours=rank)
        opt = OffloadOptimizer(td.groups(model), lr=1e-2, bucket_numel=128, process_group=dist.group.WORLD,
                               timeout=30, amsgrad=amsgrad)
        ref = torch.optim.AdamW(td.groups(ref_model), lr=1e-2, foreach=False, amsgrad=amsgrad)
        assert all(b.sharded for g in opt._buckets for b in g)
        return model, ref_model, opt, ref

    def same(model, ref_model, opt, ref, where):
        td._compare(model, ref_model, where)
        sd, rsd = opt.state_dict()["state"], ref.state_dict()["state"]
        assert {k: sorted(e) for k, e in sd.items()} == {k: sorted(e) for k, e in rsd.items()}, where
        for k, entry in rsd.items():
            for key, value in entry.items():
                assert sd[k][key].dtype == value.dtype, (where, k, key)
                torch.testing.assert_close(sd[k][key], value, msg=lambda m: f"{where}, {k} {key}: {m}")

    # an entry read before the first step; amsgrad switched off in a group before it
    model, ref_model, opt, ref = build(amsgrad=True)
    for m, o in ((model, opt), (ref_model, ref)):
        o.state[m.w1]
        o.param_groups[0]["amsgrad"] = False
    same(model, ref_model, opt, ref, "before the first step")
    for step in range(3):
        td._step(model, opt, step, rank, world)
        td._ref_step(ref_model, ref, step)
        same(model, ref_model, opt, ref, f"step {step}")
    # int64 steps loaded, without amsgrad, into an optimizer built with it
    sd = copy.deepcopy(ref.state_dict())
    for entry in sd["state"].values():
        entry["step"] = entry["step"].to(torch.int64)
        entry.pop("max_exp_avg_sq", None)
    for group in sd["param_groups"]:
        group["amsgrad"] = False
    model, ref_model, opt, ref = build(amsgrad=True)
    opt.load_state_dict(copy.deepcopy(sd))
    ref.load_state_dict(copy.deepcopy(sd))
    for step in range(3, 5):
        td._step(model, opt, step, rank, world)
        td._ref_step(ref_model, ref, step)
        same(model, ref_model, opt, ref, f"loaded, step {step}")
    return True


def test_the_state_dict_edges_sharded_match_adamw():
    """An empty entry listed as ``{}``, no ``max_exp_avg_sq`` where AdamW's state has none, a loaded int64 step
    kept: with ``process_group`` sharding, against AdamW every step (parameters, state keys, values and dtypes)."""
    import test_distributed as td

    assert td.launch(_sharded_entries_worker, 2) == {0: True, 1: True}

"""Failure paths a hostile user still found (part 3): parameters that view a larger tensor, strided views of one
base, parameters whose elements overlap, the ``release_grads`` claims under ``overlap_step``'s worker thread, and
per-rank state dicts under FSDP2 + TP (one spawn of 4 ranks). Each ends as ``torch.optim.AdamW``
(foreach=False) does, parameters and state checked every step at default fp32 tolerance, or with an error that names
the problem and changes nothing.

GPU parameters are the stand-ins of tests/cuda_standins.py (the buckets are told their parameters are on ``cuda:0``),
so the routes of a GPU bucket run their Python for real on a CPU-only machine.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cuda_standins
from zero_offload import OffloadOptimizer

STEPS = 4


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch, needs_fused=False)


def _loss(params, step):
    """A loss whose gradients differ per parameter and per step."""
    return sum(((p - 0.1 * (step + 1 + i)) ** 2 * (1.0 + 0.5 * i)).sum() for i, p in enumerate(params))


def _same(params, ref_params, ours, ref, where):
    """Parameters and every state tensor of ``ours`` against the reference AdamW's, at default tolerance."""
    for i, (p, q) in enumerate(zip(params, ref_params)):
        torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m: f"{where}, param {i}: {m}")
        expected, actual = ref.state.get(q, {}), ours.state.get(p, {})
        assert set(actual) == set(expected), f"{where}, param {i}: keys {set(actual)} vs {set(expected)}"
        for key, value in expected.items():
            torch.testing.assert_close(actual[key].cpu(), value.cpu(), msg=lambda m: f"{where}, {i}, {key}: {m}")


def _beside_adamw(make, steps=STEPS, check=None, **kw):
    """Ours (``kw``) over the parameters ``make()`` returns (with whatever it keeps alive) and AdamW over another
    call's: equal every step; ``check(kept, ref_kept)`` after each step."""
    torch.manual_seed(0)
    params, kept = make()
    torch.manual_seed(0)
    ref_params, ref_kept = make()
    ours = OffloadOptimizer(params, lr=0.05, weight_decay=0.1, **kw)
    ref = torch.optim.AdamW(ref_params, lr=0.05, weight_decay=0.1, foreach=False)
    for step in range(steps):
        for ps, opt in ((params, ours), (ref_params, ref)):
            opt.zero_grad()
            _loss(ps, step).backward()
            opt.step()
        _same(params, ref_params, ours, ref, f"step {step}")
        if check is not None:
            check(kept, ref_kept)
    return ours


# -- 1. a parameter that views a larger tensor still alive -------------------------------------------------------------
def _sliced_from_live_base():
    base = torch.randn(10, 6)
    return [nn.Parameter(base[:5])], base


def _flat_buffer():
    """Megatron / FSDP1 style: the parameters are views of one contiguous buffer, which the model keeps."""
    flat = torch.randn(100)
    return [nn.Parameter(flat[:60].view(6, 10)), nn.Parameter(flat[60:70])], flat


LIVE = {"sliced": _sliced_from_live_base, "flat buffer": _flat_buffer}


WARNED = r"is a view of a larger tensor that is still alive .* no longer sees the updates"


@pytest.mark.parametrize("make", LIVE.values(), ids=LIVE.keys())
def test_a_cpu_parameter_viewing_a_live_larger_tensor_is_warned_of_naming_it(make):
    """AdamW updates such a parameter in place, so the larger tensor sees every update; a CPU parameter is bound to
    the optimizer's buffer, and the tensor stopped seeing them without a word. Now one warning at construction
    names the parameter and what to do (not refused: the tensor may be one nobody reads again, a loaded
    checkpoint's); the parameters train as AdamW's."""
    with pytest.warns(UserWarning, match=r"param group 0, parameter 0 \(shape .*\)" + ".*" + WARNED):
        _beside_adamw(make)


def test_a_param_group_viewing_a_live_larger_tensor_is_warned_of():
    """The same for ``add_param_group`` mid-run, naming the group; the new group trains."""
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    opt = OffloadOptimizer(model.parameters())
    _loss(list(model.parameters()), 0).backward()
    opt.step()
    params, base = _flat_buffer()
    with pytest.warns(UserWarning, match=r"param group 1, parameter 0 \(shape \(6, 10\)\) \(and 1 more of the "
                                         r"group\) " + WARNED) as record:
        opt.add_param_group({"params": params})
    assert [w.filename for w in record] == [__file__]  # (the user's line, not the package's)
    opt.zero_grad()
    _loss(list(model.parameters()) + params, 1).backward()
    opt.step()
    assert len(opt.state) == 4


def _sliced_from_dead_base():
    return [nn.Parameter(torch.randn(10, 6)[:5])], None


def _flat_buffer_dropped():
    params, _ = _flat_buffer()
    return params, None


def _column_halves_dropped():
    base = torch.randn(6, 10)
    return [nn.Parameter(base[:, :5]), nn.Parameter(base[:, 5:])], None


DEAD = {"sliced": _sliced_from_dead_base, "flat buffer": _flat_buffer_dropped, "column halves": _column_halves_dropped}


@pytest.mark.parametrize("make", DEAD.values(), ids=DEAD.keys())
def test_views_of_a_tensor_no_longer_alive_train_as_adamw(make):
    """Views of a base nothing else holds (``nn.Parameter(torch.randn(10, 6)[:5])``; a flat buffer or a matrix cut
    into views, then dropped): each parameter's own slot is exact, so they are taken and train as AdamW. The column
    halves of one matrix share no element though their memory ranges interleave: they were refused as "a view of
    the other's data"."""
    _beside_adamw(make)


def test_column_halves_of_a_live_matrix_are_warned_of_for_the_true_reason():
    """Disjoint strided views of a matrix still alive: taken (they share no element), with the warning that the
    matrix stops seeing the updates, not refused as views of each other's data."""
    base = torch.randn(6, 10)
    a, b = nn.Parameter(base[:, :5]), nn.Parameter(base[:, 5:])
    with pytest.warns(UserWarning, match=WARNED) as record:
        OffloadOptimizer([a, b])
    assert [w.filename for w in record] == [__file__]  # (the user's line, not the package's)
    assert not any("view of the other's data" in str(w.message) for w in record)


def test_parameters_sharing_an_element_through_strided_views_are_still_refused():
    """The element-wise look does not let through views that do share elements (rows of a transposed view over
    the columns of another)."""
    base = torch.randn(6, 10)
    a = nn.Parameter(base[:, 2:7])
    b = nn.Parameter(a.data.t()[1:3])  # (columns 3 and 4 of base, which ``a`` holds too)
    del base
    with pytest.raises(ValueError, match=r"parameter 1 \(shape \(2, 6\)\) shares memory with param group 0, "
                                         r"parameter 0 \(shape \(6, 5\)\): one is a view of the other's data"):
        OffloadOptimizer([a, b])


@pytest.mark.parametrize("make", [lambda: torch.randn(1, 4).expand(3, 4),
                                  lambda: torch.randn(4).as_strided((3, 2), (1, 1))], ids=["expanded", "as_strided"])
def test_a_parameter_whose_elements_overlap_each_other_is_refused_naming_it(make):
    """An expanded parameter: AdamW refuses to update it in place (its elements are one memory location); each
    element was given a slot of its own, untying them without a word. Refused at construction, naming it."""
    p = nn.Parameter(make())
    with pytest.raises(ValueError, match=r"param group 0, parameter 0 \(shape \(3, \d\), strides .*\): its elements "
                                         r"overlap one another in memory"):
        OffloadOptimizer([p])


def _follows(kept, ref_kept):
    torch.testing.assert_close(kept, ref_kept, msg=lambda m: f"the larger tensor: {m}")


@pytest.mark.parametrize("placement", [dict(placement="host"), dict(gpu_fraction="auto")],
                         ids=["host", "gpu_fraction-auto"])
def test_a_gpu_parameter_viewing_a_live_flat_buffer_keeps_it_following(cuda_branches, placement):
    """A GPU parameter whose state is stepped on the host is written in place, as AdamW writes it: the flat buffer
    it views follows every update. ``gpu_fraction="auto"`` (and ``placement="auto"``) would move its bucket into a
    GPU home after the first steps, which binds the parameter to its slot: the buffer stopped following there. Such
    a bucket stays on the host."""
    _beside_adamw(_flat_buffer, check=_follows, bucket_numel=1000, **placement)


@pytest.mark.parametrize("placement", ["resident", "parked"])
def test_a_gpu_parameter_viewing_a_live_flat_buffer_in_a_gpu_home_is_warned_of(cuda_branches, placement):
    """A GPU home binds the parameters to its slots (as a CPU bucket does): warned of, naming the way out."""
    params, flat = _flat_buffer()
    with pytest.warns(UserWarning, match=WARNED + r".*placement='host'"):
        OffloadOptimizer(params, placement=placement)


def test_a_loaded_checkpoint_still_held_does_not_stop_a_rebuild():
    """Parameters saved from a CPU model's slots load as views of one storage: rebuilt from the loaded list while it
    is still held (as a resumed run does), they are warned of, not refused, and train as AdamW's."""
    import io

    def make():
        model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
        OffloadOptimizer(model.parameters())  # (the parameters become views of its buffer)
        buf = io.BytesIO()
        torch.save([p.detach() for p in model.parameters()], buf)
        buf.seek(0)
        loaded = torch.load(buf)
        return [nn.Parameter(t) for t in loaded], loaded

    with pytest.warns(UserWarning, match=WARNED):
        _beside_adamw(make)


def test_an_optimizer_rebuilt_over_part_of_a_model_another_bound_is_taken():
    """The buffer an earlier optimizer bound the model's parameters to is no larger tensor of the user's, also while
    parameters it bound stay out of the new optimizer (progressive unfreezing, an optimizer rebuilt over the
    trainable part): taken, and trained as AdamW."""

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
        OffloadOptimizer(model.parameters())  # (dropped: the parameters stay views of its buffer)
        return list(model[1].parameters()), model

    _beside_adamw(make)


# -- 3. the release_grads claims from several threads ------------------------------------------------------------------
@pytest.fixture
def switching():
    """Threads switched as often as the interpreter can (races that need an unlucky switch show in a few thousand
    iterations instead of a long run)."""
    import sys

    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(was)


class _Lane:
    def __init__(self, params):
        self.bucket = type("Bucket", (), {"owners": params})()


class _Transport:
    release, moved = True, False


def test_the_claims_registry_holds_under_threads(switching):
    """Optimizers' claims on their parameters (zero_offload.holders) are made by constructors on the user's thread,
    looked at by backward's hooks (autograd's device threads on a GPU) and let go by finalisers on whatever thread
    the collector runs (``overlap_step``'s worker included). Three threads each claim, look and let go over the same
    parameters: was ``KeyError`` (two finalisers pruning one entry), ``RuntimeError: Set changed size during
    iteration`` (a look or a finaliser iterating a set another thread adds to) and lost counts of changes (a look
    then skipped, so a releasing optimizer would take the gradient of one built meanwhile)."""
    import threading

    from zero_offload import holders

    params = [torch.zeros(1) for _ in range(8)]
    lane, n, errors = _Lane(params), 2000, []
    start = holders._CHANGES[0]

    def churn():
        try:
            for _ in range(n):
                h = holders.Holding(_Transport())
                h.add(lane)
                holders.refuse_taken(params, 0)
                h.let_go()
        except Exception as exc:  # (re-raised on the test's thread below)
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert holders._CHANGES[0] - start == 3 * n * 2  # (each add and each let_go counted)


def test_optimizers_rebuilt_with_overlap_step_and_release_grads_train_as_adamw():
    """The loop the registry serves: an optimizer with ``overlap_step=True`` (updates in its worker thread) and
    ``release_grads=True`` rebuilt every few steps over one model, the old ones collected in between (their
    finalisers on whichever thread collects): no claim of a dropped one refuses the new one, and the model trains
    as AdamW rebuilt alike."""
    import gc

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(3, 6))]
    ref_params = [nn.Parameter(p.detach().clone()) for p in params]
    kw = dict(overlap_step=True, release_grads=True, nonfinite="ignore", bucket_numel=16)
    for step in range(120):
        if step % 3 == 0:
            ours = OffloadOptimizer(params, lr=0.01, **kw)
            ref = torch.optim.AdamW(ref_params, lr=0.01, foreach=False)
            if step % 9 == 0:
                gc.collect()
        for ps, opt in ((params, ours), (ref_params, ref)):
            opt.zero_grad()
            _loss(ps, step % 5).backward()
            opt.step()
        _same(params, ref_params, ours, ref, f"step {step}")


# -- 4. per-rank state dicts under FSDP2 + TP (world 4, one spawn) ------------------------------------------------------
def tp_loads(rank, world, workdir):
    """On the (2 x 2) mesh (``sequence`` style: the norm replicated over ``tp``, the linears sharded over both), each
    rank's state dict ``torch.save``d after a step, then loaded by each rank where it does not belong: its ``tp``
    peer's, its ``dp`` peer's, and its own with every DTensor redistributed to other placements. Each load's error
    (None: loaded) and whether the state and the parameters are as before."""
    import os

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    from test_fsdp2 import _load_outcome
    from test_fsdp2_tp import OURS, Setup, build, train_step

    setup = Setup("sequence", OURS)
    loop = build(setup)
    train_step(loop, setup, 0)
    torch.save(loop.opt.state_dict(), os.path.join(workdir, f"tp-r{rank}.pt"))
    dist.barrier()

    def saved(r):
        return torch.load(os.path.join(workdir, f"tp-r{r}.pt"), weights_only=False)

    out = {"tp peer": _load_outcome(loop.model, loop.opt, saved(rank ^ 1)),
           "dp peer": _load_outcome(loop.model, loop.opt, saved(rank ^ 2))}
    own = loop.opt.state_dict()
    for entry in own["state"].values():
        for k, v in entry.items():
            if isinstance(v, DTensor) and v.dim():  # (a collective: every rank takes every entry alike)
                entry[k] = v.redistribute(v.device_mesh, [Replicate()] * v.device_mesh.ndim)
    out["replicated"] = _load_outcome(loop.model, loop.opt, own)
    return out


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_per_rank_state_dicts_of_the_wrong_rank_or_placement_are_refused_under_fsdp2_and_tp(tmp_path):
    """A state dict saved by another rank of the (2 x 2) FSDP2 + TP mesh (its tensor-parallel peer's, its
    data-parallel peer's) or placed otherwise, loaded with ``torch.load``: refused on every rank, naming the
    parameter's shard or placements and DCP, nothing changed."""
    pytest.importorskip("torch.distributed.tensor.parallel")
    import fsdp2_harness as h

    outcome = h.run_jobs(4, {"loads": h.Call(tp_loads, (str(tmp_path),))}, str(tmp_path), timeout=600)["loads"]
    for rank, cases in outcome.per_rank.items():
        for case, (message, unchanged) in cases.items():
            assert message is not None, (rank, case, "loaded")
            assert unchanged, (rank, case, message)
            if case == "replicated":
                assert "a state DTensor placed (Replicate(), Replicate())" in message, (rank, case, message)
            else:
                assert "this rank's shard of the state DTensor" in message, (rank, case, message)
                assert "torch.distributed.checkpoint" in message, (rank, case, message)

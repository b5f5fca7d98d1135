"""``placement`` under ``process_group`` sharding (ZeRO): each rank keeps its shard of a bucket's state on the host
(stepped there), resident on the GPU, or parked on the host between steps and stepped on the GPU; a mix of the three
in one param group; ``"auto"`` placing every rank's buckets alike. gloo, world 2, the ranks forked as
test_distributed's are (:func:`test_distributed.launch`), the GPU the stand-in of tests/cuda_standins.py (torch's
fused CPU kernel standing in for its CUDA one; each collective waited for as it starts, as test_distributed's CUDA
branches are).

Every rank against single-process ``torch.optim.AdamW(foreach=False)`` on the whole batch: the parameters and the
gathered state (``state_dict()``) every step. Tolerance: default fp32 (the reduced gradient sums each rank's rows
then the ranks, the reference the whole batch at once; the host kernel and torch's fused one round alike within
it). A step refused or skipped for an inf/nan is compared bit for bit with what was there before it.
"""

from __future__ import annotations

import copy
import io
import weakref

import pytest
import torch
import torch.distributed as dist

import test_distributed as td
from test_twin_flow import step_on_an_inf
from zero_offload import OffloadOptimizer, _torch_fused

STEPS = 4
BUCKET = 128
MIX = {"resident": 0.3, "parked": 0.4}  # the first group's buckets: (c, b) resident, (aux, w2) parked, (w1) host
pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
              pytest.mark.skipif(not _torch_fused.AVAILABLE, reason="torch < 2.4 has no fused AdamW for CPU tensors "
                                 "to stand in for the GPU's")]


def groups(model):
    """Two groups; the first of three buckets of 24, 68 and 119 elements (the MIX places one in each home)."""
    return [{"params": [model.c, model.b, model.aux, model.w2, model.w1], "weight_decay": 0.1},
            {"params": [model.big, model.a], "lr": 2e-2, "weight_decay": 0.0}]


def _on_standins():
    """This rank's CUDA branches on CPU tensors, each collective waited for as it starts (see the module
    docstring)."""
    import cuda_standins

    cuda_standins.install_in_rank()


def _make(rank, placement, **kw):
    if placement == "adamw":  # (rank 0's values on every rank, as ours has after its broadcast)
        model, ref_model = td._make(rank)
        return model, torch.optim.AdamW(groups(model), lr=1e-2, foreach=False), ref_model
    model, ref_model = td._make(rank, seed_ours=rank)  # (ours broadcasts rank 0's values)
    opt = OffloadOptimizer(groups(model), lr=1e-2, bucket_numel=BUCKET, process_group=dist.group.WORLD,
                           placement=placement, timeout=30, **kw)
    return model, opt, ref_model


def _homes(opt):
    return [[b.home.kind for b in group] for group in opt._buckets]


def _same(model, ref_model, opt, ref, where):
    """Parameters and the whole (gathered) state equal the reference's."""
    td._compare(model, ref_model, where)
    sd, rsd = opt.state_dict(), ref.state_dict()
    assert sd["state"].keys() == rsd["state"].keys(), where
    for k, expected in rsd["state"].items():
        assert sd["state"][k].keys() == expected.keys(), (where, k)
        for name, value in expected.items():
            torch.testing.assert_close(sd["state"][k][name], value, msg=lambda m: f"{where}, state {k} {name}: {m}")


def _both_step(model, opt, ref_model, ref, step, rank, world, **kw):
    norm = td._step(model, opt, step, rank, world, **kw)
    ref_norm = td._ref_step(ref_model, ref, step, **kw)
    if norm is not None:
        torch.testing.assert_close(norm, ref_norm, msg=lambda m: f"step {step} norm: {m}")


# -- each placement against AdamW, every step ---------------------------------------------------------------------
PLACEMENTS = {
    "host": dict(placement="host"),
    "parked": dict(placement="parked"),  # (streamed: each shard's state comes up in backward)
    "parked_at_step": dict(placement="parked", stream_grads=False),  # (reduce-scattered and brought up at step())
    "parked_no_room": dict(placement="parked", uploads_in_backward=False),
    "resident": dict(placement="resident"),
    "mix": dict(placement=MIX),
    # (two micro-batches, each reduce-scattered in backward, their shards summed beside the gradient's)
    "parked_release_accumulate": dict(placement="parked", release_grads=True, accumulate=2),
}


def _placements_worker(rank, world):
    _on_standins()
    homes = {}
    for name, kw in PLACEMENTS.items():
        kw = dict(kw)
        placement, accumulate = kw.pop("placement"), kw.pop("accumulate", 1)
        model, opt, ref_model = _make(rank, placement, **kw)
        ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, foreach=False)
        opt.record_timeline()
        for step in range(STEPS):
            _both_step(model, opt, ref_model, ref, step, rank, world, clip=0.3, accumulate=accumulate)
            _same(model, ref_model, opt, ref, f"{name}, step {step}")
        homes[name] = (_homes(opt), sorted({e.what for e in opt.timeline()} & {"reload", "write-back"}))
    return homes


def test_each_placement_matches_adamw_every_step_sharded():
    results = td.launch(_placements_worker, 2)
    assert results[0] == results[1]
    homes = results[0]
    assert homes["host"] == ([["host"] * 3, ["host"] * 2], [])
    assert homes["resident"] == ([["resident"] * 3, ["resident"] * 2], [])
    for name in ("parked", "parked_at_step", "parked_no_room", "parked_release_accumulate"):
        assert homes[name] == ([["parked"] * 3, ["parked"] * 2], ["reload", "write-back"]), name
    assert homes["mix"][0][0] == ["resident", "parked", "host"], homes["mix"]


# -- a nonfinite gradient on one rank; an LR set after backward ----------------------------------------------------
def _snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()["state"])


def _nonfinite_worker(rank, world, policy):
    """Three steps, then an inf in rank 1's gradient of a parked bucket's parameter only: every rank raises or skips
    (as ``policy`` says) with nothing changed in any home, lets go of the state brought up for the step, and the
    next step goes on as AdamW's (which never saw the bad step)."""
    _on_standins()
    model, opt, ref_model = _make(rank, MIX, nonfinite=policy)
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, foreach=False)
    for step in range(3):
        _both_step(model, opt, ref_model, ref, step, rank, world)
    parked = next(b for b in opt._buckets[0] if b.home.kind == "parked")
    before = _snapshot(model, opt)
    opt.zero_grad()
    td.loss_on(model, 3, 0, td.rows_of(rank, world)).backward()
    if rank == 1:
        parked.params[0].grad.view(-1)[0] = float("inf")
    step_on_an_inf(opt, policy)
    assert parked.home.twins is None, "the state brought up for the step was kept"
    after = _snapshot(model, opt)
    assert all(torch.equal(p, q) for p, q in zip(before[0], after[0])), "a parameter changed"
    for k, entry in before[1].items():
        for name, value in entry.items():
            assert torch.equal(after[1][k][name], value), (k, name)
    for step in range(4, 6):
        _both_step(model, opt, ref_model, ref, step, rank, world, clip=0.3)
        _same(model, ref_model, opt, ref, f"{policy}, step {step}")
    return True


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_nonfinite_gradient_on_one_rank_leaves_every_home_as_it_was(policy):
    td.launch(_nonfinite_worker, 2, policy)


def _lr_worker(rank, world):
    """An LR set after backward, once each parked shard's state came up (with its reduce-scatter, in backward), is
    the one every home steps with."""
    _on_standins()
    model, opt, ref_model = _make(rank, MIX)
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, foreach=False)
    parked = [b for b in opt._buckets[0] if b.home.kind == "parked"]
    assert parked
    for step in range(STEPS):
        for o, m, rows in ((opt, model, td.rows_of(rank, world)), (ref, ref_model, slice(None))):
            o.zero_grad()
            td.loss_on(m, step, 0, rows).backward()
            assert o is ref or all(b.home.twins is not None for b in parked), "not brought up in backward"
            for group in o.param_groups:  # (after the parked shards came up in backward)
                group["lr"] = 1e-3 * (step + 2)
            o.step()
        _same(model, ref_model, opt, ref, f"step {step}")
    return True


def test_an_lr_set_after_backward_is_the_one_every_home_steps_with_sharded():
    td.launch(_lr_worker, 2)


# -- no full-size gradient buffer on the GPU --------------------------------------------------------------------------
HELD = {
    # (streamed: each micro-batch's accumulated gradients reduce-scattered in backward, the last one's shard kept)
    "parked_accumulate": dict(placement="parked"),
    # (each micro-batch's shard summed beside the gradient's, the gradients dropped in backward)
    "parked_release": dict(placement="parked", release_grads=True),
    "parked_at_step": dict(placement="parked", stream_grads=False),  # (flattened and reduce-scattered at step())
    "resident_accumulate": dict(placement="resident"),
    "resident_release": dict(placement="resident", release_grads=True),
    # (at step(); zero_grad(set_to_none=False): the gradients zeroed where they are, not made views of a buffer)
    "resident_keep_grads": dict(placement="resident", stream_grads=False, set_to_none=False),
    "mix": dict(placement=MIX),
    # (a GradScaler: its unscale_ edits the gradients after backward reduce-scattered them, so step() reduces them
    # again; at INF_STEP every rank's scaler, and AdamW's, finds the inf and skips the step)
    "mix_scaler": dict(placement=MIX, scaler=True),
}
INF_STEP = 2  # rank 1 finds an inf in a gradient of a GPU bucket's parameter; every rank skips the step


def _watch_inputs(opt):
    """Weak references to every reduce-scatter's input (with its length and what it reduces), as they are issued."""
    comm, seen = opt._transport.comm, []
    start = comm.start_reduce_scatter

    def watched(out, inp, where):
        seen.append((weakref.ref(inp), inp.numel(), where))
        return start(out, inp, where)

    comm.start_reduce_scatter = watched
    return seen


def _held_worker(rank, world, name):
    """Three micro-batches accumulated a step, clipped, an inf on rank 1 at :data:`INF_STEP` (with a GradScaler, on
    every rank and AdamW's): every rank equals AdamW every step (parameters and gathered state; the clip's norm),
    and every GPU bucket holds no full-size
    gradient buffer: none between steps, only its shard of the reduced gradients from backward to the step's end
    (``device_bytes()``, the tensors' sizes), and every reduce-scatter input (the bucket's full length) is freed as
    soon as it is issued."""
    _on_standins()
    kw = dict(HELD[name])
    placement, set_to_none, scaling = kw.pop("placement"), kw.pop("set_to_none", True), kw.pop("scaler", False)
    model, opt, ref_model = _make(rank, placement, nonfinite="skip", **kw)
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, foreach=False)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**4) if scaling else None for _ in range(2)]
    gpu = [b for g in opt._buckets for b in g if b.home.kind != "host"]
    assert gpu and all(b.flat_grad is None for b in gpu), "a full gradient buffer was made at construction"
    inputs = _watch_inputs(opt)
    streamed = kw.get("stream_grads", True)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        ref.zero_grad(set_to_none=set_to_none)
        inf = step == INF_STEP and (rank == 1 or scaling)
        hooks = [m.w2.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), float("inf")))
                 for m in ((model, ref_model) if inf and scaling else (model,) if inf else ())]
        runs = [(model, td.rows_of(rank, world), scalers[0])]
        if step != INF_STEP or scaling:  # (without a scaler AdamW never sees the skipped step)
            runs.append((ref_model, slice(None), scalers[1]))
        for micro in range(3):
            for m, rows, scaler in runs:
                loss = td.loss_on(m, step, micro, rows) / 3
                (loss if scaler is None else scaler.scale(loss)).backward()
        for hook in hooks:
            hook.remove()
        where = f"{name}, step {step}"
        if streamed:  # backward reduce-scattered every bucket: each holds its shard only, every input freed
            assert all(b.grads.allocated and b.grad.numel() == b.shard.numel for b in gpu), where
            # fp32: the moments, 4 + 4 B per element of the rank's padded shard (brought up in backward where parked),
            # and the shard of the reduced gradients, 4 B
            for b in gpu:
                n = b.layout.padded_numel
                assert b.device_bytes() == {"exp_avg": 4 * n, "exp_avg_sq": 4 * n, "grad": 4 * n}, (where, b.where)
            assert inputs and all(r() is None for r, _, _ in inputs), f"{where}: a reduce-scatter input outlived it"
        shards = []
        if step == INF_STEP and not scaling:
            opt.step()
        else:
            for o, scaler in ((opt, scalers[0]), (ref, scalers[1])):
                if scaler is not None:
                    scaler.unscale_(o)
                if o is opt:
                    norm = opt.clip_grad_norm_(0.3)
                    shards = [weakref.ref(b.grad) for b in gpu]  # (made by now: clipping reduce-scattered each)
                else:
                    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.3, foreach=False)
                if scaler is None:
                    o.step()
                else:
                    scaler.step(o)
                    scaler.update()
            torch.testing.assert_close(norm, ref_norm, msg=lambda m: f"{where} norm: {m}")
        _same(model, ref_model, opt, ref, where)
        # Between steps: no gradient buffer on the GPU at all, and none of the step's alive.
        full = {f"gradients of {b.where}": b.full.padded_numel for b in gpu}
        assert {w for _, _, w in inputs} >= set(full), where  # (each GPU bucket's reduced, from its full length)
        assert all(n == full[w] for _, n, w in inputs if w in full), (where, inputs)
        assert all(r() is None for r, _, _ in inputs), f"{where}: a reduce-scatter input outlived the step"
        assert all(r() is None for r in shards), f"{where}: a gradient shard outlived the step"
        homes = opt.estimate_host_memory().homes  # (what each home holds on the GPU through a step, per rank)
        for home in {b.home.kind for b in gpu}:
            assert homes[home].gpu_bytes == sum(12 * b.layout.padded_numel for b in gpu if b.home.kind == home), home
        for b in gpu:
            n = b.layout.padded_numel  # (between steps: a resident bucket's moments, nothing of a parked one's)
            assert b.device_bytes() == ({"exp_avg": 4 * n, "exp_avg_sq": 4 * n} if b.home.kind == "resident" else {})
            lane = next(lane for lane in opt._transport.lanes if lane.bucket is b)
            assert b.flat_grad is None and not b.grads.allocated, (where, b.where)
            assert getattr(lane.channel, "shard_in", None) is None, (where, b.where)  # (release's second shard)
            assert set(b.device_bytes()) & {"grad", "flat_grad", "grad_prev"} == set(), (where, b.device_bytes())
        inputs.clear()
    return True


@pytest.mark.parametrize("name", list(HELD))
def test_gpu_buckets_hold_no_full_gradient_buffer_and_match_adamw(name):
    td.launch(_held_worker, 2, name)


# -- checkpoints across placements ---------------------------------------------------------------------------------
LOADS = [("parked", "host", "full"), ("host", "parked", "full"), ("mix", "resident", "full"),
         ("resident", "mix", "full"), ("parked", "adamw", "full"), ("adamw", "parked", "full"),
         ("parked", "mix", "dcp"), ("mix", "parked", "dcp")]


def _placement(name):
    return MIX if name == "mix" else name


def _save_load(model, opt, resumed_model, resumed, how, path):
    """``opt``'s state (and ``model``'s parameters) into ``resumed`` (and ``resumed_model``): ``state_dict()``
    through bytes, or ``sharded_state_dict()`` through DCP in ``path``."""
    import torch.distributed.checkpoint as dcp

    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict() if how == "full" else None}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed_model.load_state_dict(ckpt["model"])
    if how == "full":
        resumed.load_state_dict(ckpt["opt"])
        return
    dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=path)
    sd = {"optim": resumed.sharded_state_dict()}
    dcp.load(sd, checkpoint_id=path)
    resumed.load_sharded_state_dict(sd["optim"])


def _load_worker(rank, world, cases, path):
    """Saved mid-run under one placement (or by AdamW on the whole batch), loaded under another (or into AdamW),
    the resumed run goes on with the uninterrupted one, parameters and state every step."""
    import os

    _on_standins()
    for k, (saved, loaded, how) in enumerate(cases):
        model, opt, ref_model = _make(rank, _placement(saved))
        for step in range(3):
            if saved == "adamw":
                td._ref_step(model, opt, step, clip=0.3)
            else:
                td._step(model, opt, step, rank, world, clip=0.3)
        resumed_model, resumed, _ = _make(rank, _placement(loaded))
        _save_load(model, opt, resumed_model, resumed, how, os.path.join(path, str(k)))
        for step in range(3, 6):
            for m, o, name in ((model, opt, saved), (resumed_model, resumed, loaded)):
                if name == "adamw":
                    td._ref_step(m, o, step, clip=0.3)
                else:
                    td._step(m, o, step, rank, world, clip=0.3)
            _same(resumed_model, model, resumed, opt, f"{saved} -> {loaded} ({how}), step {step}")
    return True


def test_a_state_dict_loads_under_any_placement_sharded(tmp_path):
    td.launch(_load_worker, 2, LOADS, str(tmp_path))


# -- placement="auto": every rank places alike -----------------------------------------------------------------------
def _auto_worker(rank, world):
    """The ranks measure different rates and rooms: rank 0 a host kernel so fast that nothing is worth parking and
    room for every bucket's state, rank 1 a slow kernel and room for the largest bucket's state only. Both place
    from the least of each (one collective): rank 1's room, rank 1's kernel, and so the same homes, parking some."""
    import zero_offload.cost_model as cost_model

    _on_standins()
    cost_model.measure_copy_rate = lambda device, nbytes=0, up=True: 1e15
    cost_model.measure_kernel_rate = lambda numel=0: {0: 1e15, 1: 1e3}[rank]
    model, opt, ref_model = _make(rank, "auto", gpu_margin_gib=1.0, stream_grads=True)
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, foreach=False)
    largest = max(b.device_cost() for g in opt._buckets for b in g)
    # Beyond the peak (1 MiB) and the margin: room for every bucket on rank 0, for the largest on rank 1.
    room = {0: 10**9, 1: largest}[rank]
    torch.cuda.mem_get_info = lambda device=None: (2**30 + 2**20 + room, 80 * 2**30)
    torch.cuda.memory_reserved = lambda device=None: 0
    torch.cuda.max_memory_allocated = lambda device=None: 2**20  # (backward freed 1 MiB by step())
    torch.cuda.memory_allocated = lambda device=None: 0
    placed = []
    for step in range(5):
        _both_step(model, opt, ref_model, ref, step, rank, world, clip=0.3)
        _same(model, ref_model, opt, ref, f"auto, step {step}")
        placed.append(_homes(opt))
    costs = [b.device_cost() for g in opt._buckets for b in g]
    # Moved between steps (rehome): no full gradient buffer made, and between steps no gradient buffer at all.
    held = [(b.flat_grad, b.grads.allocated) for g in opt._buckets for b in g if b.home.kind != "host"]
    return placed, costs, held


def test_auto_places_alike_on_ranks_that_measured_differently():
    results = td.launch(_auto_worker, 2)
    (placed0, costs, held), (placed1, _, _) = results[0], results[1]
    assert placed0 == placed1, (placed0, placed1)
    assert held and held == [(None, False)] * len(held), held
    assert all(h == "host" for g in placed0[0] for h in g)  # (placed after the second step)
    homes = [h for g in placed0[-1] for h in g]
    # Rank 0 alone would park nothing (its kernel leaves no tail to shorten) and keep every bucket resident.
    assert "parked" in homes, homes
    assert sum(c for c, h in zip(costs, homes) if h == "resident") <= max(costs), homes


# -- on a real GPU (skipped without one; in the runbook's `pytest -m cuda`) ----------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("placement", ["parked", "mix"])
def test_parked_shards_on_a_gpu_match_adamw(placement, dtype, tmp_path):
    """NCCL, one rank on one GPU: the parked shard's state in pinned host memory between steps (a bf16 model's
    fp32 master too), its parameters bound to a device ``flat_param``, stepped there by torch's fused CUDA kernel;
    against AdamW on the GPU (fp32) or on fp32 copies fed the same bf16 gradients, every step, clipped."""
    if not dist.is_nccl_available():
        pytest.skip("NCCL is not available")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = td.Net().to(dtype).cuda()
        ref_model = td.Net().cuda()
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref_model.parameters()):
                q.copy_(p)
        opt = OffloadOptimizer(groups(model), lr=1e-2, bucket_numel=BUCKET, process_group=dist.group.WORLD,
                               placement=_placement(placement))
        ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, foreach=False)
        parked = [b for g in opt._buckets for b in g if b.home.kind == "parked"]
        assert parked and all(b.flat_param.is_cuda for b in parked)
        assert all(not t.is_cuda and t.is_pinned() for b in parked for t in b.home.parked().values())
        for step in range(STEPS):
            td.gpu_step_beside_adamw(model, opt, ref_model, ref, step, dtype)
            sd = opt.state_dict()
            for k, v in ref.state_dict()["state"].items():
                for name in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(sd["state"][k][name], v[name].cpu(), msg=lambda m: f"{k} {name}: {m}")
    finally:
        dist.destroy_process_group()


def _whole_class_sharded(rank, world):
    _on_standins()
    from zero_offload import offload

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(5, 7))]
    before = [p.detach().clone() for p in params]
    try:
        offload(torch.optim.Muon, params, lr=0.02, placement="parked", process_group=dist.group.WORLD, timeout=30)
    except ValueError as exc:
        return str(exc), all(torch.equal(p, b) for p, b in zip(params, before))
    return "built", None


def test_a_class_run_whole_is_refused_when_its_buckets_hold_pieces_of_parameters():
    """Muon steps each parameter whole (it is not elementwise): a rank's shard of a sharded bucket holds pieces of
    parameters, which its own code would orthogonalise as if whole. Refused, naming why, nothing changed."""
    for rank, (message, unchanged) in td.launch(_whole_class_sharded, 2).items():
        assert "Muon cannot be stepped on the host, and its own code steps each parameter whole" in message, message
        assert "with a process_group param group 0's buckets hold this rank's pieces" in message, message
        assert unchanged, rank


def _elementwise_class_worker(rank, world, name):
    """``offload(cls)`` of an elementwise class (``torch.optim.SGD``: the generic rule, its own code; or
    ``zero_offload.Lion``: its rule, Lion's own code on the GPU), any piece of a parameter steppable, with a rank's
    shard of each bucket in each home, against the class itself every step."""
    _on_standins()
    from zero_offload import Lion, offload

    cls, kw = {"sgd": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9)), "lion": (Lion, dict(lr=1e-3))}[name]
    model, ref_model = td._make(rank, seed_ours=rank)
    opt = offload(cls, groups(model), bucket_numel=BUCKET, process_group=dist.group.WORLD, placement=MIX, timeout=30,
                  **kw)
    ref = cls(groups(ref_model), foreach=False, **kw)
    for step in range(STEPS):
        td._step(model, opt, step, rank, world)
        td._ref_step(ref_model, ref, step)
        _same(model, ref_model, opt, ref, f"{name}, step {step}")
    return _homes(opt)


@pytest.mark.parametrize("name", ["sgd", "lion"])
def test_an_elementwise_class_runs_its_own_code_on_parked_shards(name):
    for homes in td.launch(_elementwise_class_worker, 2, name).values():
        assert homes[0] == ["resident", "parked", "host"], homes

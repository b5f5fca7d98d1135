"""A parked bucket's reload in backward under FSDP2 (``fully_shard``) allocates its device copies on the compute
stream, not on the stream FSDP has current when it runs our hook.

FSDP2 runs the post-accumulate-grad hooks of a unit's parameters inside ``torch.cuda.stream(s)``, ``s`` its
reduce-scatter stream (its all-reduce stream under HSDP); a parked bucket's state comes up from there. Device memory
allocated with ``s`` current comes from ``s``'s pool of the caching allocator and goes back there when the write-back
frees it: the next forward's activations, on the compute stream, could not reuse it, nor could the reload reuse what
backward freed on the compute stream. So every such allocation must be made with the compute stream current, the
upload stream must wait for the compute stream before it writes that memory, and each copy must be handed to the
upload stream (``record_stream``) so that the allocator does not give it out again before the copy has run.

Checked on the CUDA stand-ins (tests/cuda_standins.py), with FSDP's own streams standing in too
(``installed(allocations=True)``: on the CPU mesh FSDP enters ``torch.cpu.stream(s)``, which makes a stand-in of
``s`` current, as a GPU would have ``s`` current; every stand-in device allocation is entered with
the stream current then), gloo, FSDP at world 2 and 1 (the reduce-scatter stream) and HSDP at world 2 (the all-reduce
stream), two micro-batches accumulated, clipped by ``opt.clip_grad_norm_``:

* some of the parked buckets' reloads ran in backward, each with FSDP's post-reduce stream current: the case under
  test happened (every bucket but the one holding ``logit_bias``, which gets no gradient on most steps and so is
  brought up at ``step()``, is reloaded in backward);
* every device allocation during every reload (a new tensor, or a storage given memory again) was made with the
  compute stream current;
* the upload stream waited for everything queued on the compute stream before the reload's copies, and every device
  copy was handed to the upload stream;
* parameters and both moments equal FSDP2 + ``torch.optim.AdamW(foreach=False)`` every step, with the clip's norm
  (tests/fsdp2_harness.py, default fp32 tolerance: the GPU update is torch's fused AdamW, within rounding of the
  for-loop one).

A resident bucket (``placement="resident"``, or ``"auto"`` moving every bucket there after two steps on the host
route, whose hooks FSDP runs with its stream current) allocates every device buffer with the compute stream
current, against AdamW every step: nothing of it is allocated from FSDP's hooks; in those two steps each bucket's
copy down waits for FSDP's stream, where the reduce-scatter wrote its gradients.

On a GPU (marked ``cuda``, skipped without one): the caching allocator's segment of each device copy belongs to
the compute stream, while FSDP's stream is current in the hook.

On ``main`` the second and third points fail (the copies allocated on FSDP's stream, the upload stream ordered
after it and not after the compute stream).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List

import pytest
import torch

import fsdp2_harness as h
from zero_offload import OffloadOptimizer

pytestmark = h.NEEDS_FSDP2

BUCKET = 16  # several buckets per FSDP unit
ADAMW = functools.partial(torch.optim.AdamW, foreach=False)
PARKED = functools.partial(OffloadOptimizer, bucket_numel=BUCKET, placement="parked")
RECIPES = {
    "fsdp": h.Recipe(clip=h.CLIP, clip_with="opt", accumulate=2),
    "hsdp": h.Recipe(mesh=(2, -1), clip=h.CLIP, clip_with="opt", accumulate=2),  # world 2: two replicas
}


def parked_reloads(rank: int, world: int, name: str) -> Dict[str, Any]:
    """Train RECIPES[name] with every GPU bucket parked, on the stand-ins with FSDP's streams standing in: each
    step's snapshot (rank 0) and, per step, each reload as the stand-ins saw it."""
    import cuda_standins
    from zero_offload.state.parked_home import ParkedHome

    recipe = RECIPES[name]
    real_reload, real_step = ParkedHome.reload, OffloadOptimizer.step
    phase = ["backward"]
    reloads: List[Dict[str, Any]] = []
    with cuda_standins.installed(allocations=True):
        ledger = cuda_standins.LEDGER
        compute = ledger.compute

        def reload(home, streams, *args, **kwargs):
            if home.twins is not None:
                return real_reload(home, streams, *args, **kwargs)
            current, up = torch.cuda.current_stream(), streams.up(home.device)
            compute.tick()  # (backward's kernels, queued on the compute stream until now)
            made, handed = len(ledger.allocations), len(ledger.handed)
            real_reload(home, streams, *args, **kwargs)
            twins = {t.untyped_storage()._cdata for t in home.twins.values()}
            reloads.append(dict(
                phase=phase[0], current=current, home=id(home),
                streams=[a.stream.name for a in ledger.allocations[made:]],
                storages={a.storage for a in ledger.allocations[made:]} == twins,
                up_after_compute=up.waits_for(compute),
                handed_up=twins <= {storage for storage, s in ledger.handed[handed:] if s is up}))

        def step(opt, *args, **kwargs):
            phase[0] = "step"
            try:
                return real_step(opt, *args, **kwargs)
            finally:
                phase[0] = "backward"

        ParkedHome.reload, OffloadOptimizer.step = reload, step
        try:
            loop = h.make_loop(world, recipe, PARKED)
            parked = {id(b.home) for g in loop.opt._buckets for b in g if b.home.kind == "parked"}
            snaps, per_step = [], []
            for n in range(h.STEPS):
                del reloads[:]
                norm = h.train_step(loop, recipe, n, rank, world)
                snaps.append(h.snapshot(loop, norm, rank, last=n == h.STEPS - 1))
                per_step.append(list(reloads))
            # Which of FSDP's streams runs its post-accumulate-grad hooks (private: FSDP's comm context; the
            # all-reduce stream under HSDP, the reduce-scatter stream otherwise).
            comm = loop.model._get_fsdp_state()._comm_ctx
            post_reduce = comm.all_reduce_stream if recipe.mesh else comm.reduce_scatter_stream
            expected = ledger.fsdp.get(id(post_reduce))
        finally:
            ParkedHome.reload, OffloadOptimizer.step = real_reload, real_step
    for entries in per_step:
        for entry in entries:
            entry["current"] = ("compute" if entry["current"] is compute else "FSDP's post-reduce stream"
                                if entry["current"] is expected else entry["current"].name)
    return dict(snaps=snaps if rank == 0 else None, reloads=per_step, parked=len(parked),
                fsdp_streams=len(ledger.fsdp))


def resident_allocations(rank: int, world: int, placement: str) -> Dict[str, Any]:
    """Train RECIPES["fsdp"] with ``placement`` ``"resident"``, or ``"auto"`` where the cost model makes every bucket
    resident after the first two steps (room on the GPU, a slow CPU kernel), on the stand-ins with FSDP's streams
    standing in and every device allocation watched: each step's snapshot (rank 0), the stream current at each
    device allocation and in each of our gradient hooks, by step, and the homes the buckets end in."""
    import cuda_standins
    from zero_offload.grad_stream import GradStreamer

    recipe, real_on_grad = RECIPES["fsdp"], GradStreamer._on_grad
    hooked: List[Any] = []  # (the stream current in each hook; whether the copy stream waited for it where sent)

    def on_grad(streamer, watch):
        current = torch.cuda.current_stream()
        current.tick()  # (FSDP's reduce-scatter wrote this gradient there)
        real_on_grad(streamer, watch)
        sent = watch.fired == watch.expected  # (the bucket's last gradient: its copy down was issued)
        hooked.append((current.name, streamer._transport.streams.down(watch.lane.bucket.device).waits_for(current)
                       if sent else None))

    measures = (h.auto_measures(1 << 40, kernel=1e6, copy_rate=1e15, allocations=True) if placement == "auto"
                else cuda_standins.installed(allocations=True))
    with measures:
        ledger = cuda_standins.LEDGER
        GradStreamer._on_grad = on_grad
        try:
            loop = h.make_loop(world, recipe, functools.partial(OffloadOptimizer, bucket_numel=BUCKET,
                                                                placement=placement))
            built = [a.stream.name for a in ledger.allocations]
            snaps, steps = [], []
            for n in range(h.STEPS):
                made, hooks = len(ledger.allocations), len(hooked)
                norm = h.train_step(loop, recipe, n, rank, world)
                steps.append(dict(allocated=[a.stream.name for a in ledger.allocations[made:]],
                                  hooks=hooked[hooks:]))
                snaps.append(h.snapshot(loop, norm, rank, last=n == h.STEPS - 1))
        finally:
            GradStreamer._on_grad = real_on_grad
    return dict(snaps=snaps if rank == 0 else None, steps=steps, built=built,
                homes=[b.home.kind for g in loop.opt._buckets for b in g], fsdp_streams=len(ledger.fsdp))


def _jobs(world: int) -> Dict[str, Any]:
    names = list(RECIPES) if world == 2 else ["fsdp"]
    jobs: Dict[str, Any] = {}
    for name in names:
        jobs[f"adamw/{name}"] = h.Job(RECIPES[name], ADAMW)
        jobs[f"parked/{name}"] = h.Call(parked_reloads, (name,))
    if world == 2:
        for placement in ("resident", "auto"):
            jobs[f"{placement}/fsdp"] = h.Call(resident_allocations, (placement,))
    return jobs


@pytest.fixture(scope="module")
def world2():
    return h.run_jobs(2, _jobs(2), timeout=300)


@pytest.fixture(scope="module")
def world1():
    return h.run_jobs(1, _jobs(1), timeout=200)


def _check(outcomes, name: str) -> None:
    what = f"parked/{name}"
    ref = outcomes[f"adamw/{name}"].get()
    for rank, report in outcomes[what].per_rank.items():
        assert report["fsdp_streams"] > 0, f"{what} rank {rank}: FSDP entered none of its streams"
        assert report["parked"] > 1, (what, rank, report["parked"])
        in_backward = set()
        for step, reloads in enumerate(report["reloads"]):
            where = f"{what} rank {rank} step {step}"
            assert reloads, f"{where}: nothing was reloaded"
            for r in reloads:
                # Reloaded from FSDP's hook (its post-reduce stream current), or at step() (the compute stream).
                assert r["current"] == ("FSDP's post-reduce stream" if r["phase"] == "backward" else "compute"), \
                    (where, r)
                assert r["streams"], f"{where}: a reload allocated nothing"
                assert set(r["streams"]) == {"compute"}, \
                    f"{where}: a reload in {r['phase']} allocated on {r['streams']}, not only on the compute stream"
                assert r["storages"], f"{where}: the allocations seen were not the reload's device copies"
                assert r["up_after_compute"], f"{where}: the upload stream did not wait for the compute stream"
                assert r["handed_up"], f"{where}: a device copy was not handed to the upload stream"
            assert any(r["phase"] == "backward" for r in reloads), f"{where}: no reload in backward"
            in_backward |= {r["home"] for r in reloads if r["phase"] == "backward"}
        # Every parked bucket but the one whose logit_bias has no gradient on most steps came up in backward.
        assert len(in_backward) >= report["parked"] - 1, (what, rank, len(in_backward), report["parked"])
    h.assert_same(ref, outcomes[what].value["snaps"], what)


@pytest.mark.parametrize("name", list(RECIPES))
def test_parked_reloads_under_fsdp2_allocate_on_the_compute_stream(world2, name):
    _check(world2, name)


def test_parked_reloads_on_one_rank_allocate_on_the_compute_stream(world1):
    _check(world1, "fsdp")


@pytest.mark.parametrize("placement", ["resident", "auto"])
def test_resident_buckets_allocate_nothing_on_fsdps_streams(world2, placement):
    """A resident bucket (``placement="resident"``, or made so by ``"auto"`` after its first two steps on the host
    route, whose hooks run with FSDP's stream current) allocates every device buffer with the compute stream current:
    as it is built, in backward's hooks (none of its own) and at ``step()``; the host route's copies down from
    FSDP's hooks wait for FSDP's stream; against AdamW every step."""
    what = f"{placement}/fsdp"
    for rank, report in world2[what].per_rank.items():
        where = f"{what} rank {rank}"
        assert report["fsdp_streams"] > 0, f"{where}: FSDP entered none of its streams"
        assert set(report["homes"]) == {"resident"}, (where, report["homes"])
        # (Built, a resident bucket's state is made on the GPU; auto's buckets start on the host and move at step().)
        assert set(report["built"]) <= {"compute"} and (report["built"] or placement == "auto"), \
            (where, report["built"])
        for step, seen in enumerate(report["steps"]):
            assert set(seen["allocated"]) <= {"compute"}, \
                f"{where} step {step}: device buffers allocated on {sorted(set(seen['allocated']))}"
            # The host route's hooks (auto's first two steps) run from FSDP's hooks, with its stream current; each
            # bucket's copy down waits for that stream, where its gradients were written.
            assert all(s.startswith("FSDP's") for s, _ in seen["hooks"]), (where, step, seen["hooks"])
            assert all(waited is not False for _, waited in seen["hooks"]), \
                f"{where} step {step}: a copy down did not wait for FSDP's stream, where the gradients were written"
            if placement == "auto" and step < 2:
                assert any(waited for _, waited in seen["hooks"]), f"{where} step {step}: no bucket sent from a hook"
        assert any(seen["allocated"] for seen in report["steps"]) or placement == "resident", \
            f"{where}: nothing allocated in any step (auto's move makes the resident state there)"
    h.assert_same(world2["adamw/fsdp"].get(), world2[what].value["snaps"], what)


# ---------------------------------------------------------------------------------------------------- CUDA --
@pytest.mark.cuda
def test_parked_reloads_come_from_the_compute_streams_pool_on_a_gpu(tmp_path):
    """One GPU (NCCL, world 1), every bucket parked: each reload FSDP's hook issues in backward runs with FSDP's
    stream current, and the caching allocator's segment holding each device copy belongs to the compute stream
    (``torch.cuda.memory_snapshot()``'s ``stream``); parameters and both moments equal FSDP2 +
    ``AdamW(foreach=False)`` every step (default fp32 tolerance: torch's fused AdamW on the GPU)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from zero_offload.state.parked_home import ParkedHome

    if not dist.is_nccl_available():
        pytest.skip("NCCL is not available")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    real_reload = ParkedHome.reload
    seen: List[Any] = []

    def reload(home, streams, *args, **kwargs):
        up = home.twins is not None
        current = torch.cuda.current_stream()
        real_reload(home, streams, *args, **kwargs)
        if not up:
            seen.append((current, [t.data_ptr() for t in home.twins.values()]))

    ParkedHome.reload = reload
    try:
        mesh = init_device_mesh("cuda", (1,))
        compute = torch.cuda.current_stream()
        runs = {}
        for name, make in (("adamw", ADAMW), ("ours", PARKED)):
            torch.manual_seed(0)
            model = h.Net().cuda()
            for module in (*model.blocks, model):
                fully_shard(module, mesh=mesh)
            opt = make(model.parameters(), lr=h.LR, weight_decay=h.WEIGHT_DECAY)
            steps = []
            for step in range(4):
                opt.zero_grad()
                del seen[:]
                ids = h.tokens(step).cuda()
                logits = model(ids[:, :-1], step % 3 == 1)
                F.cross_entropy(logits.float().reshape(-1, h.VOCAB), ids[:, 1:].reshape(-1)).backward()
                if name == "ours":
                    assert seen, f"step {step}: no reload in backward"
                    assert all(current != compute for current, _ in seen), \
                        f"step {step}: FSDP ran the hook with the compute stream current (nothing to check)"
                    pools = {}
                    for segment in torch.cuda.memory_snapshot():
                        for current, ptrs in seen:
                            for ptr in ptrs:
                                if segment["address"] <= ptr < segment["address"] + segment["total_size"]:
                                    pools[ptr] = segment["stream"]
                    ptrs = [ptr for _, ptrs in seen for ptr in ptrs]
                    assert set(pools) == set(ptrs), f"step {step}: a device copy in no segment"
                    assert set(pools.values()) == {compute.cuda_stream}, \
                        f"step {step}: device copies in the pools of streams {set(pools.values())}, not the compute " \
                        f"stream's ({compute.cuda_stream})"
                opt.step()
                with torch.no_grad():
                    params = list(model.parameters())
                    now = {f"parameter {i}": p.to_local().clone() for i, p in enumerate(params)}
                    for i, p in enumerate(params):
                        for k, v in (opt.state[p].items() if p in opt.state else ()):
                            if k != "step":
                                now[f"parameter {i} {k}"] = v.to_local().clone()
                    steps.append(now)
            runs[name] = steps
        for step, (ref, ours) in enumerate(zip(runs["adamw"], runs["ours"])):
            assert ref.keys() <= ours.keys(), (step, sorted(ref.keys() - ours.keys()))
            for key, value in ref.items():
                torch.testing.assert_close(ours[key], value, msg=lambda m: f"step {step}, {key}: {m}")
    finally:
        ParkedHome.reload = real_reload
        dist.destroy_process_group()

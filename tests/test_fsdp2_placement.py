"""``placement`` under FSDP2 (``fully_shard``): each rank's shards' state in the home ``placement`` gives it (on the
host, resident on the GPU, parked on the host and stepped on the GPU, or all three in one param group), on CPU with
gloo at world 2 and 1, the GPU's route on the CUDA stand-ins of tests/cuda_standins.py (the buckets told they are on
``cuda:0``; FSDP itself runs on the CPU mesh; torch's fused CPU AdamW stands in for its CUDA kernel). Against
FSDP2 + ``torch.optim.AdamW(foreach=False)`` on the same model (tests/fsdp2_harness.py): parameters, both moments,
the clip's norm, every step, with clipping (``opt.clip_grad_norm_`` and torch's) and two accumulated micro-batches,
at default fp32 ``assert_close`` tolerance (the host buckets run our kernel, the GPU-stepped ones torch's fused one:
both AdamW within float rounding, docs/twin-flow.md). Also: an inf/nan in one rank's gradient changes no home on any
rank; a DCP checkpoint saved under one placement resumes under another; ``placement="auto"`` ends with the same
home per bucket on every rank when the ranks measured differently.

All jobs of one world size run in one spawn (fixtures ``world2`` and ``world1``); the tests read their outcomes.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Dict, List

import pytest
import torch

import fsdp2_harness as h
from zero_offload import OffloadOptimizer

pytestmark = h.NEEDS_FSDP2

BUCKET = 16  # several buckets per FSDP unit: a dict's shares put buckets of one group in each home
MIX = {"resident": 0.3, "parked": 0.4}
PLACEMENTS = {"host": "host", "parked": "parked", "resident": "resident", "mix": MIX}
ADAMW = functools.partial(torch.optim.AdamW, foreach=False)
RECIPES = {  # every step clipped (the model's norm is 2.6 to 4.4), two micro-batches accumulated
    "clip_opt": h.Recipe(clip=h.CLIP, clip_with="opt", accumulate=2),
    "clip_torch": h.Recipe(clip=h.CLIP, clip_with="torch", accumulate=2),
}
# The mix under HSDP (world 2: two replicas of whole parameters, each piece counted once in the norm) and under
# MixedPrecisionPolicy (bf16 all-gathers, fp32 shards and reduced gradients).
MIX_RECIPES = {
    "hsdp": h.Recipe(mesh=(2, -1), clip=h.CLIP, clip_with="opt", accumulate=2),
    "mixed_precision": h.Recipe(mixed_precision=True, clip=h.CLIP, clip_with="opt"),
}
SAVE_AT = 3


def ours(placement: str) -> Any:
    return functools.partial(OffloadOptimizer, bucket_numel=BUCKET, placement=PLACEMENTS[placement])


def _homes(opt) -> List[List[str]]:
    return [[b.home.kind for b in group] for group in opt._buckets]


def homes_of(rank: int, world: int, placement: str) -> List[List[str]]:
    """Each bucket's home, as built (the stand-ins installed: the buckets are told they are on a GPU)."""
    import cuda_standins

    with cuda_standins.installed():
        model = h.build_model(world, RECIPES["clip_opt"])
        return _homes(ours(placement)(model.parameters(), lr=h.LR))


def _locals(model, opt) -> Dict[str, torch.Tensor]:
    """This rank's parameters and state, local tensors copied: what a step that changes nothing leaves alike."""
    out = {f"param {n}": p.detach().to_local().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, value in opt.state.get(p, {}).items():
            out[f"state {n}[{key}]"] = (value.to_local() if hasattr(value, "to_local") else value).clone()
    return out


def nonfinite_changes_nothing(rank: int, world: int, placement: str, policy: str) -> Dict[str, Any]:
    """Three steps, then an inf in one parameter's gradient on rank ``world - 1`` only (a parked bucket's, its state
    brought up in backward where the placement parks), ``nonfinite=policy``: what changed on this rank, what the
    step raised, the device copies still held; then one more step, to see the optimizer goes on."""
    import cuda_standins

    with cuda_standins.installed():
        model = h.build_model(world, h.RECIPES["plain"])
        opt = OffloadOptimizer(model.parameters(), lr=h.LR, weight_decay=h.WEIGHT_DECAY, bucket_numel=BUCKET,
                               placement=PLACEMENTS[placement], nonfinite=policy)
        recipe = RECIPES["clip_opt"]
        for step in range(3):
            h.train_step(h.Loop(model, opt), recipe, step, rank, world)
        before = _locals(model, opt)
        opt.zero_grad()
        h.loss_on(model, 3, 0, rank, world).backward()
        target = next((b.owners[0] for g in opt._buckets for b in g if b.home.kind == "parked"),
                      next(iter(model.parameters())))
        if rank == world - 1:
            target.grad.to_local().view(-1)[0] = math.inf
        raised = None
        try:
            opt.step()
        except RuntimeError as exc:
            raised = str(exc)
        after = _locals(model, opt)
        changed = [k for k, v in before.items() if not torch.equal(v, after[k])]
        held = [b.where for g in opt._buckets for b in g if getattr(b.home, "twins", None) is not None]
        h.train_step(h.Loop(model, opt), recipe, 4, rank, world)
        moved = [k for k, v in after.items() if k.startswith("param") and not torch.equal(v, _locals(model, opt)[k])]
        return dict(changed=changed, raised=raised, held=held, homes=_homes(opt), moved_after=moved)


def auto_agrees(rank: int, world: int) -> Dict[str, Any]:
    """``placement="auto"`` where the ranks measure differently: rank 0 has room for every bucket's state on its GPU
    (the cost model makes them resident), the others have none beyond the margin (it parks them). Each rank's own
    plan and the homes it ends with; and the run beside AdamW (snapshots, rank 0's)."""
    free = (1 << 40) if rank == 0 else 2**30  # (gpu_margin_gib=1: no room beyond it on the other ranks)
    with h.auto_measures(free, kernel=1e6, copy_rate=1e15) as plans:
        loop = h.make_loop(world, RECIPES["clip_opt"], functools.partial(
            OffloadOptimizer, bucket_numel=BUCKET, placement="auto", gpu_margin_gib=1.0))
        snaps = []
        for step in range(h.STEPS):
            norm = h.train_step(loop, RECIPES["clip_opt"], step, rank, world)
            snaps.append(h.snapshot(loop, norm, rank, last=step == h.STEPS - 1))
    return dict(plans=plans, homes=_homes(loop.opt), snaps=snaps)


def gpu_fraction_auto(rank: int, world: int) -> Dict[str, Any]:
    """``gpu_fraction="auto"`` (the stand-in GPU has room for everything): the homes after the run and the run."""
    import cuda_standins

    with cuda_standins.installed():
        loop = h.make_loop(world, RECIPES["clip_opt"], functools.partial(OffloadOptimizer, bucket_numel=BUCKET,
                                                                         gpu_fraction="auto"))
        costs = [b.device_cost() for g in loop.opt._buckets for b in g]  # (what the move is told it will take)
        snaps = []
        for step in range(h.STEPS):
            norm = h.train_step(loop, RECIPES["clip_opt"], step, rank, world)
            snaps.append(h.snapshot(loop, norm, rank, last=step == h.STEPS - 1))
    held = [sum(b.device_bytes().values()) for g in loop.opt._buckets for b in g]
    return dict(homes=_homes(loop.opt), snaps=snaps, costs=costs, held=held)


def whole_class_refused(rank: int, world: int) -> Dict[str, Any]:
    """``offload(torch.optim.Muon)`` parked over FSDP2's 2-D parameters: this rank's shards are pieces of them, which
    Muon's own code (not elementwise) would step as if whole. The refusal, and whether anything changed."""
    import cuda_standins
    from zero_offload import offload

    with cuda_standins.installed():
        model = h.build_model(world, RECIPES["clip_opt"])
        matrices = [p for p in model.parameters() if p.ndim == 2]
        before = [p.detach().to_local().clone() for p in matrices]
        try:
            offload(torch.optim.Muon, matrices, lr=0.02, placement="parked")
            message = "built"
        except ValueError as exc:
            message = str(exc)
        return dict(message=message, unchanged=all(torch.equal(p.detach().to_local(), b)
                                                   for p, b in zip(matrices, before)))


def _jobs(world: int) -> Dict[str, Any]:
    jobs: Dict[str, Any] = {}
    for name, recipe in RECIPES.items():
        jobs[f"adamw/{name}"] = h.Job(recipe, ADAMW)
        for placement in PLACEMENTS if world == 2 else ("mix",):
            jobs[f"{placement}/{name}"] = h.Job(recipe, ours(placement), standins=True)
    if world == 2:
        for name, recipe in MIX_RECIPES.items():
            jobs[f"adamw/{name}"] = h.Job(recipe, ADAMW)
            jobs[f"mix/{name}"] = h.Job(recipe, ours("mix"), standins=True)
        # release_grads: a parked bucket's gradients are read at step(), where FSDP left them (not let go in backward).
        jobs["mix_release/clip_opt"] = h.Job(RECIPES["clip_opt"], functools.partial(ours("mix"), release_grads=True),
                                             standins=True)
        for placement in PLACEMENTS:
            jobs[f"homes/{placement}"] = h.Call(homes_of, (placement,))
        for policy in ("skip", "raise"):
            jobs[f"nonfinite/{policy}"] = h.Call(nonfinite_changes_nothing, ("mix", policy))
        # A checkpoint saved under one placement (parked; the mix) resumes under another, beside AdamW's run.
        recipe = RECIPES["clip_opt"]
        jobs["save/parked"] = h.Job(recipe, ours("parked"), save_as="parked", save_at=SAVE_AT, standins=True)
        jobs["save/mix"] = h.Job(recipe, ours("mix"), save_as="mix", save_at=SAVE_AT, standins=True)
        jobs["resume/parked->host"] = h.Job(recipe, ours("host"), start_from=("parked", SAVE_AT), standins=True)
        jobs["resume/parked->resident"] = h.Job(recipe, ours("resident"), start_from=("parked", SAVE_AT),
                                                standins=True)
        jobs["resume/mix->parked"] = h.Job(recipe, ours("parked"), start_from=("mix", SAVE_AT), standins=True)
        jobs["auto/agrees"] = h.Call(auto_agrees)
        jobs["auto/gpu_fraction"] = h.Call(gpu_fraction_auto)
        jobs["whole/muon"] = h.Call(whole_class_refused)
    return jobs


@pytest.fixture(scope="module")
def world2():
    return h.run_jobs(2, _jobs(2), timeout=600)


@pytest.fixture(scope="module")
def world1():
    return h.run_jobs(1, _jobs(1), timeout=300)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_each_placement_makes_the_homes_it_names(world2, placement):
    for rank, homes in world2[f"homes/{placement}"].per_rank.items():
        kinds = {kind for group in homes for kind in group}
        expected = {"host", "resident", "parked"} if placement == "mix" else {placement}
        assert kinds == expected, (rank, homes)
        if placement == "mix":  # (all three in one param group)
            assert set(homes[0]) == expected, (rank, homes)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_each_placement_matches_adamw_every_step(world2, placement, recipe):
    h.assert_same(world2[f"adamw/{recipe}"].get(), world2[f"{placement}/{recipe}"].get(), f"{placement} {recipe}")


@pytest.mark.parametrize("recipe", list(MIX_RECIPES))
def test_every_home_under_hsdp_and_mixed_precision_matches_adamw_every_step(world2, recipe):
    h.assert_same(world2[f"adamw/{recipe}"].get(), world2[f"mix/{recipe}"].get(), f"mix {recipe}")


def test_every_home_with_release_grads_matches_adamw_every_step(world2):
    h.assert_same(world2["adamw/clip_opt"].get(), world2["mix_release/clip_opt"].get(), "mix, release_grads")


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_one_rank_with_every_home_matches_adamw_every_step(world1, recipe):
    h.assert_same(world1[f"adamw/{recipe}"].get(), world1[f"mix/{recipe}"].get(), f"world 1 mix {recipe}")


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_nonfinite_gradient_on_one_rank_leaves_every_home_as_it_was(world2, policy):
    for rank, out in world2[f"nonfinite/{policy}"].per_rank.items():
        assert {k for g in out["homes"] for k in g} == {"host", "resident", "parked"}, (rank, out["homes"])
        assert out["changed"] == [], (rank, out["changed"])
        assert out["held"] == [], (rank, "device copies kept", out["held"])
        if policy == "raise":
            assert out["raised"] is not None and "inf" in out["raised"], (rank, out["raised"])
        else:
            assert out["raised"] is None, (rank, out["raised"])
        assert out["moved_after"], (rank, "the next step updated nothing")


@pytest.mark.parametrize("resumed", ["parked->host", "parked->resident", "mix->parked"])
def test_a_dcp_checkpoint_saved_under_one_placement_resumes_under_another(world2, resumed):
    adamw = world2["adamw/clip_opt"].get()
    saved = world2[f"save/{resumed.split('->')[0]}"].get()
    h.assert_same(adamw, saved, f"saving {resumed}")  # (the save changed nothing)
    h.assert_same(adamw, world2[f"resume/{resumed}"].get(), f"resumed {resumed}", first=SAVE_AT)


def test_auto_ends_with_the_same_homes_on_every_rank(world2):
    """Rank 0's plan makes every bucket resident, rank 1's parks them (or leaves some on the host): both end with,
    for each bucket, the choice of the two that needs the least GPU memory; and the run is AdamW's."""
    out = world2["auto/agrees"].per_rank
    plans = {rank: o["plans"][-1] for rank, o in out.items()}
    assert set(plans[0]) == {"resident"} and "resident" not in plans[1], plans
    assert "parked" in plans[1], plans
    order = ("host", "parked", "resident")
    agreed = [order[min(order.index(plans[r][i]) for r in plans if i < len(plans[r]))] for i in range(len(plans[0]))]
    for rank, o in out.items():
        assert [home for group in o["homes"] for home in group] == agreed, (rank, o["homes"], agreed)
    h.assert_same(world2["adamw/clip_opt"].get(), out[0]["snaps"], "auto")


def test_gpu_fraction_auto_moves_every_rank_s_buckets_to_the_gpu_and_matches_adamw(world2):
    out = world2["auto/gpu_fraction"].per_rank
    for rank, o in out.items():
        assert {home for group in o["homes"] for home in group} == {"resident"}, (rank, o["homes"])
        # The device memory each bucket was priced at is what it holds there (moments and its own fp32 master).
        assert o["costs"] == o["held"] and all(o["held"]), (rank, o["costs"], o["held"])
    h.assert_same(world2["adamw/clip_opt"].get(), out[0]["snaps"], "gpu_fraction='auto'")


def test_a_class_run_whole_is_refused_over_fsdp2s_shards(world2):
    """Muon is not elementwise: over FSDP2's shards (pieces of each matrix at world 2) it is refused, naming why,
    with nothing changed."""
    for rank, out in world2["whole/muon"].per_rank.items():
        assert "Muon cannot be stepped on the host, and its own code steps each parameter whole; with FSDP2" in \
            out["message"], out["message"]
        assert out["unchanged"], rank

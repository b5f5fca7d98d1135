"""A GPU home under FSDP2 takes over the storage FSDP keeps for each shard (issue 52), as the host's does: on the
CUDA stand-ins of tests/cuda_standins.py (the buckets told they are on ``cuda:0``, FSDP itself on the CPU mesh with
gloo), at world 1 and 2.

* Storage: every parameter of a resident or parked bucket of fp32 shards is its master's slot (its ``to_local()``
  and FSDP's padded ``_sharded_param_data`` lie in the master buffer), no separate master exists, and a parked one
  parks its moments only; a bf16 model's shards are the staging slots the fused update writes (no staging copy
  beside them). The byte figures, written here from docs/placement.md's arithmetic per parameter of the padded
  layout (fp32: parked 8 B on the host, up and down, and on the GPU while stepped; resident 8 B on the GPU; bf16:
  12 B, the fp32 master besides), equal the buckets' ``estimate()`` and ``device_bytes()``.
* A bf16 model's shards (resident, parked), each step from the second beside ``torch.optim.AdamW(foreach=False)``
  over fp32 copies of ours' masters with ours' moments and step counts: masters and moments at fp32 tolerance, each
  shard bit for bit its master rounded (the update wrote it).
* After FSDP re-makes the shards' storage (``model.to(torch.device("cpu", 0))`` onto the device they are on, which
  copies; before and after backward), training goes on as ``torch.optim.AdamW(foreach=False)`` given the same
  change: parameters and both moments every step, clipped, two micro-batches accumulated, at default fp32
  tolerance (our host buckets run our kernel, the GPU ones torch's fused one: both AdamW within float rounding);
  a cast (``model.to(torch.float64)``) is refused naming it, with nothing changed.

The runs beside AdamW with the shards taken over (clipping, accumulation, HSDP, an inf on one rank, DCP resume
under another placement, ``gpu_fraction="auto"`` moving buckets onto the GPU) are tests/test_fsdp2_placement.py's,
which now step the taken-over shards.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List

import pytest
import torch

import fsdp2_harness as h
from aliasing import lies_in
from zero_offload import OffloadOptimizer

pytestmark = h.NEEDS_FSDP2

BUCKET = 16
MIX = {"resident": 0.3, "parked": 0.4}
RECIPE = h.Recipe(clip=h.CLIP, clip_with="opt", accumulate=2)
REMAKE_AT = 2
ADAMW = functools.partial(torch.optim.AdamW, foreach=False)


def storage(rank: int, world: int, dtype: str) -> List[Dict[str, Any]]:
    """Two steps of the mix (``MIX``) over a model of ``dtype``; per bucket stepped on the GPU, where its
    parameters live and what it holds."""
    import cuda_standins

    with cuda_standins.installed():
        model = h.build_model(world, RECIPE, model=None if dtype == "fp32" else _bf16_net())
        opt = OffloadOptimizer(model.parameters(), lr=h.LR, bucket_numel=BUCKET, placement=MIX)
        for step in range(2):
            h.train_step(h.Loop(model, opt), RECIPE, step, rank, world)
        out = []
        records = {id(r.sharded_param): r for r in _records(model)}
        for group in opt._buckets:
            for b in group:
                if b.home.kind == "host":
                    continue
                slots = b.staging if b.low_precision else b.master
                home = b.home
                out.append(dict(
                    kind=home.kind, padded=b.layout.padded_numel, separate=b.masters.separate,
                    route=type(opt._transport.lanes[_lane(opt, b)].route).__name__,
                    shards_in_slots=all(lies_in(p.to_local(), [slots], storage=True) for p in b.owners if p.to_local().numel()),
                    fsdp_in_slots=all(lies_in(records[id(p)]._sharded_param_data, [slots], storage=True) for p in b.owners),
                    master_on_gpu=not b.masters.separate or home.tier.host is False,
                    parked=sorted(home.parked()) if home.kind == "parked" else None,
                    nbytes_parked=home.nbytes_parked() if home.kind == "parked" else None,
                    device_bytes=b.device_bytes(), cost=vars(b.estimate().homes[home.kind])))
        return out


def _bf16_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return h.Net().to(torch.bfloat16)


def _records(model) -> List[Any]:
    from zero_offload import fsdp2

    mine = {id(p) for p in model.parameters()}
    return [r for _, r, _ in fsdp2.registry().values() if id(r.sharded_param) in mine]


def _lane(opt, bucket) -> int:
    return next(i for i, lane in enumerate(opt._transport.lanes) if lane.bucket is bucket)


def remade(rank: int, world: int, placement: Any, after_backward: bool) -> Dict[str, Any]:
    """AdamW, then ours under ``placement``, each trained ``h.STEPS`` steps of ``RECIPE`` with
    ``model.to(torch.device("cpu", 0))`` at step ``REMAKE_AT`` (before or after its backward): snapshots (rank
    0's), and whether FSDP re-made every shard's storage there."""
    import cuda_standins

    out: Dict[str, Any] = {}
    for name, make in (("adamw", ADAMW), ("ours", functools.partial(OffloadOptimizer, bucket_numel=BUCKET,
                                                                     placement=placement))):
        with cuda_standins.installed() if name == "ours" else _nothing():
            loop = h.make_loop(world, RECIPE, make)
            snaps, remade_all = [], None
            for step in range(h.STEPS):
                norm = _step(loop, step, rank, world, after_backward if step == REMAKE_AT else None)
                if step == REMAKE_AT:
                    remade_all = loop.model._remade
                snaps.append(h.snapshot(loop, norm, rank, last=step == h.STEPS - 1))
        out[name] = snaps
        out[f"{name}_remade"] = remade_all
    return out


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _remake(model) -> None:
    before = [p.to_local().untyped_storage().data_ptr() for p in model.parameters()]
    model.to(torch.device("cpu", 0))
    model._remade = all(p.to_local().untyped_storage().data_ptr() != b for p, b in zip(model.parameters(), before)
                        if p.to_local().numel())


def _step(loop, step: int, rank: int, world: int, after_backward) -> float:
    """``h.train_step`` of ``RECIPE`` with the storage re-made before (``after_backward`` False) or after (True)
    backward (None: not)."""
    model, opt = loop.model, loop.opt
    if after_backward is False:
        _remake(model)
    opt.zero_grad(set_to_none=True)
    for micro in range(RECIPE.accumulate):
        model.set_requires_gradient_sync(micro == RECIPE.accumulate - 1)
        (h.loss_on(model, step, micro, rank, world) / RECIPE.accumulate).backward()
    if after_backward:
        _remake(model)
    if hasattr(opt, "clip_grad_norm_"):
        norm = opt.clip_grad_norm_(RECIPE.clip)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE.clip)
    opt.step()
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def cast_refused(rank: int, world: int, placement: str) -> Dict[str, Any]:
    """A step after FSDP re-made the shards' storage as float64 (``model.to(torch.float64)``): the refusal, and
    whether the optimizer's state changed."""
    import cuda_standins

    with cuda_standins.installed():
        model = h.build_model(world, RECIPE)
        opt = OffloadOptimizer(model.parameters(), lr=h.LR, bucket_numel=BUCKET, placement=placement)
        for step in range(2):
            h.train_step(h.Loop(model, opt), RECIPE, step, rank, world)
        opt.zero_grad()
        h.loss_on(model, 2, 0, rank, world).backward()
        message, unchanged = h.step_after_cast(model, opt)
        return dict(message=message, unchanged=unchanged)


def bf16_steps(rank: int, world: int, placement: Any) -> List[str]:
    """A bf16 model's shards taken over (their fp32 masters separate): each step from the second, beside
    ``torch.optim.AdamW(foreach=False)`` over fp32 copies of ours' masters given ours' moments and step counts and
    the bf16 gradients upcast: the masters and moments after the step (fp32 tolerance), and each shard equal, bit
    for bit, to its master rounded to bf16 (the update wrote the shard itself). Returns the problems."""
    import cuda_standins

    problems: List[str] = []
    with cuda_standins.installed():
        model = h.build_model(world, RECIPE, model=_bf16_net())
        opt = OffloadOptimizer(model.parameters(), lr=h.LR, weight_decay=h.WEIGHT_DECAY, bucket_numel=BUCKET,
                               placement=placement)
        names = {p: n for n, p in model.named_parameters()}
        for step in range(4):
            opt.zero_grad()
            h.loss_on(model, step, 0, rank, world).backward()
            held = [p for p in model.parameters() if p.grad is not None and opt.state.get(p)]
            copies = {p: torch.nn.Parameter(opt.state[p]["master"].to_local().clone()) for p in held}
            ref = torch.optim.AdamW(list(copies.values()) or [torch.nn.Parameter(torch.zeros(1))], lr=h.LR,
                                    weight_decay=h.WEIGHT_DECAY, foreach=False)
            for p, q in copies.items():
                q.grad = p.grad.to_local().float()
                ref.state[q] = {k: (v.to_local() if hasattr(v, "to_local") else v).clone()
                                for k, v in opt.state[p].items() if k != "master"}
            opt.step()
            ref.step()
            for p, q in copies.items():
                mine = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in opt.state[p].items()}
                for key, value in (("master", q.detach()), *((k, ref.state[q][k]) for k in ("exp_avg", "exp_avg_sq"))):
                    try:
                        torch.testing.assert_close(mine[key], value)
                    except AssertionError as exc:
                        problems.append(f"step {step} {names[p]}[{key}]: {str(exc).splitlines()[0]}")
                if not torch.equal(p.to_local(), mine["master"].to(torch.bfloat16)):
                    problems.append(f"step {step} {names[p]}: the shard is not its master rounded")
        if not copies:
            problems.append("nothing compared at the last step")
    return problems


PLACEMENTS = {"resident": "resident", "parked": "parked", "mix": MIX}


def _jobs(world: int) -> Dict[str, Any]:
    jobs: Dict[str, Any] = {f"storage/{d}": h.Call(storage, (d,)) for d in ("fp32", "bf16")}
    for name in ("resident", "parked"):
        jobs[f"bf16/{name}"] = h.Call(bf16_steps, (name,))
    for name, placement in PLACEMENTS.items():
        for after in (False, True):
            if world == 1 and name != "mix":
                continue
            jobs[f"remade/{name}/{after}"] = h.Call(remade, (placement, after))
    if world == 2:
        for name in ("resident", "parked"):
            jobs[f"cast/{name}"] = h.Call(cast_refused, (name,))
    return jobs


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def world(request):
    return request.param, h.run_jobs(request.param, _jobs(request.param), timeout=600)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_gpu_home_takes_over_the_shards_storage(world, dtype):
    size, out = world
    for rank, buckets in out[f"storage/{dtype}"].per_rank.items():
        assert {b["kind"] for b in buckets} == {"resident", "parked"}, (rank, buckets)
        for b in buckets:
            where = (size, rank, b)
            assert b["shards_in_slots"] and b["fsdp_in_slots"], where
            assert b["route"] == {"resident": "DeviceTierRoute", "parked": "ParkedRoute"}[b["kind"]], where
            n, low = b["padded"], dtype == "bf16"
            state = 8 * n  # the moments
            master = 4 * n if low else 0  # the fp32 master of bf16 shards; fp32 shards are their own
            assert b["separate"] == low, where
            if b["kind"] == "parked":
                assert b["parked"] == (["exp_avg", "exp_avg_sq", "master"] if low else ["exp_avg", "exp_avg_sq"])
                assert b["nbytes_parked"] == state + master, where
                expected = dict(host_bytes=state + master, gpu_bytes=state + master, up_bytes=state + master,
                                down_bytes=state + master)
                assert b["device_bytes"] == {}, where
            else:
                expected = dict(host_bytes=0, gpu_bytes=state + master, up_bytes=0, down_bytes=0)
                held = {"exp_avg": 4 * n, "exp_avg_sq": 4 * n, **({"master": 4 * n} if low else {})}
                assert b["device_bytes"] == held, where  # (no staging copy, no master of fp32 shards)
            assert {k: b["cost"][k] for k in expected} == expected, where
            assert b["cost"]["kernel_numel"] == 0, where


@pytest.mark.parametrize("placement", ["resident", "parked"])
def test_a_bf16_models_shards_are_written_by_the_update_as_adamw_steps_their_masters(world, placement):
    size, out = world
    for rank, problems in out[f"bf16/{placement}"].per_rank.items():
        assert problems == [], (size, rank, problems)


@pytest.mark.parametrize("after_backward", [False, True], ids=["before_backward", "after_backward"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_storage_fsdp_remakes_is_followed_as_adamw_follows_it(world, placement, after_backward):
    size, out = world
    if size == 1 and placement != "mix":
        pytest.skip("world 1 runs the mix only")
    run = out[f"remade/{placement}/{after_backward}"].get()
    assert run["adamw_remade"] and run["ours_remade"], "model.to() did not re-make the shards' storage"
    h.assert_same(run["adamw"], run["ours"], f"world {size} {placement}, re-made storage")


@pytest.mark.parametrize("placement", ["resident", "parked"])
def test_a_cast_of_the_shards_is_refused_naming_it_with_nothing_changed(world, placement):
    size, out = world
    if size == 1:
        pytest.skip("world 2 only")
    for rank, o in out[f"cast/{placement}"].per_rank.items():
        assert o["message"] is not None and "re-made the storage" in o["message"], (rank, o["message"])
        assert "torch.float64" in o["message"], (rank, o["message"])
        assert o["unchanged"], rank

"""OffloadOptimizer under FSDP2 + tensor parallelism (``parallelize_module`` over the ``tp`` dimension of a device
mesh, then ``fully_shard`` over its ``dp`` dimension), on CPU with gloo at world 4, against ``torch.optim.AdamW(
foreach=False)`` on the same DTensor model: parameters and both moments (gathered through DCP's
``get_optimizer_state_dict``), the clip's norm, every step for 20 steps, with clipping and two accumulated
micro-batches, at default fp32 ``assert_close`` tolerance.

Each TP style has a model of its own (:data:`STYLES`): ``colwise`` (two ``ColwiseParallel`` linears: every parameter
sharded over both dimensions, ``_StridedShard`` over ``dp``), ``rowwise`` (two ``RowwiseParallel`` linears: their
biases replicated over ``tp``) and ``sequence`` (torchtitan's: a ``SequenceParallel`` LayerNorm, replicated over
``tp``, then colwise and rowwise linears). Ours clips with ``opt.clip_grad_norm_`` and, in another run, with
``torch.nn.utils.clip_grad_norm_``. A DCP checkpoint saved on the (2 x 2) mesh is resumed on (4 x 1) and (1 x 4)
by each optimizer (and by ours from AdamW's), the continuations compared; HSDP + TP runs on a (2 x 1 x 2) mesh
(on the host, and with GPU placements on the stand-ins: the mix and all parked, a DCP checkpoint of each resumed
under the other). A
model whose ``down`` is left out of tensor parallelism (``mixed``: its parameters on the dp sub-mesh alone) is
compared with AdamW clipped by torch's arithmetic on full tensors (torch's own clip refuses two meshes).

GPU placements on the CUDA stand-ins (tests/cuda_standins.py): a dict's shares (every home in one param group) under
``sequence``, ``"parked"`` under ``rowwise``, each against AdamW as above; and ``"auto"`` where the ranks measure
differently, which must end with the same home per bucket on every rank and keep the pieces replicated over ``tp``
bitwise equal on both peers every step.

All jobs run in one spawn of 4 ranks (the ``world4`` fixture); the tests read their outcomes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp2_harness as h
from zero_offload import OffloadOptimizer

try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (public since torch 2.6)
    from torch.distributed.tensor.parallel import parallelize_module
except ImportError:
    fully_shard = parallelize_module = None

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
              pytest.mark.skipif(fully_shard is None, reason="FSDP2 + TP needs torch >= 2.6")]

WORLD = 4
DIM, FFN = 6, 12  # 6 rows: 3 + 3 over dp 2, 2 + 2 + 2 + 0 over dp 4 (an empty local tensor)
BATCH, SEQ = 4, 4  # divisible by every dp and tp size used
STEPS, SAVE_AT = 20, 10
LR, WEIGHT_DECAY, CLIP = 1e-2, 0.1, 0.05  # well below the gradient norm: every step is clipped
ADAMW = functools.partial(torch.optim.AdamW, foreach=False)
OURS = OffloadOptimizer
# The host route on the stand-ins (the default, "auto", would place their buckets after the second step: the
# "placed" jobs run the other homes).
OURS_HOST = functools.partial(OffloadOptimizer, placement="host")
BUCKET = 16  # 48 local elements per rank under ``sequence``: buckets enough for a dict's shares to fill each home
MIX = {"resident": 0.3, "parked": 0.4}
# GPU placements on the stand-ins: each style with a Replicate() piece (rowwise's biases, sequence's norm).
PLACED = {"mix/sequence": ("sequence", MIX), "parked/rowwise": ("rowwise", "parked")}
HSDP_PLACED = {"mix": MIX, "parked": "parked"}  # on the (replicate, shard, tp) = (2 x 1 x 2) mesh


def placed(placement: Any) -> Any:
    return functools.partial(OURS, bucket_numel=BUCKET, placement=placement)


class Net(nn.Module):
    """``norm`` (a LayerNorm, the ``sequence`` style's only), ``up`` (DIM -> FFN) and ``down`` (FFN -> DIM)."""

    def __init__(self, norm: bool):
        super().__init__()
        self.norm = nn.LayerNorm(DIM) if norm else None
        self.up = nn.Linear(DIM, FFN)
        self.down = nn.Linear(FFN, DIM)

    def forward(self, x):
        if self.norm is not None:
            x = self.norm(x)
        return self.down(F.gelu(self.up(x)))


def _plan(style: str) -> Dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if style == "colwise":
        return {"up": ColwiseParallel(output_layouts=Replicate()), "down": ColwiseParallel(output_layouts=Replicate())}
    if style == "mixed":  # ``down`` left out: its parameters on the dp mesh alone, a sub-mesh of the others'
        return {"up": ColwiseParallel(output_layouts=Replicate())}
    if style == "rowwise":
        return {"up": RowwiseParallel(input_layouts=Replicate()), "down": RowwiseParallel(input_layouts=Replicate())}
    return {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)), "down": RowwiseParallel()}


STYLES = ("colwise", "rowwise", "sequence")


@dataclasses.dataclass(frozen=True)
class Setup:
    """One training loop: the TP ``style``, the mesh's ``shape`` ((dp, tp), or (replicate, shard, tp): HSDP + TP),
    the optimizer, and how it clips (``"opt"``: ``opt.clip_grad_norm_``; ``"torch"``: torch's; ``"full"``: torch's
    arithmetic on each gradient's full tensor, where torch's own fails: parameters on two meshes)."""

    style: str
    make_opt: Any
    shape: Tuple[int, ...] = (2, 2)
    clip_with: str = "opt"
    standins: bool = False  # the GPU route on CPU tensors (tests/cuda_standins.py): gradients streamed in backward


def build(setup: Setup, seed: int = 0) -> h.Loop:
    from torch.distributed.device_mesh import init_device_mesh

    names = ("dp", "tp") if len(setup.shape) == 2 else ("replicate", "shard", "tp")
    mesh = init_device_mesh("cpu", setup.shape, mesh_dim_names=names)
    torch.manual_seed(seed)
    model = Net(norm=setup.style == "sequence")
    parallelize_module(model, mesh["tp"], _plan(setup.style))
    fully_shard(model, mesh=mesh[names[:-1]])
    return h.Loop(model, setup.make_opt(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY))


def _coords(setup: Setup) -> Tuple[int, int, int]:
    """This rank's data-parallel index, the number of data-parallel ranks, and its tensor-parallel index."""
    tp = setup.shape[-1]
    dp = WORLD // tp
    return dist.get_rank() // tp, dp, dist.get_rank() % tp


def train_step(loop: h.Loop, setup: Setup, step: int) -> float:
    """Two accumulated micro-batches, the clip, the step; returns the total norm the clip measured."""
    model, opt = loop.model, loop.opt
    d, dp, t = _coords(setup)
    tp = setup.shape[-1]
    opt.zero_grad(set_to_none=True)
    for micro in range(2):
        model.set_requires_gradient_sync(micro == 1)
        g = torch.Generator().manual_seed(1000 * step + micro)
        x, target = torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)
        rows = slice(d * BATCH // dp, (d + 1) * BATCH // dp)
        x, target = x[rows], target[rows]
        if setup.style == "sequence":  # SequenceParallel takes each tp rank's piece of the sequence
            x = x[:, t * SEQ // tp : (t + 1) * SEQ // tp]
        (F.mse_loss(model(x), target) / 2).backward()
    if setup.clip_with == "opt" and hasattr(opt, "clip_grad_norm_"):
        norm = opt.clip_grad_norm_(CLIP)
    elif setup.clip_with == "full":
        norm = clip_by_full_tensors(list(model.parameters()), CLIP)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    return float(h._full(norm))


def clip_by_full_tensors(params: List[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s arithmetic (each gradient's norm in its dtype, the norm of those, the
    coefficient clamped to 1) on each gradient's full tensor: for parameters on several meshes, where torch's
    ``stack`` of DTensor norms refuses."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.full_tensor()) for g in grads]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.to_local().mul_(coef)
    return total


def save(path: str, loop: h.Loop) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save({"model": get_model_state_dict(loop.model), "optim": get_optimizer_state_dict(loop.model, loop.opt)},
             checkpoint_id=path)
    dist.barrier()


def load(path: str, loop: h.Loop) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    sd = {"model": get_model_state_dict(loop.model), "optim": get_optimizer_state_dict(loop.model, loop.opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(loop.model, sd["model"])
    set_optimizer_state_dict(loop.model, loop.opt, sd["optim"])


def full_roundtrip(loop: h.Loop, setup: Setup) -> h.Loop:
    """Full state dicts gathered to rank 0 (``full_state_dict=True, cpu_offload=True``), loaded into a new model and
    optimizer (built from another seed) with ``broadcast_from_rank0=True``."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(loop.model, options=options)
    optim_sd = get_optimizer_state_dict(loop.model, loop.opt, options=options)
    del loop
    new = build(setup, seed=1)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(new.model, model_sd, options=options)
    set_optimizer_state_dict(new.model, new.opt, optim_sd, options=options)
    return new


def train(rank: int, world: int, setup: Setup, workdir: str, save_as: Optional[str] = None,
          start_from: Optional[str] = None, first: int = 0, full_at: Optional[int] = None
          ) -> List[Optional[h.Snapshot]]:
    """``setup`` trained from step ``first`` (loading checkpoint ``start_from`` into a model built from another
    seed) to :data:`STEPS`, saving checkpoint ``save_as`` before step :data:`SAVE_AT` (and before step ``full_at``
    going through full state dicts: :func:`full_roundtrip`); a snapshot per step."""
    if setup.standins:
        import cuda_standins

        with cuda_standins.installed() as planned:
            snaps = train(rank, world, dataclasses.replace(setup, standins=False), workdir, save_as, start_from, first,
                          full_at)
        if not planned:
            raise AssertionError("no optimizer was built on the stand-in device")
        return snaps
    loop = build(setup, seed=0 if start_from is None else 1)
    if start_from is not None:
        load(os.path.join(workdir, start_from), loop)
    snaps: List[Optional[h.Snapshot]] = [None] * first
    for step in range(first, STEPS):
        if step == SAVE_AT and save_as:
            save(os.path.join(workdir, save_as), loop)
        if step == full_at:
            loop = full_roundtrip(loop, setup)
        norm = train_step(loop, setup, step)
        snaps.append(h.snapshot(loop, norm, rank, last=step == STEPS - 1))
    return snaps


def placements(rank: int, world: int, style: str) -> Dict[str, str]:
    """Each parameter's placements under ``style`` on the (2 x 2) mesh."""
    loop = build(Setup(style, ADAMW))
    return {n: str(tuple(p.placements)) for n, p in loop.model.named_parameters()}


def load_full_tensors(rank: int, world: int, style: str) -> List[str]:
    """A state dict of plain full tensors (an unsharded model's) loaded into ours: each rank keeps the piece its
    placements give it (checked against DTensor's own redistribution of the full tensor). Returns the problems."""
    from torch.distributed.tensor import DTensor, Replicate

    loop = build(Setup(style, OURS))
    opt, problems = loop.opt, []
    params = list(loop.model.parameters())
    full = {i: torch.arange(p.numel(), dtype=torch.float32).view(p.shape) * (i + 1) for i, p in enumerate(params)}
    sd = opt.state_dict()
    sd["state"] = {i: {"step": torch.tensor(3.0), "exp_avg": f, "exp_avg_sq": f.abs() + 1} for i, f in full.items()}
    opt.load_state_dict(sd)
    for i, p in enumerate(params):
        mesh = p.device_mesh
        whole = DTensor.from_local(full[i], mesh, [Replicate()] * mesh.ndim, run_check=False)
        want = whole.redistribute(mesh, p.placements).to_local()
        got = opt.state[p]["exp_avg"]
        if not isinstance(got, DTensor) or tuple(got.placements) != tuple(p.placements):
            problems.append(f"{i}: {type(got).__name__} {getattr(got, 'placements', None)}")
        elif not torch.equal(got.to_local(), want):
            problems.append(f"{i} {tuple(p.placements)}: {got.to_local().tolist()} != {want.tolist()}")
    return problems


def refuse_unrelated_meshes(rank: int, world: int) -> Optional[str]:
    """Two models, one on a 1-D mesh of 4 ranks, one on a (2 x 2) mesh made apart: neither mesh is a sub-mesh of
    the other; refused, naming both."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    alone = Net(norm=False)
    fully_shard(alone, mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("a",)))
    both = build(Setup("colwise", ADAMW)).model
    try:
        OURS(list(alone.parameters()) + list(both.parameters()), lr=LR)
    except TypeError as exc:
        return str(exc)
    return None


def _backward(loop: h.Loop, setup: Setup) -> None:
    d, dp, t = _coords(setup)
    tp = setup.shape[-1]
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(7))
    x = x[d * BATCH // dp : (d + 1) * BATCH // dp]
    if setup.style == "sequence":
        x = x[:, t * SEQ // tp : (t + 1) * SEQ // tp]
    loop.model(x).square().mean().backward()


def norm_types(rank: int, world: int, style: str) -> Dict[str, Tuple[float, float]]:
    """``opt.clip_grad_norm_``'s total norm of each type beside torch's on the same gradients (a max_norm far
    above it: nothing is scaled)."""
    out = {}
    for norm_type in (2.0, 1.0, 3.0, float("inf")):
        loop = build(Setup(style, OURS))
        _backward(loop, Setup(style, OURS))
        expected = h._full(torch.nn.utils.clip_grad_norm_(loop.model.parameters(), 1e9, norm_type=norm_type))
        got = h._full(loop.opt.clip_grad_norm_(1e9, norm_type=norm_type))
        out[str(norm_type)] = (float(got), float(expected))
    return out


def refuse_disagreement_between_tp_peers(rank: int, world: int) -> Dict[str, Any]:
    """Rank 3 (rank 2's tensor-parallel peer, rank 1's data-parallel one) steps with another lr; then drops the
    gradient of ``up.weight``; then holds an inf in its piece of ``down.weight``: each time every rank raises,
    naming it, and nothing is updated."""
    setup = Setup("sequence", OURS)
    loop = build(setup)
    params = list(loop.model.parameters())
    out: Dict[str, Any] = {}
    for case in ("lr", "grad", "inf"):
        loop.opt.zero_grad()
        _backward(loop, setup)
        if rank == 3:
            if case == "lr":
                loop.opt.param_groups[0]["lr"] *= 2
            elif case == "grad":
                loop.model.up.weight.grad = None
            else:
                loop.model.down.weight.grad.to_local()[0, 0] = float("inf")
        before = [p.to_local().clone() for p in params]
        try:
            loop.opt.step()
            message = None
        except RuntimeError as exc:
            message = str(exc)
        loop.opt.param_groups[0]["lr"] = LR
        out[case] = (message, all(torch.equal(p.to_local(), b) for p, b in zip(params, before)))
    return out


def homes_of(rank: int, world: int, style: str, placement: Any, shape: Tuple[int, ...] = (2, 2)) -> List[str]:
    """Each bucket's home, as built on the stand-ins (the buckets told they are on a GPU), on a mesh of ``shape``."""
    import cuda_standins

    with cuda_standins.installed():
        opt = build(Setup(style, placed(placement), shape)).opt
        return [b.home.kind for group in opt._buckets for b in group]


def _replicated(loop: h.Loop) -> Dict[str, torch.Tensor]:
    """This rank's local pieces (parameter and both moments) of the parameters replicated over ``tp``."""
    from torch.distributed.tensor import Replicate

    out = {}
    for n, p in loop.model.named_parameters():
        if isinstance(p.placements[-1], Replicate):
            out[n] = p.detach().to_local().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{n}[{key}]"] = loop.opt.state[p][key].to_local().clone()
    return out


def auto_on_tp(rank: int, world: int, style: str) -> Dict[str, Any]:
    """``placement="auto"`` on the (2 x 2) mesh where the ranks measure differently: rank 0 has room for every
    bucket's state on its GPU (its plan: resident), the others none beyond the margin (parked, or the host), and
    rank 3's CPU kernel is fast (the host). Each rank's plan, the homes it ends with, its pieces replicated over
    ``tp`` after each step (which its tp peer must hold bitwise), and the run (snapshots, rank 0's)."""
    free = (1 << 40) if rank == 0 else 2**30  # (gpu_margin_gib=1: no room beyond it on the other ranks)
    setup = Setup(style, functools.partial(OURS, bucket_numel=BUCKET, placement="auto", gpu_margin_gib=1.0))
    with h.auto_measures(free, kernel=1e15 if rank == 3 else 1e6, copy_rate=1e12) as plans:
        loop = build(setup)
        snaps, replicated = [], []
        for step in range(STEPS):
            norm = train_step(loop, setup, step)
            snaps.append(h.snapshot(loop, norm, rank, last=step == STEPS - 1))
            replicated.append(_replicated(loop))
    homes = [b.home.kind for group in loop.opt._buckets for b in group]
    return dict(plans=plans, homes=homes, snaps=snaps, replicated=replicated)


def _replicate():
    from torch.distributed.tensor import Replicate

    return Replicate()


def _jobs(workdir: str) -> Dict[str, Any]:
    jobs: Dict[str, Any] = {}
    for style in STYLES:
        jobs[f"placements/{style}"] = h.Call(placements, (style,))
        jobs[f"adamw/{style}"] = h.Call(train, (Setup(style, ADAMW, clip_with="torch"), workdir,
                                                f"adamw-{style}" if style == "sequence" else None))
        jobs[f"ours/{style}"] = h.Call(train, (Setup(style, OURS), workdir,
                                               f"ours-{style}" if style == "sequence" else None))
        jobs[f"ours-torch-clip/{style}"] = h.Call(train, (Setup(style, OURS, clip_with="torch"), workdir))
        jobs[f"full-tensors/{style}"] = h.Call(load_full_tensors, (style,))
    for shape in ((4, 1), (1, 4)):
        for name, make_opt, saved in (("adamw", ADAMW, "adamw"), ("ours", OURS, "ours"), ("ours<-adamw", OURS,
                                                                                             "adamw")):
            setup = Setup("sequence", make_opt, shape, clip_with="torch" if make_opt is ADAMW else "opt")
            jobs[f"resume{shape}/{name}"] = h.Call(train, (setup, workdir, None, f"{saved}-sequence", SAVE_AT))
    hsdp = (2, 1, 2)
    jobs["hsdp-tp/adamw"] = h.Call(train, (Setup("sequence", ADAMW, hsdp, "torch"), workdir, "hsdp-adamw"))
    jobs["hsdp-tp/ours"] = h.Call(train, (Setup("sequence", OURS, hsdp), workdir, "hsdp-ours"))
    jobs["hsdp-tp/ours-resumed"] = h.Call(train, (Setup("sequence", OURS, hsdp), workdir, None, "hsdp-ours",
                                                  SAVE_AT))
    # GPU placements on the 3-D mesh (the stand-ins): every home in one group, all parked; a DCP checkpoint of the
    # mix resumed all parked, and of all parked resumed as the mix.
    for name, placement in HSDP_PLACED.items():
        jobs[f"hsdp-tp/{name}"] = h.Call(train, (Setup("sequence", placed(placement), hsdp, standins=True), workdir,
                                                 f"hsdp-{name}"))
        jobs[f"hsdp-homes/{name}"] = h.Call(homes_of, ("sequence", placement, hsdp))
        other = next(o for o in HSDP_PLACED if o != name)
        jobs[f"hsdp-tp/{name}->{other}"] = h.Call(train, (Setup("sequence", placed(HSDP_PLACED[other]), hsdp,
                                                                standins=True), workdir, None, f"hsdp-{name}",
                                                          SAVE_AT))
    for style in STYLES + ("mixed",):
        jobs[f"standins/{style}"] = h.Call(train, (Setup(style, OURS_HOST, standins=True), workdir))
    jobs["standins-torch-clip/sequence"] = h.Call(train, (Setup("sequence", OURS_HOST, clip_with="torch",
                                                                standins=True), workdir))
    for name, (style, placement) in PLACED.items():
        jobs[f"placed/{name}"] = h.Call(train, (Setup(style, placed(placement), standins=True), workdir))
        jobs[f"homes/{name}"] = h.Call(homes_of, (style, placement))
    jobs["auto/sequence"] = h.Call(auto_on_tp, ("sequence",))
    for name, make_opt in (("adamw", ADAMW), ("ours", OURS)):
        setup = Setup("sequence", make_opt, clip_with="torch" if make_opt is ADAMW else "opt")
        jobs[f"full-roundtrip/{name}"] = h.Call(train, (setup, workdir, None, None, 0, SAVE_AT))
    jobs["adamw/mixed"] = h.Call(train, (Setup("mixed", ADAMW, clip_with="full"), workdir))
    jobs["ours/mixed"] = h.Call(train, (Setup("mixed", OURS), workdir))
    jobs["placements/mixed"] = h.Call(placements, ("mixed",))
    jobs["refuse/unrelated_meshes"] = h.Call(refuse_unrelated_meshes)
    jobs["refuse/tp_peers"] = h.Call(refuse_disagreement_between_tp_peers)
    for style in STYLES:
        jobs[f"norm_types/{style}"] = h.Call(norm_types, (style,))
    return jobs


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("fsdp2-tp-checkpoints"))
    return h.run_jobs(WORLD, _jobs(workdir), workdir, timeout=900)


# ----------------------------------------------------------------------------------------------------- tests --
def test_each_style_makes_the_placements_it_is_meant_to(world4):
    """The models meet what the tests are about: _StridedShard over dp, Shard(1) over tp, Replicate over tp."""
    colwise, rowwise, sequence = (world4[f"placements/{s}"].get() for s in STYLES)
    assert "_StridedShard" in colwise["up.weight"] and "Shard(dim=0)" in colwise["up.weight"], colwise
    assert rowwise["up.weight"] == "(Shard(dim=0), Shard(dim=1))", rowwise
    assert rowwise["up.bias"] == "(Shard(dim=0), Replicate())", rowwise
    assert sequence["norm.weight"] == "(Shard(dim=0), Replicate())", sequence


@pytest.mark.parametrize("style", STYLES)
def test_reference_trains_and_clips_every_step(world4, style):
    snaps = world4[f"adamw/{style}"].per_rank[0]
    h.assert_moved(snaps, style)
    assert all(s.norm > CLIP for s in snaps), [s.norm for s in snaps]


@pytest.mark.parametrize("clip_with", ["opt", "torch"])
@pytest.mark.parametrize("style", STYLES)
def test_tp_with_fsdp_matches_adamw_every_step(world4, style, clip_with):
    """Parameters, exp_avg and exp_avg_sq, the clip's norm: every step of 20, clipped, two micro-batches."""
    ours = world4[f"ours/{style}" if clip_with == "opt" else f"ours-torch-clip/{style}"].per_rank[0]
    h.assert_same(world4[f"adamw/{style}"].per_rank[0], ours, f"{style} ({clip_with} clip)")


@pytest.mark.parametrize("job", [f"standins/{s}" for s in STYLES + ("mixed",)] + ["standins-torch-clip/sequence"])
def test_the_gpu_route_streaming_from_fsdp_hooks_matches_adamw(world4, job):
    """Buckets told they are on a GPU (tests/cuda_standins.py): gradients copied in FSDP's hooks with their norms
    (a bucket holding a piece this rank does not count is measured again, parameter by parameter)."""
    style = job.split("/")[1]
    h.assert_same(world4[f"adamw/{style}"].per_rank[0], world4[job].per_rank[0], job)


@pytest.mark.parametrize("style", STYLES)
def test_a_full_plain_tensor_loads_as_each_ranks_piece(world4, style):
    for rank, problems in world4[f"full-tensors/{style}"].per_rank.items():
        assert problems == [], (rank, problems)


@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
def test_a_dcp_checkpoint_of_the_2x2_mesh_resumes_on_another_mesh(world4, shape):
    """Saved on (2 x 2) before step 10, resumed on ``shape``: ours from its own checkpoint and from AdamW's, each
    continuing as AdamW does from its own."""
    expected = world4[f"resume{shape}/adamw"].per_rank[0]
    h.assert_moved(expected, str(shape))
    for name in ("ours", "ours<-adamw"):
        h.assert_same(expected, world4[f"resume{shape}/{name}"].per_rank[0], f"{shape} {name}", first=SAVE_AT)


def test_full_state_dicts_round_trip(world4):
    """Gathered to rank 0 and broadcast into a new model and optimizer before step 10: AdamW's run is its
    uninterrupted one, and ours matches it every step."""
    h.assert_same(world4["adamw/sequence"].per_rank[0], world4["full-roundtrip/adamw"].per_rank[0], "AdamW full")
    h.assert_same(world4["adamw/sequence"].per_rank[0], world4["full-roundtrip/ours"].per_rank[0], "ours full")


def test_hsdp_with_tp_steps_and_checkpoints(world4):
    """On a (2 x 1 x 2) mesh (replicate, shard, tp): ours matches AdamW, and resumes from its DCP checkpoint."""
    expected = world4["hsdp-tp/adamw"].per_rank[0]
    h.assert_same(expected, world4["hsdp-tp/ours"].per_rank[0], "HSDP + TP")
    h.assert_same(expected, world4["hsdp-tp/ours-resumed"].per_rank[0], "HSDP + TP resumed", first=SAVE_AT)


@pytest.mark.parametrize("name", list(HSDP_PLACED))
def test_hsdp_with_tp_and_gpu_placements_matches_adamw_and_checkpoints(world4, name):
    """On the (2 x 1 x 2) mesh, the stand-ins' GPU route: a dict's shares (host, resident and parked buckets in one
    param group) and ``"parked"``, clipped by ``opt.clip_grad_norm_``, two micro-batches: parameters, both moments
    and the norm as AdamW's every step of 20; a DCP checkpoint saved under one resumed under the other continues as
    AdamW's run. Each rank built the homes asked."""
    kinds = {"host", "resident", "parked"} if isinstance(HSDP_PLACED[name], dict) else {HSDP_PLACED[name]}
    for rank, homes in world4[f"hsdp-homes/{name}"].per_rank.items():
        assert set(homes) == kinds, (rank, homes)
    expected = world4["hsdp-tp/adamw"].per_rank[0]
    h.assert_same(expected, world4[f"hsdp-tp/{name}"].per_rank[0], f"HSDP + TP {name}")
    other = next(o for o in HSDP_PLACED if o != name)
    h.assert_same(expected, world4[f"hsdp-tp/{name}->{other}"].per_rank[0], f"HSDP + TP {name} -> {other}",
                  first=SAVE_AT)


def test_parameters_on_a_sub_mesh_of_the_others_match_adamw(world4):
    """``down`` left out of tensor parallelism (on the dp mesh alone, beside ``up`` on (dp, tp)): its piece is
    counted once in the norm; every step matches AdamW clipped with torch's arithmetic on full tensors."""
    placed = world4["placements/mixed"].get()
    assert placed["down.weight"] == "(Shard(dim=0),)" and "_StridedShard" in placed["up.weight"], placed
    h.assert_same(world4["adamw/mixed"].per_rank[0], world4["ours/mixed"].per_rank[0], "mixed meshes")


def test_parameters_on_unrelated_meshes_are_refused_naming_them(world4):
    for rank, message in world4["refuse/unrelated_meshes"].per_rank.items():
        assert message is not None and "different device meshes" in message and "(2, 2)" in message, (rank, message)


@pytest.mark.parametrize("style", STYLES)
def test_every_norm_type_is_the_whole_meshs(world4, style):
    """2, 1, 3 and inf: as torch's clip_grad_norm_ measures the same DTensor gradients (replicated pieces once)."""
    for rank, norms in world4[f"norm_types/{style}"].per_rank.items():
        for norm_type, (got, expected) in norms.items():
            assert got == pytest.approx(expected, rel=1e-6), (rank, style, norm_type, got, expected)


def test_tp_peers_that_disagree_raise_on_every_rank(world4):
    """The agreement, presence and inf/nan checks span the tensor-parallel dimension too."""
    for rank, cases in world4["refuse/tp_peers"].per_rank.items():
        (lr, lr_kept), (grad, grad_kept), (inf, inf_kept) = cases["lr"], cases["grad"], cases["inf"]
        assert lr is not None and "lr of param group 0" in lr and "on rank 3" in lr, (rank, lr)
        assert grad is not None and "different parameters" in grad and "[3]" in grad, (rank, grad)
        assert inf is not None and "non-finite" in inf and "rank 3's shard" in inf, (rank, inf)
        assert lr_kept and grad_kept and inf_kept, (rank, cases)


@pytest.mark.parametrize("name", list(PLACED))
def test_gpu_placements_on_the_tp_mesh_match_adamw_every_step(world4, name):
    """The stand-ins' GPU route (tests/cuda_standins.py) with ``placement`` a dict's shares (host, resident and
    parked buckets in one param group, ``sequence``: a SequenceParallel norm and a rowwise bias replicated over
    ``tp``) and ``"parked"`` (``rowwise``: biases replicated over ``tp``), clipped by ``opt.clip_grad_norm_``, two
    micro-batches: parameters, both moments and the norm as AdamW's every step. Each rank built the homes asked."""
    style, placement = PLACED[name]
    expected = {"host", "resident", "parked"} if isinstance(placement, dict) else {placement}
    for rank, homes in world4[f"homes/{name}"].per_rank.items():
        assert set(homes) == expected, (rank, homes)
    h.assert_same(world4[f"adamw/{style}"].per_rank[0], world4[f"placed/{name}"].per_rank[0], name)


def test_auto_on_the_tp_mesh_agrees_and_steps_replicas_alike(world4):
    """``placement="auto"`` where rank 0 plans every bucket resident, the others park them and rank 3 steps its last
    on the host: every rank ends with, for each bucket, the least GPU-hungry of the plans (``Mesh.same_homes``);
    the pieces replicated over ``tp`` (the norm's, ``down.bias``) are bitwise equal on both tp peers after every
    step, parameters and both moments (one peer stepping a bucket with our CPU kernel and the other with torch's
    fused AdamW would differ in the last bits); and the run is AdamW's."""
    out = world4["auto/sequence"].per_rank
    plans = {rank: o["plans"][-1] for rank, o in out.items()}
    assert set(plans[0]) == {"resident"} and set(plans[1]) == {"parked"} and "host" in plans[3], plans
    order = ("host", "parked", "resident")
    agreed = [order[min(order.index(plans[r][i]) for r in plans)] for i in range(len(plans[0]))]
    assert {"host", "parked"} <= set(agreed), agreed
    for rank, o in out.items():
        assert o["homes"] == agreed, (rank, o["homes"], agreed)
    for rank, o in out.items():
        peer = out[rank ^ 1]  # (tp = 2: ranks 2d and 2d + 1 hold the same data-parallel piece)
        assert len(o["replicated"]) == STEPS and set(o["replicated"][0]) >= {"norm.weight", "down.bias"}, rank
        for step, (mine, theirs) in enumerate(zip(o["replicated"], peer["replicated"])):
            for key, value in mine.items():
                assert torch.equal(value, theirs[key]), (rank, step, key)
    h.assert_same(world4["adamw/sequence"].per_rank[0], out[0]["snaps"], "placement='auto' on (2 x 2)")

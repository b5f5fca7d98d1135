"""A reference harness for optimizers under FSDP2 (``fully_shard``), on CPU with gloo, world 2 or 3.

It trains one small model, sharded per block and at the root, with a given optimizer factory and a recipe (the
parts of a training loop: clipping, GradScaler, accumulation, param groups and a scheduler, mixed precision,
``CPUOffloadPolicy``, checkpoints through DCP), and returns, for every step, the full (gathered) parameters and
the full optimizer state as ``get_optimizer_state_dict(..., full_state_dict=True)`` gives it. Two runs with the
same recipe see the same seeds and batches, so comparing "FSDP2 + torch.optim.AdamW(foreach=False)" with "FSDP2 +
zero_offload.OffloadOptimizer" is a matter of::

    ref = run(2, RECIPES["clip"], functools.partial(torch.optim.AdamW, foreach=False))
    ours = run(2, RECIPES["clip"], functools.partial(zero_offload.OffloadOptimizer))
    assert_same(ref, ours, "clip")

Each ``run`` is one launch of the ranks (``test_distributed.launch``: forked from a fork server that has imported
torch, about 0.2 s on 2 cores; FSDP's own set-up costs more); :func:`run_jobs` runs many jobs in one launch,
one after another in the same process group, and hands back each job's outcome (its snapshots, or the exception
it raised on the ranks, re-raised by :meth:`Outcome.get` with the ranks' tracebacks as its cause).

The model (:class:`Net`) is shaped to meet FSDP2's awkward cases at world 2 and 3:

- ``embed.weight`` (11 x 6; 11 rows: uneven at both sizes), tied to the output head (one parameter, in the root
  unit);
- ``blocks.N.up`` (5 x 6 and a 1-D bias of 5: 3+2 rows at world 2, 2+2+1 at world 3);
- ``blocks.N.gain`` (1 x 6: fewer rows than ranks, so every rank but 0 holds an empty shard);
- ``logit_bias`` (11), used only on steps where ``step % 3 == 1``: no gradient on the others (on every rank, as
  FSDP needs);
- ``norm`` (a LayerNorm: two 1-D parameters of 6).

The global batch (6 rows) is split evenly over the ranks; each rank's loss is the mean over its rows and FSDP
averages the gradients, so every world size trains on the whole-batch gradient (only the order of the sums
differs).

Optimizer factories are called as ``make_opt(params_or_groups, lr=..., weight_decay=...)`` and must be picklable
(module-level classes, functions or ``functools.partial`` of them): they are sent to the spawned processes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import pickle
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from test_distributed import launch  # the spawn-and-collect helper of the process-group tests

VOCAB, DIM, HIDDEN, SEQ = 11, 6, 5, 4
try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (public since torch 2.6)
except ImportError:
    fully_shard = None

# The skip marks of a test module that runs FSDP2 (``pytestmark = h.NEEDS_FSDP2``).
NEEDS_FSDP2 = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
               pytest.mark.skipif(fully_shard is None, reason="FSDP2 (torch.distributed.fsdp.fully_shard) needs "
                                                              "torch >= 2.6")]

BATCH = 6  # global rows per step: divisible by 2 and 3
STEPS = 6
LR, WEIGHT_DECAY = 1e-2, 0.1
CLIP = 0.5  # well below the gradient norm of this model (2.6 to 4.4 over the steps), so every step is clipped


# ------------------------------------------------------------------------------------------------- model --
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(1, DIM))

    def forward(self, h):
        return h + self.down(F.gelu(self.up(h))) * self.gain


class Net(nn.Module):
    def __init__(self, blocks: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: FSDP2 keeps one parameter (both modules in the root unit)
        self.logit_bias = nn.Parameter(torch.zeros(VOCAB))

    def forward(self, ids, use_bias: bool):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return logits + self.logit_bias if use_bias else logits


def tokens(step: int, micro: int = 0) -> torch.Tensor:
    """The global batch of ``step`` (``micro``-th micro-batch): ``BATCH`` rows of ``SEQ + 1`` token ids."""
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 * step + micro))


def rows_of(rank: int, world: int) -> slice:
    n = BATCH // world
    return slice(rank * n, (rank + 1) * n)


def step_refused(model: nn.Module, opt: Any) -> Tuple[Optional[str], bool]:
    """``opt.step()``: the ``RuntimeError``'s message (None if it stepped) and whether every local shard of the
    model's parameters is as it was."""
    before = [p.to_local().clone() for p in model.parameters()]
    try:
        opt.step()
        message = None
    except RuntimeError as exc:
        message = str(exc)
    return message, all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before))


def step_after_cast(model: Any, opt: Any) -> Tuple[Optional[str], bool]:
    """``model.to(torch.float64)`` after backward (FSDP re-makes its shards' storage as float64), then ``opt.step()``:
    the ``RuntimeError``'s message (None if it stepped) and whether ``opt.state`` is as it was."""
    def local(v: Any) -> Any:
        return v.to_local() if hasattr(v, "to_local") else v  # (the 0-dim step is a plain tensor)

    before = {k: {n: local(v).clone() for n, v in entry.items()} for k, entry in opt.state.items()}
    model.to(torch.float64)
    try:
        opt.step()
        message = None
    except RuntimeError as exc:
        message = str(exc)
    unchanged = bool(before) and all(torch.equal(local(v), before[k][n]) for k, entry in opt.state.items()
                                     for n, v in entry.items())
    return message, unchanged


def loss_on(model: nn.Module, step: int, micro: int, rank: int, world: int) -> torch.Tensor:
    ids = tokens(step, micro)[rows_of(rank, world)]
    logits = model(ids[:, :-1], step % 3 == 1)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


# ----------------------------------------------------------------------------------------------- recipes --
@dataclasses.dataclass(frozen=True)
class Recipe:
    """One training loop. Each field is one thing a user's loop does; the defaults are the plain loop.

    Args:
        clip (float, optional): clip the gradients' norm to this, every step. Default: None.
        clip_with (str): ``"torch"``: ``torch.nn.utils.clip_grad_norm_(model.parameters(), clip)``; ``"opt"``:
            ``opt.clip_grad_norm_(clip)`` where the optimizer has that method, else torch's. Default: "torch".
        scaler (bool): ``torch.amp.GradScaler("cpu")``; ``nonfinite_at`` makes that step's loss infinite, so the
            scaler skips the step and halves its scale. Default: False.
        accumulate (int): micro-batches per step, all but the last under ``set_requires_gradient_sync(False)``.
        groups (bool): two param groups (matrices with weight decay; vectors with twice the lr and none).
        scheduler (bool): a ``LambdaLR`` warm-up then decay, stepped after every optimizer step.
        mixed_precision (bool): ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``.
        cpu_offload (bool): ``CPUOffloadPolicy`` (pinned only where an accelerator exists: pinning needs one).
        reshard_after_forward (bool): ``fully_shard``'s argument. Default: True.
        mesh (tuple, optional): the device mesh's shape, -1 for the rest of the world; ``(replicate, shard)``
            makes it HSDP. Default: (world,).
        resume_at (int, optional): before this step, save model and optimizer, build both anew from another seed
            and load them (a round trip a user's restart does). Default: None.
        resume_how (str): ``"dcp"``: ``dcp.save``/``dcp.load`` of the sharded state dicts; ``"full"``: full state
            dicts gathered to rank 0 (``full_state_dict=True, cpu_offload=True``) and loaded with
            ``broadcast_from_rank0=True``; ``"torch_save"``: each rank's sharded ``model.state_dict()`` and
            ``opt.state_dict()`` as they are, ``torch.save``'d to a file of its own (and ``copy.deepcopy``'d, as a
            loop keeping its best state in memory does) and loaded with ``load_state_dict``; ``"dcp_async"``,
            ``"dcp_async_staged"``: saved with ``dcp.async_save`` (see :func:`_async_save`), loaded as ``"dcp"``.
            Default: "dcp".
        built_unsharded (bool): accelerate's FSDP2 preparation: the optimizer (and scheduler) built over the plain
            model, then ``fully_shard``, then each group's ``params`` switched to the DTensors, matched by name (as
            ``Accelerator.prepare(model, optimizer)`` does with its FSDP2 plugin). Default: False.
    """

    clip: Optional[float] = None
    clip_with: str = "torch"
    scaler: bool = False
    nonfinite_at: Optional[int] = None
    accumulate: int = 1
    groups: bool = False
    scheduler: bool = False
    mixed_precision: bool = False
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    mesh: Optional[Tuple[int, ...]] = None
    resume_at: Optional[int] = None
    resume_how: str = "dcp"
    built_unsharded: bool = False


RECIPES: Dict[str, Recipe] = {
    "plain": Recipe(),
    "clip": Recipe(clip=CLIP),
    "clip_opt": Recipe(clip=CLIP, clip_with="opt"),
    "scaler": Recipe(scaler=True, nonfinite_at=2),
    "scaler_clip": Recipe(scaler=True, nonfinite_at=3, clip=CLIP, clip_with="opt"),
    "accumulate": Recipe(accumulate=2),
    "groups_scheduler": Recipe(groups=True, scheduler=True),
    "mixed_precision": Recipe(mixed_precision=True, clip=CLIP),
    "no_reshard": Recipe(reshard_after_forward=False),
    "cpu_offload": Recipe(cpu_offload=True, clip=CLIP),
    "hsdp_replicate": Recipe(mesh=(2, -1), clip=CLIP),  # world 2: (2, 1), every rank holds whole parameters
    "hsdp_shard": Recipe(mesh=(1, -1), clip=CLIP),  # a 2-D mesh whose shard dimension is the whole world
    "dcp_roundtrip": Recipe(groups=True, scheduler=True, clip=CLIP, resume_at=3),
    "full_roundtrip": Recipe(scaler=True, resume_at=3, resume_how="full"),
    "saved_roundtrip": Recipe(groups=True, scheduler=True, clip=CLIP, clip_with="opt", resume_at=3,
                              resume_how="torch_save"),
    "async_roundtrip": Recipe(groups=True, scheduler=True, clip=CLIP, resume_at=3, resume_how="dcp_async"),
    "staged_roundtrip": Recipe(clip=CLIP, scaler=True, resume_at=3, resume_how="dcp_async_staged"),
    "accelerate_switch": Recipe(groups=True, scheduler=True, clip=CLIP, built_unsharded=True),
}


def _lr_lambda(step: int) -> float:
    return min(1.0, (step + 1) / 3) * 0.8 ** max(0, step - 2)


# -------------------------------------------------------------------------------------------------- jobs --
@dataclasses.dataclass(frozen=True)
class Job:
    """``recipe`` trained for ``steps`` with ``make_opt``.

    ``save_as``/``save_at``: before step ``save_at``, save a DCP checkpoint (model, optimizer, scheduler and
    scaler) named ``save_as`` in the run's work directory, and go on. ``start_from=(name, step)``: build the
    model anew from another seed, load checkpoint ``name`` (saved by an earlier job of this spawn, or of another
    spawn given the same ``workdir``: at another world size, with another optimizer) and train from ``step``; the
    snapshots before it are None.
    """

    recipe: Recipe
    make_opt: Callable[..., torch.optim.Optimizer]
    steps: int = STEPS
    save_as: Optional[str] = None
    save_at: Optional[int] = None
    start_from: Optional[Tuple[str, int]] = None
    # The optimizer's CUDA branches on CPU tensors (tests/cuda_standins.py): its buckets told they are on cuda:0,
    # streams and events stand-ins; FSDP itself runs on the CPU mesh as in every job.
    standins: bool = False


@dataclasses.dataclass(frozen=True)
class Call:
    """Run ``fn(rank, world, *args)`` on every rank (in the same spawn as the other jobs): its outcome's ``value``
    is rank 0's, ``per_rank`` every rank's."""

    fn: Callable[..., Any]
    args: Tuple[Any, ...] = ()


@dataclasses.dataclass
class Snapshot:
    """After one step, as rank 0 sees it."""

    params: Dict[str, torch.Tensor]  # fqn -> full parameter
    state: Dict[str, Dict[str, Any]]  # fqn -> {"step": ..., "exp_avg": full tensor, ...}
    groups: List[Dict[str, Any]]  # the param groups of get_optimizer_state_dict, "params" as fqns
    norm: Optional[float]  # what the clip returned (total norm before clipping)
    scale: Optional[float]  # the GradScaler's scale after update()
    layout: List[str]  # where opt.state entries are not DTensors placed like their parameter (last step only)


class _RemoteTraceback(Exception):
    def __str__(self):
        return self.args[0]


@dataclasses.dataclass
class Outcome:
    value: Any = None  # rank 0's: a list of Snapshot (a Job) or the function's value (a Call)
    error: Optional[BaseException] = None
    tracebacks: Dict[int, str] = dataclasses.field(default_factory=dict)
    values: Dict[int, Any] = dataclasses.field(default_factory=dict)  # a Call's value on each rank
    seconds: float = 0.0  # how long the job took on rank 0

    @property
    def per_rank(self) -> Dict[int, Any]:
        """A Call's value on each rank; or, as :meth:`get`, the job's exception (never an empty dict that a loop
        over the ranks would pass without looking)."""
        self.get()
        if not self.values:
            raise AssertionError("no value from any rank (a Job, not a Call?)")
        return self.values

    def get(self) -> Any:
        """The value; or the job's exception re-raised, the ranks' tracebacks chained as its cause."""
        if self.error is None:
            return self.value
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(self.tracebacks.items()))
        raise copy.copy(self.error) from _RemoteTraceback(text)


# ---------------------------------------------------------------------------------------------- building --
@contextlib.contextmanager
def auto_measures(free: int, kernel: float, copy_rate: float, allocations: bool = False):
    """``placement="auto"``'s measures as a test sets them, inside the CUDA stand-ins: ``free`` bytes of free GPU
    memory, the CPU kernel at ``kernel`` elements a second, pinned copies at ``copy_rate`` bytes a second, a peak of 1
    MiB. Yields the list each plan of ``placement.plan_auto`` (this rank's own) is appended to. ``allocations``: the
    stand-ins' ledger keeps every device allocation (``cuda_standins.installed``)."""
    import cuda_standins
    import zero_offload.cost_model as cost_model
    import zero_offload.placement as placement

    plans: List[List[str]] = []
    real_plan = placement.plan_auto

    def plan(*args, **kw):
        plans.append(real_plan(*args, **kw))
        return plans[-1]

    with cuda_standins.installed(allocations=allocations):
        patches = [(placement, "plan_auto", plan),
                   (cost_model, "measure_copy_rate", lambda d, nbytes=0, up=True: copy_rate),
                   (cost_model, "measure_kernel_rate", lambda numel=0: kernel),
                   (torch.cuda, "max_memory_allocated", lambda device=None: 2**20),
                   (torch.cuda, "mem_get_info", lambda device=None: (free, 1 << 40))]
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
        for obj, name, value in patches:
            setattr(obj, name, value)
        try:
            yield plans
        finally:
            for obj, name, real in reversed(saved):
                setattr(obj, name, real)


def build_model(world: int, recipe: Recipe, seed: int = 0, model: Optional[nn.Module] = None) -> nn.Module:
    """The recipe's model (``model``, else a new one from ``seed``), sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if model is None:
        torch.manual_seed(seed)
        model = Net()
    shape = tuple(world // math.prod(d for d in recipe.mesh if d != -1) if d == -1 else d
                  for d in recipe.mesh) if recipe.mesh else (world,)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    kw: Dict[str, Any] = dict(reshard_after_forward=recipe.reshard_after_forward)
    if recipe.mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if recipe.cpu_offload:
        # pin_memory=True needs an accelerator ("Cannot access accelerator device when none is available").
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def make_optimizer(model: nn.Module, recipe: Recipe, make_opt: Callable) -> torch.optim.Optimizer:
    if not recipe.groups:
        return make_opt(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    named = list(model.named_parameters())
    matrices = [p for _, p in named if p.ndim >= 2]
    vectors = [p for _, p in named if p.ndim < 2]
    return make_opt([{"params": matrices}, {"params": vectors, "lr": 2 * LR, "weight_decay": 0.0}], lr=LR,
                    weight_decay=WEIGHT_DECAY)


@dataclasses.dataclass
class Loop:
    """What one job trains with: rebuilt whole on a resume."""

    model: nn.Module
    opt: torch.optim.Optimizer
    scheduler: Any = None
    scaler: Any = None


def make_loop(world: int, recipe: Recipe, make_opt: Callable, seed: int = 0) -> Loop:
    if recipe.built_unsharded:
        torch.manual_seed(seed)
        model = Net()
        opt = make_optimizer(model, recipe, make_opt)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda) if recipe.scheduler else None
        names = {id(p): n for n, p in model.named_parameters()}
        build_model(world, recipe, model=model)
        sharded = dict(model.named_parameters())
        for group in opt.param_groups:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12) if recipe.scaler else None
        return Loop(model, opt, scheduler, scaler)
    model = build_model(world, recipe, seed)
    opt = make_optimizer(model, recipe, make_opt)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda) if recipe.scheduler else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12) if recipe.scaler else None
    return Loop(model, opt, scheduler, scaler)


def _full(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor()
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def train_step(loop: Loop, recipe: Recipe, step: int, rank: int, world: int) -> Optional[float]:
    """One optimizer step of ``recipe``; returns the total norm the clip measured (None without clipping)."""
    model, opt, scaler = loop.model, loop.opt, loop.scaler
    opt.zero_grad(set_to_none=True)
    for micro in range(recipe.accumulate):
        if recipe.accumulate > 1:
            model.set_requires_gradient_sync(micro == recipe.accumulate - 1)
        loss = loss_on(model, step, micro, rank, world) / recipe.accumulate
        if step == recipe.nonfinite_at:
            loss = loss * math.inf
        (scaler.scale(loss) if scaler is not None else loss).backward()
    norm = None
    if recipe.clip is not None:
        if scaler is not None:
            scaler.unscale_(opt)
        if recipe.clip_with == "opt" and hasattr(opt, "clip_grad_norm_"):
            norm = opt.clip_grad_norm_(recipe.clip)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
        norm = float(_full(norm))
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    if loop.scheduler is not None:
        loop.scheduler.step()
    return norm


def state_layout(model: nn.Module, opt: torch.optim.Optimizer) -> List[str]:
    """Where ``opt.state`` differs from what DCP and users expect under FSDP2: each tensor entry (bar 0-dim
    ``step``) a DTensor with its parameter's mesh, placements and global shape."""
    from torch.distributed.tensor import DTensor

    problems = []
    for name, p in model.named_parameters():
        for key, value in opt.state.get(p, {}).items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if not isinstance(value, DTensor):
                problems.append(f"{name}[{key}]: {type(value).__name__}, not a DTensor")
            elif (value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements)
                  or value.shape != p.shape):
                problems.append(f"{name}[{key}]: mesh {value.device_mesh}, placements {value.placements}, shape "
                                f"{tuple(value.shape)}; the parameter's: {p.device_mesh}, {p.placements}, "
                                f"{tuple(p.shape)}")
    return problems


def _pieces(tree: Any) -> Any:
    """Each DTensor as (global shape, this rank's offset, local tensor), to be placed on rank 0."""
    from torch.distributed.tensor import DTensor
    # Private, but the one function that says where a rank's local tensor sits for any mesh and placements.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(tree, dict):
        return {k: _pieces(v) for k, v in tree.items()}
    if isinstance(tree, DTensor):
        _, offset = compute_local_shape_and_global_offset(tree.shape, tree.device_mesh, tree.placements)
        return ("piece", tuple(tree.shape), tuple(offset), tree.to_local().detach().cpu().clone())
    return tree.detach().cpu().clone() if isinstance(tree, torch.Tensor) else tree


def _assemble(per_rank: List[Any]) -> Any:
    first = per_rank[0]
    if isinstance(first, dict):
        return {k: _assemble([tree[k] for tree in per_rank]) for k in first}
    if isinstance(first, tuple) and first and first[0] == "piece":
        full = torch.empty(first[1], dtype=first[3].dtype)
        seen = torch.zeros(first[1], dtype=torch.bool)  # (a replicated piece comes from several ranks)
        for rank, (_, _, offset, local) in enumerate(per_rank):
            where = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
            held = seen[where]
            # Replicas (HSDP's replicate dimension, a tensor-parallel Replicate()) must hold the same bits: the
            # ranks that step one piece each step it alike, or the replicas drift apart.
            assert torch.equal(full[where][held], local[held]), f"rank {rank}'s replica of a piece differs"
            full[where] = local
            seen[where] = True
        return full
    return first


def snapshot(loop: Loop, norm: Optional[float], rank: int, last: bool) -> Optional[Snapshot]:
    """The full parameters and optimizer state, kept on rank 0. Every step but the last gathers the sharded
    ``get_optimizer_state_dict`` in one collective; the last takes ``full_state_dict=True`` (DCP's own gather,
    a collective per tensor) and checks the layout of ``opt.state``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=last)
    osd = get_optimizer_state_dict(loop.model, loop.opt, options=options)
    mine = _pieces({"params": dict(loop.model.named_parameters()), "state": osd["state"]})
    gathered: Optional[List[Any]] = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    layout = state_layout(loop.model, loop.opt) if last else []
    if rank != 0:
        return None
    full = _assemble(gathered)
    groups = [dict(g) for g in osd["param_groups"]]
    scale = loop.scaler.get_scale() if loop.scaler is not None else None
    return Snapshot(full["params"], full["state"], groups, norm, scale, layout)


# ------------------------------------------------------------------------------------------- checkpoints --
def save_checkpoint(path: str, loop: Loop, rank: int, how: str = "dcp") -> Any:
    """``"dcp"``: ``dcp.save`` of the sharded model and optimizer state dicts under ``path`` (the scheduler and
    scaler in ``path/extra.pt``); returns None. ``"full"``: the full state dicts, on rank 0 (returned)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    extra = {"scheduler": loop.scheduler.state_dict() if loop.scheduler is not None else None,
             "scaler": loop.scaler.state_dict() if loop.scaler is not None else None}
    if how == "torch_save":
        local = {"model": loop.model.state_dict(), "optim": loop.opt.state_dict(), "extra": extra}
        copy.deepcopy(local)
        os.makedirs(path, exist_ok=True)
        torch.save(local, os.path.join(path, f"rank{rank}.pt"))
        return None
    if how == "full":
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 only
        return dict(model=get_model_state_dict(loop.model, options=options),
                    optim=get_optimizer_state_dict(loop.model, loop.opt, options=options), extra=extra)
    sd = {"model": get_model_state_dict(loop.model), "optim": get_optimizer_state_dict(loop.model, loop.opt)}
    if how == "dcp":
        dcp.save(sd, checkpoint_id=path)
    else:
        _async_save(sd, path, how)
    if rank == 0:
        torch.save(extra, os.path.join(path, "extra.pt"))
    dist.barrier()
    return None


def _async_save(sd: Dict[str, Any], path: str, how: str) -> None:
    """``dcp.async_save`` (``"dcp_async"``; ``"dcp_async_staged"``: with torch's ``DefaultStager``, staging in the
    background, into pinned memory where an accelerator can pin it), waited for as its documentation asks: the
    staging before the state may change, then the upload."""
    import torch.distributed.checkpoint as dcp

    kw = {}
    if how == "dcp_async_staged":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        pin = torch.cuda.is_available()
        kw["async_stager"] = DefaultStager(StagingOptions(use_pinned_memory=pin, use_shared_memory=False,
                                                          use_async_staging=True, use_non_blocking_copy=pin))
    elif how != "dcp_async":
        raise ValueError(f"unknown resume_how {how!r}")
    response = dcp.async_save(sd, checkpoint_id=path, **kw)
    staged = getattr(response, "staging_completion", None)
    if staged is not None:
        staged.result()
    getattr(response, "upload_completion", response).result()


def load_checkpoint(path: str, loop: Loop, saved: Any = None, how: str = "dcp") -> None:
    """Load what :func:`save_checkpoint` saved into ``loop`` (a new model and optimizer)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    if how == "torch_save":
        saved = torch.load(os.path.join(path, f"rank{dist.get_rank()}.pt"), weights_only=False)
        loop.model.load_state_dict(saved["model"])
        loop.opt.load_state_dict(saved["optim"])
        extra = saved["extra"]
    elif how == "full":
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        saved = saved or {}
        set_model_state_dict(loop.model, saved.get("model", {}), options=options)
        set_optimizer_state_dict(loop.model, loop.opt, saved.get("optim", {}), options=options)
        extra = [saved.get("extra")]
        dist.broadcast_object_list(extra, src=0)
        extra = extra[0]
    else:
        # The template: the new model's and optimizer's own sharded state dicts (get_optimizer_state_dict gives
        # an optimizer without state one, through a step at lr 0 on zero gradients), which dcp.load fills.
        sd = {"model": get_model_state_dict(loop.model), "optim": get_optimizer_state_dict(loop.model, loop.opt)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(loop.model, sd["model"])
        set_optimizer_state_dict(loop.model, loop.opt, sd["optim"])
        extra = torch.load(os.path.join(path, "extra.pt"), weights_only=False)
    if loop.scheduler is not None:
        loop.scheduler.load_state_dict(extra["scheduler"])
    if loop.scaler is not None:
        loop.scaler.load_state_dict(extra["scaler"])


# --------------------------------------------------------------------------------------------- the worker --
def _run_job(rank: int, world: int, job: Job, workdir: str, tag: str) -> Optional[List[Optional[Snapshot]]]:
    recipe = job.recipe
    first = 0
    if job.start_from is not None:
        name, first = job.start_from
        if not os.path.exists(os.path.join(workdir, name, "extra.pt")):
            raise FileNotFoundError(f"no checkpoint {name!r} in {workdir}: the job saving it failed or did not run")
        loop = make_loop(world, recipe, job.make_opt, seed=1)
        load_checkpoint(os.path.join(workdir, name), loop)
    else:
        loop = make_loop(world, recipe, job.make_opt)
    snaps: List[Optional[Snapshot]] = [None] * first
    for step in range(first, job.steps):
        if step == job.save_at and job.save_as:
            save_checkpoint(os.path.join(workdir, job.save_as), loop, rank)
        if step == recipe.resume_at and step != first:
            path = os.path.join(workdir, f"{tag}.resume")
            saved = save_checkpoint(path, loop, rank, recipe.resume_how)
            del loop  # nothing of the old model or optimizer survives
            loop = make_loop(world, recipe, job.make_opt, seed=1)
            load_checkpoint(path, loop, saved, recipe.resume_how)
        norm = train_step(loop, recipe, step, rank, world)
        snaps.append(snapshot(loop, norm, rank, last=step == job.steps - 1))
    return snaps if rank == 0 else None


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _worker(rank: int, world: int, jobs: Dict[str, Union[Job, Call]], workdir: str):
    out = {}
    for tag, job in jobs.items():
        start = time.perf_counter()
        try:
            if isinstance(job, Call):
                value = job.fn(rank, world, *job.args)
            elif job.standins:
                import cuda_standins

                with cuda_standins.installed() as planned:
                    value = _run_job(rank, world, job, workdir, tag)
                if not planned:
                    raise AssertionError(f"job {tag!r}: no optimizer was built on the stand-in device")
            else:
                value = _run_job(rank, world, job, workdir, tag)
            out[tag] = ("ok", value if rank == 0 or isinstance(job, Call) else None, time.perf_counter() - start)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 (DCP's CheckpointException is one); re-raised by Outcome.get
            out[tag] = ("error", _picklable(exc), traceback.format_exc(), time.perf_counter() - start)
        # A job that failed on some ranks only may have left the others inside a collective: stop there.
        statuses: List[Any] = [None] * world
        dist.all_gather_object(statuses, out[tag][0])
        if len(set(statuses)) > 1:
            raise RuntimeError(f"job {tag!r} failed on some ranks only ({statuses}); later jobs not run:\n"
                               + (out[tag][2] if out[tag][0] == "error" else ""))
    return out


def run_jobs(world: int, jobs: Mapping[str, Union[Job, Call]], workdir: Optional[str] = None,
             timeout: Optional[float] = None) -> Dict[str, Outcome]:
    """Run ``jobs`` (tag -> Job or Call), in order, in one spawn of ``world`` gloo CPU processes.

    ``workdir`` holds the checkpoints (``Job.save_as``); give the same one to another spawn to load them at
    another world size. Default: a temporary directory removed afterwards.
    """
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="fsdp2-harness-")
    try:
        timeout = timeout or 60.0 + 10.0 * len(jobs)
        per_rank = launch(_worker, world, dict(jobs), workdir, timeout=timeout)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    outcomes = {}
    for tag in jobs:
        results = {r: per_rank[r][tag] for r in per_rank}
        errors = {r: res for r, res in results.items() if res[0] == "error"}
        if errors:
            first = min(errors)
            outcomes[tag] = Outcome(error=errors[first][1], tracebacks={r: e[2] for r, e in errors.items()},
                                    seconds=results[0][-1])
        else:
            outcomes[tag] = Outcome(value=results[0][1], values={r: res[1] for r, res in results.items()}
                                    if isinstance(jobs[tag], Call) else {}, seconds=results[0][-1])
    return outcomes


def run(world: int, recipe: Recipe, make_opt: Callable, steps: int = STEPS) -> List[Snapshot]:
    """One job in its own spawn: ``recipe`` for ``steps`` steps with ``make_opt``; a Snapshot per step."""
    return run_jobs(world, {"run": Job(recipe, make_opt, steps)})["run"].get()


# ------------------------------------------------------------------------------------------- comparisons --
IMPLEMENTATION_FLAGS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def assert_same(expected: Sequence[Optional[Snapshot]], actual: Sequence[Optional[Snapshot]], what: str = "",
                rtol: Optional[float] = None, atol: Optional[float] = None, first: int = 0) -> None:
    """Every step from ``first``: parameters, optimizer state (same keys), the param groups' hyperparameters (bar
    implementation flags: foreach, fused, ...), the clip's norm and the scaler's scale; and no state layout
    problem. Default tolerance: ``torch.testing.assert_close``'s for the dtype."""
    assert len(expected) == len(actual), (what, len(expected), len(actual))
    tol = dict(rtol=rtol, atol=atol) if rtol is not None else {}
    for step in range(first, len(expected)):
        e, a = expected[step], actual[step]
        where = f"{what} step {step}"
        assert a is not None and e is not None, where
        assert a.layout == [], f"{where}: optimizer state not placed like its parameter: {a.layout}"
        assert e.params.keys() == a.params.keys(), where
        for name, value in e.params.items():
            torch.testing.assert_close(a.params[name], value, **tol, msg=lambda m: f"{where} param {name}: {m}")
        assert e.state.keys() == a.state.keys(), (where, sorted(e.state), sorted(a.state))
        for fqn, entry in e.state.items():
            assert entry.keys() == a.state[fqn].keys(), (where, fqn, sorted(entry), sorted(a.state[fqn]))
            for key, value in entry.items():
                torch.testing.assert_close(a.state[fqn][key], value, **tol,
                                           msg=lambda m: f"{where} state {fqn}[{key}]: {m}")
        assert len(e.groups) == len(a.groups), where
        for i, (eg, ag) in enumerate(zip(e.groups, a.groups)):
            for key, value in eg.items():
                if key not in IMPLEMENTATION_FLAGS:  # (a full-state load turns tuples into lists: betas)
                    got, value = _plain(ag.get(key)), _plain(value)
                    assert got == value, f"{where} group {i} {key}: {got!r} != {value!r}"
            assert ag["params"] == eg["params"], where
        if e.norm is not None:
            assert a.norm is not None, where
            torch.testing.assert_close(torch.tensor(a.norm), torch.tensor(e.norm), **tol, equal_nan=True,
                                       msg=lambda m: f"{where} norm: {m}")  # fp32 tolerance, as the norm is
        assert a.scale == e.scale, f"{where} scale: {a.scale} != {e.scale}"


def assert_moved(snaps: Sequence[Optional[Snapshot]], what: str = "") -> None:
    """The trajectory is sane: finite, every parameter changed over the run, and state exists."""
    done = [s for s in snaps if s is not None]
    first, last = done[0], done[-1]
    for name, value in last.params.items():
        assert torch.isfinite(value).all(), (what, name)
        assert not torch.equal(value, first.params[name]), (what, name)
    assert last.state, what

"""Acceptance probes of issue 53 as an outside tester writes them from the issue and the docs: FSDP2 + tensor
parallelism on gloo at world 4, each TP style on a model of its own with odd sizes (uneven pieces over both mesh
dimensions), against ``torch.optim.AdamW(foreach=False)`` on the same DTensor model: parameters and both moments
(gathered through DCP's ``get_optimizer_state_dict``) and the clip's norm, every step, default fp32 tolerance.

What tests/test_fsdp2_tp.py and tests/test_fsdp2_titan.py pin on their own models, this checks again on this one
where they pin one style only: a DCP checkpoint of the (2 x 2) mesh resumed on (4 x 1) and (1 x 4) for every style;
HSDP + TP (2 x 1 x 2) with a checkpoint resumed on (2 x 2); ``model.to()`` onto the device the model is on (which
copies) mid-run under FSDP2 + TP, with and without ``CPUOffloadPolicy``; ``nonfinite="skip"`` of an inf in one tp
peer's piece; an edit of a local gradient between ``opt.clip_grad_norm_`` and ``step()`` (refused, as the docs
say; it went unseen until this file); ``dcp.async_save`` with torch's ``DefaultStager`` (background staging, pinned
where an accelerator can pin) of FSDP2 + TP state dicts; and ``dcp.async_save`` of ``opt.sharded_state_dict()``
(the ``process_group=`` route), which the docs offered and which failed in DCP's staging until this file (issue 53,
"dcp.async_save ... round trips").

All world-4 jobs run in one spawn (the ``acceptance`` fixture); the tests read their outcomes. The single-process
tests at the end: the orphaned optimizer's warning after ``model.to()`` made new parameters, and (CUDA only) a real
move refused naming both devices.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp2_harness as h
import test_fsdp2_tp as tp_tests
from zero_offload import OffloadOptimizer

pytestmark = tp_tests.pytestmark

WORLD = 4
# Uneven pieces: DIM is 4 + 3 over a mesh dimension of 2 (then 2 + 2 and 2 + 1 over the other), 2 + 2 + 2 + 1 over 4.
# HIDDEN divides by every tp size: RowwiseParallel after ColwiseParallel takes its input's global shape as tp times
# the local one (torch's limit, with AdamW too), and FSDP2 refuses an empty tp piece ("_chunk_cat expects non-empty").
DIM, HIDDEN = 7, 12
BATCH, SEQ = 4, 4
STEPS, SAVE_AT = 20, 10
LR, WEIGHT_DECAY, CLIP = 1e-2, 0.1, 0.05  # the clip well below the gradients' norm: every step is clipped
ADAMW = functools.partial(torch.optim.AdamW, foreach=False)
OURS = OffloadOptimizer
STYLES = ("colwise", "rowwise", "sequence")


class Mlp(nn.Module):
    """``norm`` (the ``sequence`` style's, replicated over ``tp``), then two linears with biases."""

    def __init__(self, norm: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(DIM) if norm else nn.Identity()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.fc2(F.silu(self.fc1(self.norm(x))))


def plan(style: str) -> Dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if style == "colwise":
        return {"fc1": ColwiseParallel(output_layouts=Replicate()), "fc2": ColwiseParallel(output_layouts=Replicate())}
    if style == "rowwise":
        return {"fc1": RowwiseParallel(input_layouts=Replicate()), "fc2": RowwiseParallel(input_layouts=Replicate())}
    return {"norm": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
            "fc2": RowwiseParallel(output_layouts=Shard(1))}


@dataclasses.dataclass(frozen=True)
class Setup:
    """``shape``: (dp, tp), or (replicate, shard, tp) for HSDP + TP; ``clip``: ``"opt"`` (``opt.clip_grad_norm_``,
    torch's for AdamW) or ``"torch"``."""

    style: str
    make_opt: Any
    shape: Tuple[int, ...] = (2, 2)
    clip: str = "opt"
    cpu_offload: bool = False  # fully_shard(offload_policy=CPUOffloadPolicy()): shards and gradients on the host


def build(setup: Setup, seed: int = 0) -> h.Loop:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    names = ("dp", "tp") if len(setup.shape) == 2 else ("replicate", "shard", "tp")
    mesh = init_device_mesh("cpu", setup.shape, mesh_dim_names=names)
    torch.manual_seed(seed)
    model = Mlp(norm=setup.style == "sequence")
    parallelize_module(model, mesh["tp"], plan(setup.style))
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if setup.cpu_offload else None
    fully_shard(model, mesh=mesh[names[:-1]], **({"offload_policy": offload} if offload else {}))
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    plain = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = setup.make_opt([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": plain, "weight_decay": 0.0}],
                         lr=LR, betas=(0.9, 0.95))
    return h.Loop(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 3) * 0.95 ** i))


def train_step(loop: h.Loop, setup: Setup, step: int) -> float:
    """Two micro-batches (the first without gradient sync), the clip, the step, the schedule: the clip's norm."""
    tp = setup.shape[-1]
    dp, d, t = WORLD // tp, dist.get_rank() // tp, dist.get_rank() % tp
    loop.opt.zero_grad()
    for micro in range(2):
        loop.model.set_requires_gradient_sync(micro == 1)
        g = torch.Generator().manual_seed(100 * step + micro)
        x, y = torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)
        x, y = x[d * BATCH // dp:(d + 1) * BATCH // dp], y[d * BATCH // dp:(d + 1) * BATCH // dp]
        if setup.style == "sequence":  # each tp rank its piece of the sequence, in and out
            x, y = x[:, t * SEQ // tp:(t + 1) * SEQ // tp], y[:, t * SEQ // tp:(t + 1) * SEQ // tp]
        (F.mse_loss(loop.model(x), y) / 2).backward()
    if setup.clip == "opt" and hasattr(loop.opt, "clip_grad_norm_"):
        norm = loop.opt.clip_grad_norm_(CLIP)
    else:
        norm = torch.nn.utils.clip_grad_norm_(loop.model.parameters(), CLIP)
    loop.opt.step()
    loop.scheduler.step()
    return float(h._full(norm))


def _state(loop: h.Loop) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(loop.model), "optim": get_optimizer_state_dict(loop.model, loop.opt)}


def save(path: str, loop: h.Loop, staged: bool = False) -> None:
    """``dcp.save``; ``staged``: ``dcp.async_save`` with torch's ``DefaultStager`` (staging in the background,
    pinned where an accelerator can pin), waited for."""
    import torch.distributed.checkpoint as dcp

    torch.save(loop.scheduler.state_dict(), f"{path}.{dist.get_rank()}.schedule")
    if not staged:
        dcp.save(_state(loop), checkpoint_id=path)
    else:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        pin = torch.cuda.is_available()
        stager = DefaultStager(StagingOptions(use_pinned_memory=pin, use_shared_memory=False, use_async_staging=True,
                                              use_non_blocking_copy=pin))
        response = dcp.async_save(_state(loop), checkpoint_id=path, async_stager=stager)
        response.staging_completion.result()
        response.upload_completion.result()
        stager.close()
    dist.barrier()


def load(path: str, loop: h.Loop) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    sd = _state(loop)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(loop.model, sd["model"])
    set_optimizer_state_dict(loop.model, loop.opt, sd["optim"])
    loop.scheduler.load_state_dict(torch.load(f"{path}.{dist.get_rank()}.schedule"))


def train(rank: int, world: int, setup: Setup, save_as: Optional[str] = None, start_from: Optional[str] = None,
          staged: bool = False, to_at: Optional[int] = None) -> List[Optional[h.Snapshot]]:
    """``setup`` from step 0 (or, ``start_from``: a checkpoint loaded into a model built from another seed, from
    :data:`SAVE_AT`) to :data:`STEPS`, saving ``save_as`` before :data:`SAVE_AT`; ``to_at``: before that step,
    ``model.to(torch.device("cpu", 0))`` (the device it is on; a copy). A snapshot per step (rank 0's)."""
    workdir = os.environ["ACCEPTANCE_WORKDIR"]
    loop = build(setup, seed=0 if start_from is None else 1)
    first = 0
    if start_from is not None:
        load(os.path.join(workdir, start_from), loop)
        first = SAVE_AT
    snaps: List[Optional[h.Snapshot]] = [None] * first
    for step in range(first, STEPS):
        if step == SAVE_AT and save_as:
            save(os.path.join(workdir, save_as), loop, staged)
        if step == to_at:
            loop.model.to(torch.device("cpu", 0))
        snaps.append(h.snapshot(loop, train_step(loop, setup, step), rank, last=step == STEPS - 1))
    return snaps


def saved_per_rank(rank: int, world: int, setup: Setup) -> List[Optional[h.Snapshot]]:
    """Before :data:`SAVE_AT`, each rank's ``model.state_dict()`` and ``opt.state_dict()`` as they are (DTensors of
    this rank's pieces) through ``copy.deepcopy`` and ``torch.save``/``torch.load``, loaded with ``load_state_dict``
    into a model and optimizer built from another seed on the same mesh; a snapshot per step."""
    import io

    loop = build(setup)
    snaps: List[Optional[h.Snapshot]] = []
    for step in range(STEPS):
        if step == SAVE_AT:
            buffer = io.BytesIO()
            torch.save(copy.deepcopy({"model": loop.model.state_dict(), "optim": loop.opt.state_dict(),
                                      "schedule": loop.scheduler.state_dict()}), buffer)
            del loop
            loop = build(setup, seed=1)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=False)
            loop.model.load_state_dict(saved["model"])
            loop.opt.load_state_dict(saved["optim"])
            loop.scheduler.load_state_dict(saved["schedule"])
        snaps.append(h.snapshot(loop, train_step(loop, setup, step), rank, last=step == STEPS - 1))
    return snaps


def placements(rank: int, world: int) -> Dict[str, Dict[str, str]]:
    """Each style's parameters' placements and this rank's local shapes on (2 x 2)."""
    out = {}
    for style in STYLES:
        loop = build(Setup(style, ADAMW))
        out[style] = {n: f"{tuple(p.placements)} {tuple(p.to_local().shape)}" for n, p in loop.model.named_parameters()}
    return out


def sharded_async_save(rank: int, world: int, staged: bool) -> Dict[str, Any]:
    """The ``process_group=`` route (no FSDP2): ``dcp.async_save`` of ``opt.sharded_state_dict()`` after two
    steps, on a process group of its own (its collectives run in the upload's thread, beside the training's), two
    steps more before the upload is waited for; then ``dcp.load`` into a new optimizer. Returns the entries that
    differ from the state at the save, and those the two steps changed (which must be some)."""
    import torch.distributed.checkpoint as dcp

    path = os.path.join(os.environ["ACCEPTANCE_WORKDIR"], f"sharded-async-{staged}")
    group = dist.new_group(backend="gloo")

    def make(seed):
        torch.manual_seed(seed)
        model = Mlp()
        return model, OffloadOptimizer(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                      process_group=dist.group.WORLD, bucket_numel=64)

    def step(model, opt, s):
        g = torch.Generator().manual_seed(s)
        opt.zero_grad()
        F.mse_loss(model(torch.randn(2, DIM, generator=g)), torch.randn(2, DIM, generator=g)).backward()
        opt.step()

    def pieces(sd):
        return {f"{k}[{n}]": (v.local if hasattr(v, "local") else v).clone()
                for k, entry in sd["state"].items() for n, v in entry.items()}

    model, opt = make(0)
    for s in range(2):
        step(model, opt, s)
    sd = opt.sharded_state_dict()
    at_save = pieces(sd)
    kw: Dict[str, Any] = {}
    if staged:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        pin = torch.cuda.is_available()
        kw["async_stager"] = DefaultStager(StagingOptions(use_pinned_memory=pin, use_shared_memory=False,
                                                          use_async_staging=True, use_non_blocking_copy=pin))
    response = dcp.async_save({"optim": sd}, checkpoint_id=path, process_group=group, **kw)
    staging = getattr(response, "staging_completion", None)
    if staging is not None:
        staging.result()
    for s in range(2, 4):
        step(model, opt, s)
    getattr(response, "upload_completion", response).result()
    if staged:
        kw["async_stager"].close()
    dist.barrier()
    now = pieces(opt.sharded_state_dict())
    other_model, other = make(1)
    loaded = {"optim": other.sharded_state_dict()}
    dcp.load(loaded, checkpoint_id=path)
    other.load_sharded_state_dict(loaded["optim"])
    got = pieces(other.sharded_state_dict())
    return dict(differ=[k for k, v in at_save.items() if not torch.equal(got[k], v)],
                moved=[k for k, v in at_save.items() if v.numel() and not torch.equal(now[k], v)],
                entries=len(at_save))



def _poisoned_backward(loop: h.Loop, setup: Setup, where: str) -> torch.Tensor:
    """One backward, then an inf written into rank 3's local piece of ``where``'s gradient (through ``to_local()``:
    no DTensor op, which moves only the local tensor's version counter)."""
    tp = setup.shape[-1]
    dp, d, t = WORLD // tp, dist.get_rank() // tp, dist.get_rank() % tp
    loop.opt.zero_grad()
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(7))[d * BATCH // dp:(d + 1) * BATCH // dp]
    if setup.style == "sequence":
        x = x[:, t * SEQ // tp:(t + 1) * SEQ // tp]
    loop.model(x).square().mean().backward()
    return dict(loop.model.named_parameters())[where].grad.to_local()


def skip_an_inf_on_one_rank(rank: int, world: int, make_opt: Any, style: str, where: str) -> List[Any]:
    """Two steps, then one whose gradient holds an inf in rank 3's piece of ``where`` (a piece replicated over
    ``tp`` for the ``sequence`` style's norm, a rowwise bias), written before the clip: ours (``nonfinite="skip"``)
    skips it on every rank; AdamW is not stepped there (the reference of a skipped step); then two more steps.
    Snapshots of each step (rank 0's) and ours' ``skipped_steps`` (every rank's)."""
    setup = Setup(style, make_opt)
    loop = build(setup)
    snaps = []
    for step in range(5):
        if step != 2:
            snaps.append(h.snapshot(loop, train_step(loop, setup, step), rank, last=step == 4))
            continue
        local = _poisoned_backward(loop, setup, where)
        if rank == 3:
            local.view(-1)[0] = float("inf")
        if hasattr(loop.opt, "clip_grad_norm_"):
            loop.opt.clip_grad_norm_(CLIP)
            loop.opt.step()
        loop.scheduler.step()
        snaps.append(h.snapshot(loop, None, rank, last=False))
    return [snaps, getattr(loop.opt, "skipped_steps", None)]


def edit_after_the_clip(rank: int, world: int) -> Tuple[Optional[str], bool]:
    """``opt.clip_grad_norm_``, then rank 3 writes an inf into its local piece of a gradient, then ``step()``: the
    edit is refused as any edit between the two is (docs/differences.md), on this rank; whether the parameters
    are as they were."""
    setup = Setup("colwise", OURS)
    loop = build(setup)
    train_step(loop, setup, 0)
    local = _poisoned_backward(loop, setup, "fc1.weight")
    loop.opt.clip_grad_norm_(CLIP)
    if rank == 3:
        local.view(-1)[0] = float("inf")
    return h.step_refused(loop.model, loop.opt)


def _jobs() -> Dict[str, Any]:
    jobs: Dict[str, Any] = {"placements": h.Call(placements)}
    for style in STYLES:
        for who, make_opt in (("adamw", ADAMW), ("ours", OURS)):
            clip = "opt" if style != "colwise" else "torch"
            jobs[f"{style}/{who}"] = h.Call(train, (Setup(style, make_opt, clip=clip), f"{style}-{who}"))
            for shape in ((4, 1), (1, 4)):
                jobs[f"{style}{shape}/{who}"] = h.Call(train, (Setup(style, make_opt, shape, clip), None,
                                                               f"{style}-{who}"))
    for who, make_opt in (("adamw", ADAMW), ("ours", OURS)):
        jobs[f"hsdp-tp/{who}"] = h.Call(train, (Setup("rowwise", make_opt, (2, 1, 2)), f"hsdp-{who}"))
        jobs[f"hsdp-tp->2x2/{who}"] = h.Call(train, (Setup("rowwise", make_opt), None, f"hsdp-{who}"))
        jobs[f"to-same-device/{who}"] = h.Call(train, (Setup("sequence", make_opt), None, None, False, 3))
        jobs[f"saved-per-rank/{who}"] = h.Call(saved_per_rank, (Setup("colwise", make_opt),))
        jobs[f"to-same-device-offload/{who}"] = h.Call(train, (Setup("rowwise", make_opt, cpu_offload=True), None,
                                                               None, False, 3))
        jobs[f"staged-async/{who}"] = h.Call(train, (Setup("colwise", make_opt), f"staged-{who}", None, True))
        jobs[f"staged-async->4x1/{who}"] = h.Call(train, (Setup("colwise", make_opt, (4, 1)), None, f"staged-{who}"))
    for staged in (False, True):
        jobs[f"sharded-async/{staged}"] = h.Call(sharded_async_save, (staged,))
    for style, where in (("sequence", "norm.weight"), ("rowwise", "fc2.bias")):
        for who, make_opt in (("adamw", ADAMW), ("ours", functools.partial(OURS, nonfinite="skip"))):
            jobs[f"skip/{style}/{who}"] = h.Call(skip_an_inf_on_one_rank, (make_opt, style, where))
    jobs["edit-after-clip"] = h.Call(edit_after_the_clip)
    return jobs


@pytest.fixture(scope="module")
def acceptance(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ACCEPTANCE_WORKDIR", str(tmp_path_factory.mktemp("acceptance-tp")))
        yield h.run_jobs(WORLD, _jobs(), timeout=900)


def _rank0(acceptance, job):
    return acceptance[job].per_rank[0]


# ----------------------------------------------------------------------------------------------------- tests --
def test_the_model_has_uneven_pieces_over_both_dimensions(acceptance):
    """What the tests are about: pieces of other sizes on different ranks, Replicate over tp (biases, the norm)."""
    placed = acceptance["placements"].per_rank
    shapes = {placed[r]["colwise"]["fc2.weight"].split(") ")[-1] for r in placed}
    assert len(shapes) > 1, shapes  # (4, 3) rows over tp, then over dp: uneven
    placed = placed[0]
    assert placed["rowwise"]["fc1.bias"].startswith("(Shard(dim=0), Replicate())"), placed["rowwise"]
    assert placed["sequence"]["norm.weight"].startswith("(Shard(dim=0), Replicate())"), placed["sequence"]


@pytest.mark.parametrize("style", STYLES)
def test_each_style_on_2x2_matches_adamw_for_20_clipped_accumulated_steps(acceptance, style):
    expected = _rank0(acceptance, f"{style}/adamw")
    h.assert_moved(expected, style)
    assert all(s.norm > CLIP for s in expected), [s.norm for s in expected]
    h.assert_same(expected, _rank0(acceptance, f"{style}/ours"), style)


@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
@pytest.mark.parametrize("style", STYLES)
def test_a_2x2_checkpoint_resumes_on_another_mesh_as_adamws(acceptance, style, shape):
    expected = _rank0(acceptance, f"{style}{shape}/adamw")
    h.assert_moved(expected[SAVE_AT:], f"{style} {shape}")
    h.assert_same(expected, _rank0(acceptance, f"{style}{shape}/ours"), f"{style} {shape}", first=SAVE_AT)


def test_hsdp_with_tp_steps_checkpoints_and_resumes_on_2x2(acceptance):
    h.assert_same(_rank0(acceptance, "hsdp-tp/adamw"), _rank0(acceptance, "hsdp-tp/ours"), "HSDP + TP")
    h.assert_same(_rank0(acceptance, "hsdp-tp->2x2/adamw"), _rank0(acceptance, "hsdp-tp->2x2/ours"),
                  "HSDP + TP -> (2 x 2)", first=SAVE_AT)


def test_each_ranks_own_state_dicts_saved_and_loaded_on_the_same_mesh_resume_as_adamws(acceptance):
    """``torch.save`` of a deep copy of each rank's ``model.state_dict()`` and ``opt.state_dict()`` (DTensors with
    ``_StridedShard`` placements under ``colwise``), loaded into a new model and optimizer."""
    expected = _rank0(acceptance, "saved-per-rank/adamw")
    h.assert_same(_rank0(acceptance, "colwise/adamw"), expected, "AdamW's own round trip")
    h.assert_same(expected, _rank0(acceptance, "saved-per-rank/ours"), "saved per rank")


@pytest.mark.parametrize("job", ["to-same-device", "to-same-device-offload"])
def test_model_to_its_own_device_under_fsdp2_and_tp_keeps_the_state(acceptance, job):
    """``model.to(torch.device("cpu", 0))`` before step 3 (accelerate's and the Trainer's call), which copies: ours
    follows as AdamW does, every step as AdamW's; also under ``CPUOffloadPolicy``, whose shards' storage the
    optimizer had taken over (FSDP re-makes it)."""
    h.assert_same(_rank0(acceptance, f"{job}/adamw"), _rank0(acceptance, f"{job}/ours"), f"{job}: model.to(cpu:0)")


def test_async_save_with_background_staging_round_trips_onto_another_mesh(acceptance):
    h.assert_same(_rank0(acceptance, "colwise/adamw"), _rank0(acceptance, "staged-async/ours"), "staged save")
    expected = _rank0(acceptance, "staged-async->4x1/adamw")
    h.assert_same(expected, _rank0(acceptance, "staged-async->4x1/ours"), "staged -> (4 x 1)", first=SAVE_AT)


@pytest.mark.parametrize("staged", [False, True], ids=["default", "background_staging"])
def test_async_save_of_the_sharded_state_dict_holds_the_state_at_the_save(acceptance, staged):
    """``process_group=`` route: before the fix DCP's staging raised ``TypeError: aten.new_empty.default on a
    FlatPiece``."""
    for rank, out in acceptance[f"sharded-async/{staged}"].per_rank.items():
        assert out["entries"] and out["differ"] == [], (rank, out)
        assert out["moved"], (rank, out)  # (the steps during the upload changed the live state)


@pytest.mark.parametrize("style", ["sequence", "rowwise"])
def test_an_inf_in_one_ranks_piece_skips_the_step_on_every_rank(acceptance, style):
    """``nonfinite="skip"``: the verdict spans the mesh (a replicated piece's inf on one tp peer only); every rank
    counts the skip, and the run goes on as AdamW's that was not stepped there."""
    expected = acceptance[f"skip/{style}/adamw"].per_rank[0][0]
    h.assert_same(expected, acceptance[f"skip/{style}/ours"].per_rank[0][0], f"skip {style}")
    for rank, (_, skipped) in acceptance[f"skip/{style}/ours"].per_rank.items():
        assert skipped == 1, (rank, skipped)


def test_an_edit_of_a_local_gradient_after_the_clip_is_refused_and_changes_nothing(acceptance):
    """Was: the edit went unseen (a write into ``to_local()`` moves no DTensor version counter) and the step
    applied the inf the clip had not seen, on rank 3's piece only."""
    message, kept = acceptance["edit-after-clip"].per_rank[3]
    assert message is not None and "the gradients changed after opt.clip_grad_norm_" in message, message
    for rank, (message, kept) in acceptance["edit-after-clip"].per_rank.items():
        assert kept, rank


# ------------------------------------------------------------------------------------------ single process --
def _small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _loss(model, step):
    g = torch.Generator().manual_seed(step)
    return F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 4, generator=g))


def test_an_optimizer_orphaned_by_model_to_warns_naming_model_to():
    """``model.to()`` that makes new ``Parameter`` objects (here under
    ``torch.__future__.set_overwrite_module_params_on_conversion(True)``; a move to the meta device does too) leaves
    the optimizer over the old ones: one warning at the third step without gradients names ``model.to()``."""
    model = _small()
    opt = OffloadOptimizer(model.parameters(), lr=LR)
    before = list(model.parameters())
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.to(torch.device("cpu", 0))
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
    assert all(p is not q for p, q in zip(before, model.parameters()))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(4):
            opt.zero_grad()
            model.zero_grad()
            _loss(model, step).backward()
            opt.step()
    messages = [str(w.message) for w in record if "has ever had a gradient" in str(w.message)]
    assert len(messages) == 1, messages
    assert "model.to()" in messages[0] and "built before fully_shard" in messages[0], messages[0]


@pytest.mark.cuda
def test_a_gpu_model_moved_to_the_cpu_is_refused_naming_both_devices_and_nothing_changes():
    """A real move (issue 53, 3): ``model.cpu()`` after two steps on the GPU (the same ``Parameter`` objects, their
    data moved): refused, naming where the parameter was and is, the state as it was. (Not yet run on a GPU.)"""
    model = _small().cuda()
    opt = OffloadOptimizer(model.parameters(), lr=LR)
    for step in range(2):
        opt.zero_grad()
        g = torch.Generator().manual_seed(step)
        F.mse_loss(model(torch.randn(4, 8, generator=g).cuda()), torch.randn(4, 4, generator=g).cuda()).backward()
        opt.step()
    before = copy.deepcopy(opt.state_dict())
    model.cpu()
    opt.zero_grad()
    # (refused in backward's hooks, where gradients stream, or at step())
    with pytest.raises(RuntimeError, match=r"moved, cast or reshaped .* it was torch\.float32 on cuda:0, it is now "
                                           r"torch\.float32 on cpu"):
        _loss(model, 2).backward()
        opt.step()
    after = opt.state_dict()
    for k, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(after["state"][k][key].cpu(), value.cpu()), (k, key)

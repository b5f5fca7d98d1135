"""A torchtitan-style user of FSDP2 + tensor parallelism, on CPU with gloo at world 4: what tests/test_fsdp2_tp.py
does not cover, each run against ``torch.optim.AdamW(foreach=False)`` on the same DTensor model (parameters and both
moments, gathered through DCP's ``get_optimizer_state_dict``, the clip's norm; every step, default fp32 tolerance).

The model (:class:`Titan`) is parallelized as torchtitan's Llama recipe does: the embedding ``RowwiseParallel`` (its
weight ``Shard(0)`` over the vocabulary) and tied to the output projection (``ColwiseParallel``, ``Shard(0)`` too,
re-tied after ``parallelize_module``), the loss under ``loss_parallel``, ``SequenceParallel`` norms, each block's
input through ``PrepareModuleInput``, a ``RowwiseParallel`` linear with a bias (weight ``Shard(1)``, bias
``Replicate``), and a frozen parameter (``requires_grad=False``) in each block's unit; two param groups (no weight
decay for norms and biases, as torchtitan builds them) and a warm-up ``LambdaLR``.

Beside it (the tests name each run): both clips and their mix; ``fully_shard``'s options (mixed precision, no or an
int reshard, ``CPUOffloadPolicy``); meshes torchtitan and users make (``tp`` outer, flattened ``dp_shard``/``cp``,
its HSDP, pipeline stages, two model parts); a loop's edits (frozen parameters given, ``add_param_group``, a tensor
``lr``, kept zero gradients, a matrix frozen mid-run); the optimizer built before ``parallelize_module`` (switched,
or warned); weights written after it was built (on the CUDA stand-ins); flattened and asynchronous DCP checkpoints
(resumed on a 1-D mesh, training during the upload); and the refusals of parameters in no ``fully_shard`` unit and
of a meta-device model.

All jobs run in one spawn of 4 ranks (the ``titan`` fixture); the tests read their outcomes.
"""

from __future__ import annotations

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
VOCAB, DIM, FFN, BATCH, SEQ = 16, 8, 12, 4, 4
STEPS, RESUME_AT = 4, 2
LR, CLIP, SECOND_CLIP = 1e-2, 0.5, 0.3
ADAMW = functools.partial(torch.optim.AdamW, foreach=False)
OURS = OffloadOptimizer


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, FFN, bias=False)
        self.wo = nn.Linear(FFN, DIM)  # RowwiseParallel: weight Shard(1), bias Replicate()

    def forward(self, x):
        return self.wo(F.gelu(self.wq(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.attention = Attention()
        self.gate = nn.Parameter(torch.full((DIM,), 0.5), requires_grad=False)  # frozen, in the block's unit

    def forward(self, x):
        return x + self.attention(self.attention_norm(x)) * (1 + self.gate)


class Titan(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, ids):
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


@dataclasses.dataclass(frozen=True)
class Run:
    """One training loop: ``clip`` is ``"torch"``, ``"opt"`` (``opt.clip_grad_norm_``, torch's for AdamW),
    ``"both"`` (torch's at :data:`CLIP`, then ``opt.clip_grad_norm_`` at :data:`SECOND_CLIP`; torch's twice for
    AdamW), ``"full"`` (torch's arithmetic on full tensors: where torch's own clip fails) or ``"none"``; ``names``
    the mesh's dimensions (``tp`` last or first; ``("dp_shard", "cp", "tp")``: torchtitan's, the first two flattened
    into ``dp``; ``("dp_replicate", "dp_shard", "cp", "tp")``: torchtitan's HSDP, ``fully_shard`` over
    ``dp_replicate`` and the flattened ``dp_shard_cp``); ``tp=False``: FSDP2 alone on a 1-D mesh of 4; ``edits``:
    the frozen parameters given too, the second param group added by ``add_param_group``, ``lr`` a tensor,
    ``zero_grad(set_to_none=False)``, and a matrix frozen from step 2 on."""

    make_opt: Any
    clip: str = "torch"
    mp: bool = False
    cpu_offload: bool = False
    reshard: Any = True
    tp: bool = True
    names: Tuple[str, ...] = ("dp", "tp")
    shape: Tuple[int, ...] = (2, 2)
    edits: bool = False  # what a loop may do besides: see param_groups and train_step


def _tp_plans() -> Tuple[Dict[str, Any], Dict[str, Any]]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
           "norm": SequenceParallel(),
           "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    block = {"attention_norm": SequenceParallel(),
             "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
             "attention.wq": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1))}
    return top, block


def _mesh(run: Run) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if not run.tp:
        return init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    mesh = init_device_mesh("cpu", run.shape, mesh_dim_names=run.names)
    if "dp_shard" in run.names:
        mesh[("dp_shard", "cp")]._flatten("dp_shard_cp" if "dp_replicate" in run.names else "dp")
    return mesh


def _dp(mesh: Any) -> Any:
    """The mesh ``fully_shard`` takes (torchtitan's HSDP: the replicate and the flattened shard dimensions)."""
    if "dp_replicate" in mesh.mesh_dim_names:
        return mesh[("dp_replicate", "dp_shard_cp")]
    return mesh["dp"]


def param_groups(model: nn.Module, make_opt: Any, edits: bool = False) -> torch.optim.Optimizer:
    """torchtitan's way: weight decay for matrices, none for norms and biases; frozen parameters left out
    (``edits``: given, the second group added after construction, ``lr`` a tensor)."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        if p.requires_grad or edits:
            (plain if p.ndim < 2 or "norm" in name else decay).append(p)
    lr = torch.tensor(LR) if edits else LR
    opt = make_opt([{"params": decay, "weight_decay": 0.1}] + ([] if edits else [{"params": plain,
                   "weight_decay": 0.0}]), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    if edits:
        opt.add_param_group({"params": plain, "weight_decay": 0.0})
    return opt


def parallelize(model: Titan, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    top, block = _tp_plans()
    parallelize_module(model, mesh["tp"], top)
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], block)
    model.output.weight = model.tok_embeddings.weight  # (each module got a parameter of its own: tie them again)


def shard(model: nn.Module, mesh: Any, run: Run, units: Any = None) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw: Dict[str, Any] = dict(reshard_after_forward=run.reshard)
    if run.mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if run.cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    dp = _dp(mesh)
    for layer in model.layers if units is None else units:
        fully_shard(layer, mesh=dp, **kw)
    if units is None:
        fully_shard(model, mesh=dp, **{**kw, "reshard_after_forward": run.reshard is not False})


def build(run: Run, seed: int = 0, switched: Optional[bool] = None) -> h.Loop:
    """``switched``: the optimizer built over the plain model first; True switches its groups' params to the
    DTensors by name afterwards (accelerate's preparation), False leaves it over the plain parameters."""
    mesh = _mesh(run)
    torch.manual_seed(seed)
    model = Titan()
    early = param_groups(model, run.make_opt, run.edits) if switched is not None else None
    names = {id(p): n for n, p in model.named_parameters()}
    if run.tp:
        parallelize(model, mesh)
    shard(model, mesh, run)
    opt = early or param_groups(model, run.make_opt, run.edits)
    if switched:
        now = dict(model.named_parameters())
        for group in opt.param_groups:
            group["params"] = [now[names[id(p)]] for p in group["params"]]
    return h.Loop(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 2) * 0.9 ** i))


def _coords(run: Run) -> Tuple[int, int, bool]:
    """This rank's data-parallel index, the data-parallel size, whether the loss is tensor-parallel."""
    rank = dist.get_rank()
    if not run.tp:
        return rank, WORLD, False
    if run.names[0] == "tp" and len(run.names) == 2:
        return rank % run.shape[1], run.shape[1], True
    return rank // run.shape[-1], WORLD // run.shape[-1], True


def _clip(loop: h.Loop, run: Run) -> Optional[torch.Tensor]:
    params = [p for p in loop.model.parameters() if p.requires_grad]
    ours = hasattr(loop.opt, "clip_grad_norm_")
    if run.clip == "full":
        return (loop.opt.clip_grad_norm_(CLIP) if ours else tp_tests.clip_by_full_tensors(params, CLIP))
    norm = None
    if run.clip in ("torch", "both") or (run.clip == "opt" and not ours):
        norm = torch.nn.utils.clip_grad_norm_(params, CLIP)
    if run.clip == "opt" and ours:
        norm = loop.opt.clip_grad_norm_(CLIP)
    if run.clip == "both":
        norm = loop.opt.clip_grad_norm_(SECOND_CLIP) if ours else torch.nn.utils.clip_grad_norm_(params, SECOND_CLIP)
    return norm


def train_step(loop: h.Loop, run: Run, step: int) -> Optional[float]:
    from torch.distributed.tensor.parallel import loss_parallel

    if run.edits and step == 2:
        loop.model.layers[0].attention.wq.weight.requires_grad_(False)
    loop.opt.zero_grad(set_to_none=not run.edits)
    d, dp, parallel_loss = _coords(run)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    ids = ids[d * BATCH // dp:(d + 1) * BATCH // dp]
    logits = loop.model(ids[:, :-1])
    if parallel_loss:
        with loss_parallel():
            F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(0, 1)).backward()
    else:
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(0, 1)).backward()
    norm = _clip(loop, run)
    loop.opt.step()
    loop.scheduler.step()
    return None if norm is None else float(h._full(norm))


def train(rank: int, world: int, run: Run, switched: Optional[bool] = None,
          resume: Optional[Tuple[str, Run]] = None) -> List[Optional[h.Snapshot]]:
    """``run`` for :data:`STEPS` steps, a snapshot per step; ``resume=(how, then)``: before :data:`RESUME_AT`, a
    checkpoint (:func:`checkpoint_and_resume`) and a new model and optimizer built by ``then``."""
    loop = build(run, switched=switched)
    snaps = []
    for step in range(STEPS):
        if resume is not None and step == RESUME_AT:
            loop, run = checkpoint_and_resume(loop, *resume), resume[1]
        norm = train_step(loop, run, step)
        snaps.append(h.snapshot(loop, norm, rank, last=step == STEPS - 1))
    return snaps


def checkpoint_and_resume(loop: h.Loop, how: str, then: Run) -> h.Loop:
    """``"flat"``: ``dcp.save`` / ``dcp.load`` with ``flatten_optimizer_state_dict=True``; ``"async"``:
    ``dcp.async_save`` (waited for), loaded with ``dcp.load`` into ``then``'s model (another mesh)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(flatten_optimizer_state_dict=how == "flat")
    path = os.path.join(os.environ["TITAN_WORKDIR"], f"{how}-{type(loop.opt).__name__}")

    def state(l: h.Loop) -> Dict[str, Any]:
        return {"model": get_model_state_dict(l.model, options=options),
                "optim": get_optimizer_state_dict(l.model, l.opt, options=options)}

    schedule = loop.scheduler.state_dict()
    if how == "async":
        future = dcp.async_save(state(loop), checkpoint_id=path)
        getattr(future, "upload_completion", future).result()
    else:
        dcp.save(state(loop), checkpoint_id=path)
    dist.barrier()
    del loop
    new = build(then, seed=1)
    sd = state(new)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(new.model, sd["model"], options=options)
    set_optimizer_state_dict(new.model, new.opt, sd["optim"], options=options)
    new.scheduler.load_state_dict(schedule)
    return new


def flat_full_state(rank: int, world: int, make_opt: Any) -> Optional[Dict[str, Any]]:
    """After two steps: ``get_optimizer_state_dict`` with ``full_state_dict=True, cpu_offload=True,
    flatten_optimizer_state_dict=True`` (rank 0's)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    run = Run(make_opt)
    loop = build(run)
    for step in range(2):
        train_step(loop, run, step)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)
    flat = get_optimizer_state_dict(loop.model, loop.opt, options=options)
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in flat.items()} if rank == 0 else None


def built_before_parallelize(rank: int, world: int) -> List[str]:
    """The optimizer built over the plain model, never switched: the warnings of three steps."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loop = build(Run(OURS), switched=False)
        for step in range(3):
            train_step(loop, Run(OURS), step)
    return [str(w.message) for w in record if "OffloadOptimizer" in str(w.message)]


def pipeline_stages(rank: int, world: int, make_opt: Any) -> List[Dict[str, torch.Tensor]]:
    """A (pp 2, dp 1, tp 2) mesh: each stage its own model (seed: the stage) and optimizer, trained on its own
    batches; each step's full parameters and moments (every rank's)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    stage = mesh.get_local_rank("pp")
    torch.manual_seed(stage)
    model = Titan()
    parallelize(model, mesh)
    shard(model, mesh, Run(make_opt))
    loop = h.Loop(model, param_groups(model, make_opt), None)
    loop.scheduler = torch.optim.lr_scheduler.LambdaLR(loop.opt, lambda i: 1.0)
    out = []
    for step in range(STEPS):
        train_step(loop, Run(make_opt, clip="opt", shape=(1, 2)), 100 * stage + step)
        out.append({**{n: p.full_tensor() for n, p in model.named_parameters()},
                    **{f"{n}[{k}]": v.full_tensor() for n, p in model.named_parameters()
                       for k, v in loop.opt.state.get(p, {}).items() if k != "step"}})
    return out


def left_out_on_a_flattened_mesh(rank: int, world: int, make_opt: Any) -> List[Optional[h.Snapshot]]:
    """tests/test_fsdp2_tp.py's ``mixed`` model (``down`` left out of TP) under torchtitan's flattened ``dp``:
    ``up`` on FSDP's (dp, tp) mesh, ``down`` on the flattened ``dp`` alone; ours clipped by ``opt.clip_grad_norm_``,
    AdamW by torch's arithmetic on full tensors (torch's clip refuses two meshes)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = _mesh(Run(make_opt, names=("dp_shard", "cp", "tp"), shape=(2, 1, 2)))
    torch.manual_seed(0)
    model = tp_tests.Net(norm=False)
    parallelize_module(model, mesh["tp"], tp_tests._plan("mixed"))
    fully_shard(model, mesh=mesh["dp"])
    loop = h.Loop(model, make_opt(model.parameters(), lr=LR, weight_decay=0.1))
    setup = tp_tests.Setup("mixed", make_opt, clip_with="opt" if make_opt is OURS else "full")
    snaps = []
    for step in range(STEPS):
        snaps.append(h.snapshot(loop, tp_tests.train_step(loop, setup, step), rank, last=step == STEPS - 1))
    return snaps


def two_model_parts(rank: int, world: int, make_opt: Any) -> List[List[Optional[h.Snapshot]]]:
    """Two model chunks on every rank (interleaved pipeline stages), one optimizer each, over the same mesh: one
    backward through both, each clipped and stepped in turn (torchtitan's optimizer container); each part's
    snapshots."""
    run = Run(make_opt, clip="opt")
    parts = [build(run, seed=0), build(run, seed=5)]
    d, dp, _ = _coords(run)
    snaps: List[List[Optional[h.Snapshot]]] = [[], []]
    for step in range(STEPS):
        from torch.distributed.tensor.parallel import loss_parallel

        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        ids = ids[d * BATCH // dp:(d + 1) * BATCH // dp]
        for part in parts:
            part.opt.zero_grad(set_to_none=True)
        with loss_parallel():
            sum(F.cross_entropy(part.model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten(0, 1))
                for part in parts).backward()
        for i, part in enumerate(parts):
            norm = _clip(part, run)
            part.opt.step()
            snaps[i].append(h.snapshot(part, float(h._full(norm)), rank, last=step == STEPS - 1))
    return snaps


def weights_written_after_the_optimizer(rank: int, world: int, make_opt: Any) -> List[Optional[h.Snapshot]]:
    """torchtitan's meta-device start (``parallelize_module``, ``fully_shard``, ``to_empty``) with the weights
    written into the shards only after the optimizer was built, on the CUDA stand-ins for ours (a host master apart
    from the shard, to be taken from the written weights at its first update, not from ``to_empty``'s memory)."""
    import contextlib

    import cuda_standins
    from zero_offload.topology.mesh import _piece

    run = Run(make_opt)
    mesh = _mesh(run)
    torch.manual_seed(0)
    weights = dict(Titan().named_parameters())
    with cuda_standins.installed() if make_opt is OURS else contextlib.nullcontext([True]) as planned:
        with torch.device("meta"):
            model = Titan()
        parallelize(model, mesh)
        shard(model, mesh, run)
        model.to_empty(device="cpu")
        opt = param_groups(model, make_opt)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.to_local().copy_(_piece(weights[name].detach(), p))
        loop = h.Loop(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 2) * 0.9 ** i))
        snaps = [h.snapshot(loop, train_step(loop, run, step), rank, last=step == STEPS - 1) for step in range(STEPS)]
    if not planned:
        raise AssertionError("no optimizer was built on the stand-in device")
    return snaps


def training_while_async_save_uploads(rank: int, world: int, make_opt: Any) -> List[str]:
    """``dcp.async_save`` after two steps, two more steps before waiting for its upload: the checkpoint holds the
    state as it was at the save (``dcp.load`` into a new optimizer). Returns the entries that differ."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    run, path = Run(make_opt), os.path.join(os.environ["TITAN_WORKDIR"], f"overlap-{make_opt is OURS}")
    loop = build(run)
    for step in range(2):
        train_step(loop, run, step)
    sd = get_optimizer_state_dict(loop.model, loop.opt)
    at_save = {(k, n): v.to_local().clone() for k, e in sd["state"].items() for n, v in e.items() if v.dim()}
    # (a group of its own: the upload's collectives run in its thread, and on the group the steps use they would
    # interleave with theirs, which gloo does not survive: docs/multi-gpu.md)
    future = dcp.async_save({"optim": sd}, checkpoint_id=path, process_group=dist.new_group(backend="gloo"))
    for step in range(2, 4):
        train_step(loop, run, step)
    getattr(future, "upload_completion", future).result()
    dist.barrier()
    other = build(run, seed=1)
    train_step(other, run, 0)
    loaded = {"optim": get_optimizer_state_dict(other.model, other.opt)}
    dcp.load(loaded, checkpoint_id=path)
    return [f"{k}[{n}]" for (k, n), v in at_save.items()
            if not torch.equal(loaded["optim"]["state"][k][n].to_local(), v)] + ([] if at_save else ["no state"])


def refuse_meta_before_to_empty(rank: int, world: int) -> Optional[str]:
    """torchtitan's meta-device model, parallelized and sharded, given to the optimizer before ``to_empty``."""
    run = Run(OURS)
    mesh = _mesh(run)
    with torch.device("meta"):
        model = Titan()
    parallelize(model, mesh)
    shard(model, mesh, run)
    try:
        param_groups(model, OURS)
    except ValueError as exc:
        return str(exc)
    return None


def refuse_tp_outside_fsdp(rank: int, world: int) -> Optional[str]:
    """TP on the 2-D mesh, ``fully_shard`` on the blocks only: the embedding, norm and output are tensor-parallel
    DTensors no FSDP unit manages."""
    run = Run(OURS)
    mesh = _mesh(run)
    torch.manual_seed(0)
    model = Titan()
    parallelize(model, mesh)
    shard(model, mesh, run, units=list(model.layers))
    try:
        param_groups(model, OURS)
    except TypeError as exc:
        return str(exc)
    return None


def _jobs() -> Dict[str, Any]:
    runs = {"torch-clip": {}, "opt-clip": dict(clip="opt"), "both-clips": dict(clip="both"),
            "mp-no-reshard": dict(mp=True, reshard=False, clip="opt"), "cpu-offload": dict(cpu_offload=True),
            "1d-reshard-int": dict(tp=False, reshard=2), "tp-outer": dict(names=("tp", "dp"), clip="full"),
            "loop-edits": dict(edits=True, clip="opt"),
            "titan-hsdp": dict(names=("dp_replicate", "dp_shard", "cp", "tp"), shape=(2, 1, 1, 2), clip="opt")}
    jobs: Dict[str, Any] = {}
    for name, kw in runs.items():
        for who, make_opt in (("adamw", ADAMW), ("ours", OURS)):
            jobs[f"{name}/{who}"] = h.Call(train, (Run(make_opt, **kw),))
    jobs["switched/ours"] = h.Call(train, (Run(OURS), True))
    jobs["built-before/ours"] = h.Call(built_before_parallelize)
    for who, make_opt in (("adamw", ADAMW), ("ours", OURS)):
        jobs[f"flat-dcp/{who}"] = h.Call(train, (Run(make_opt), None, ("flat", Run(make_opt))))
        jobs[f"async-to-1d/{who}"] = h.Call(train, (Run(make_opt), None, ("async", Run(make_opt, tp=False))))
        jobs[f"flat-full/{who}"] = h.Call(flat_full_state, (make_opt,))
        jobs[f"pipeline/{who}"] = h.Call(pipeline_stages, (make_opt,))
        jobs[f"flattened-dp/{who}"] = h.Call(left_out_on_a_flattened_mesh, (make_opt,))
        jobs[f"two-parts/{who}"] = h.Call(two_model_parts, (make_opt,))
        jobs[f"written-after/{who}"] = h.Call(weights_written_after_the_optimizer, (make_opt,))
        jobs[f"async-overlap/{who}"] = h.Call(training_while_async_save_uploads, (make_opt,))
    jobs["refuse/tp-outside-fsdp"] = h.Call(refuse_tp_outside_fsdp)
    jobs["refuse/meta"] = h.Call(refuse_meta_before_to_empty)
    return jobs


@pytest.fixture(scope="module")
def titan(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("TITAN_WORKDIR", str(tmp_path_factory.mktemp("titan-checkpoints")))
    return h.run_jobs(WORLD, _jobs(), timeout=900)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


# ----------------------------------------------------------------------------------------------------- tests --
def _rank0(titan, job):
    return titan[job].per_rank[0]


@pytest.mark.parametrize("name", ["torch-clip", "opt-clip", "both-clips", "mp-no-reshard", "cpu-offload",
                                  "1d-reshard-int", "tp-outer", "loop-edits", "titan-hsdp"])
def test_titans_model_matches_adamw_every_step(titan, name):
    expected = _rank0(titan, f"{name}/adamw")
    h.assert_moved([dataclasses.replace(s, params={k: v for k, v in s.params.items() if "gate" not in k})
                    for s in expected], name)
    assert all(s.norm is not None for s in expected) or name == "1d-reshard-int"
    h.assert_same(expected, _rank0(titan, f"{name}/ours"), name)


def test_the_frozen_parameter_stays_as_built_and_has_no_state(titan):
    last = _rank0(titan, "torch-clip/ours")[-1]
    for i in range(2):
        torch.testing.assert_close(last.params[f"layers.{i}.gate"], torch.full((DIM,), 0.5), rtol=0, atol=0)
        assert f"layers.{i}.gate" not in last.state


def test_an_optimizer_built_before_parallelize_module_and_switched_matches_adamw(titan):
    h.assert_same(_rank0(titan, "torch-clip/adamw"), _rank0(titan, "switched/ours"), "switched")


def test_an_optimizer_left_over_the_plain_model_warns_naming_parallelize_module(titan):
    for rank, messages in titan["built-before/ours"].per_rank.items():
        assert len(messages) == 1 and "parallelize_module" in messages[0], (rank, messages)


@pytest.mark.parametrize("how", ["flat-dcp", "async-to-1d"])
def test_checkpoints_resume_as_adamws(titan, how):
    """``flat-dcp``: flattened optimizer state through DCP on the same mesh; ``async-to-1d``: ``dcp.async_save``
    on (2 x 2), resumed on a 1-D mesh of 4 without TP. Ours resumed continues as AdamW resumed."""
    expected = _rank0(titan, f"{how}/adamw")
    h.assert_same(expected, _rank0(titan, f"{how}/ours"), how)
    if how == "flat-dcp":  # (the same mesh: AdamW's resumed run is its uninterrupted one)
        h.assert_same(_rank0(titan, "torch-clip/adamw"), expected, "AdamW flat resumed")


def test_the_flattened_full_optimizer_state_dict_is_adamws(titan):
    expected, got = _rank0(titan, "flat-full/adamw"), _rank0(titan, "flat-full/ours")
    assert expected.keys() == got.keys(), sorted(set(expected) ^ set(got))
    moments = [k for k in expected if k.startswith("state.") and k.endswith("exp_avg_sq")]
    assert "state.layers.0.attention.wo.weight.exp_avg_sq" in moments and len(moments) == 13, moments
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[key], value, msg=lambda m: f"{key}: {m}")
        else:
            assert got[key] == value or key.endswith("foreach"), (key, got[key], value)


def test_pipeline_stages_each_match_adamw(titan):
    for rank, steps in titan["pipeline/adamw"].per_rank.items():
        ours = titan["pipeline/ours"].per_rank[rank]
        for step, (e, a) in enumerate(zip(steps, ours)):
            assert e.keys() == a.keys(), (rank, step)
            for key, value in e.items():
                torch.testing.assert_close(a[key], value, msg=lambda m: f"rank {rank} step {step} {key}: {m}")


def test_a_module_left_out_of_tp_on_torchtitans_flattened_mesh_matches_adamw(titan):
    h.assert_same(_rank0(titan, "flattened-dp/adamw"), _rank0(titan, "flattened-dp/ours"), "flattened dp")


def test_two_model_parts_with_an_optimizer_each_match_adamw(titan):
    for i, (expected, got) in enumerate(zip(_rank0(titan, "two-parts/adamw"), _rank0(titan, "two-parts/ours"))):
        h.assert_same(expected, got, f"part {i}")


def test_weights_written_after_the_optimizer_was_built_are_what_it_steps(titan):
    h.assert_same(_rank0(titan, "written-after/adamw"), _rank0(titan, "written-after/ours"), "written after")


@pytest.mark.parametrize("who", ["adamw", "ours"])
def test_steps_while_async_save_uploads_do_not_reach_the_checkpoint(titan, who):
    for rank, differ in titan[f"async-overlap/{who}"].per_rank.items():
        assert differ == [], (rank, differ)


def test_tensor_parallel_parameters_outside_every_fsdp_unit_are_refused_naming_them(titan):
    for rank, message in titan["refuse/tp-outside-fsdp"].per_rank.items():
        assert message is not None and "FSDP2 does not manage it" in message, (rank, message)
        assert "1-D mesh (2,) ('tp',)" in message and "no fully_shard unit" in message, (rank, message)
        assert "fully_shard(model) after the blocks" in message, (rank, message)


def test_a_meta_device_model_before_to_empty_is_refused_naming_it(titan):
    for rank, message in titan["refuse/meta"].per_rank.items():
        assert message is not None and "meta device" in message and "to_empty()" in message, (rank, message)

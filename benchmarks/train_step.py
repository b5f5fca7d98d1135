"""A whole training step of a GPT-style decoder on synthetic tokens: GPU-resident fused AdamW against
OffloadOptimizer (default, release_grads, overlap_step, delayed_update), torchao's CPUOffloadOptimizer and
DeepSpeed ZeRO-Offload, one after another in one process, each on a freshly built model from the same seed and on
the same batches.

On a GPU the recipe is the usual mixed precision: fp32 parameters, forward under
``torch.autocast("cuda", dtype=torch.bfloat16)``, fp32 gradients. DeepSpeed is the exception: its bf16 mode casts
the model to bf16 (fp32 masters on the host), which is how ZeRO-Offload is run in practice; its row says so.
On a CPU-only machine the model is fp32 on the CPU, the anchors are ``torch.optim.AdamW`` (foreach=False, whose
arithmetic ours reproduces, and fused), and no GPU figure can be measured: the script says so.

Columns (medians over ``--steps`` timed steps, after ``--warmup`` steps):
  step ms    one training iteration as a loop runs it. GPU: CUDA events recorded on the compute stream at each
             iteration start of a free-running pass (no synchronisation added by the benchmark), so the GPU
             timeline includes every gap where the GPU waited for the host (a CPU step, a copy wait). CPU: wall time.
  step x     step ms / the anchor's step ms.
  fwd ms     forward + loss, in a separate pass that synchronises the device between phases (CPU: the
             only pass; contenders take their steps interleaved, round by round).
  bwd ms     backward in that pass; for offloaders this includes the gradient copies streamed to the host during
             backward (the synchronisation waits for every stream, so a copy still in flight counts here).
  opt ms     ``step()`` + ``zero_grad()`` in that pass (for ours: waiting for the last copies, the CPU kernel where it
             was not already run during backward, and the upload of the parameters; with delayed_update: finishing
             the previous step's update that ran during this forward/backward, and its upload).
  added ms   step ms - (anchor step ms - anchor opt ms): what the step costs beyond the anchor's forward+backward.
  hidden     1 - added / W, clipped to [0, 100%], where W is the offload work done back to back with nothing to
             hide behind: gradients device->host + the CPU Adam kernel + parameters host->device, from probes
             measured in this run (pinned-copy bandwidth each way; our kernel over the same number of elements).
             For torchao and DeepSpeed W uses their bytes per parameter but our kernel's time: an estimate.
  peak GiB   torch.cuda.max_memory_allocated from building the model to the last timed step (reset before);
  peak x     over the anchor's.
  rsv GiB    torch.cuda.max_memory_reserved over the same span: what the caching allocator held at its peak,
             including gradient blocks that release_grads freed but a copy still reads (record_stream).
  rest GiB   torch.cuda.memory_allocated after the last step: parameters plus any optimizer state on the GPU.
  loss       loss of the last phased step (same seed and batches for all: a sanity check, not a result;
             delayed_update trains on parameters one step stale, DeepSpeed in pure bf16).

``--find-max`` instead searches, for each contender (by default AdamW, ``ours-release``, torchao and DeepSpeed),
the largest number of layers (at the preset's width) that trains one step without CUDA OOM, at
``--find-max-batch``; a size whose host state would not fit in the host's available RAM is not tried (reported
as bound by host RAM). A contender whose package is missing is reported as not installed. With ``--json`` the
file is rewritten after each contender, so a run cut short keeps what it measured.

    python benchmarks/train_step.py                            # CPU: tiny preset; GPU: 1.3b, batch 16
    python benchmarks/train_step.py --preset 1.3b --batch 16 --seq 1024 --steps 10
    python benchmarks/train_step.py --only adamw,ours-delayed --preset 350m
    python benchmarks/train_step.py --find-max --preset 1.3b
    python benchmarks/train_step.py --find-max --checkpoint --dtype bf16 --state-dtype int8   # the largest model
    python benchmarks/train_step.py --find-max --checkpoint --gpu-cap-gib 12                  # a 12 GiB GPU

Options that apply to every contender: ``--checkpoint`` (activation checkpointing of each block),
``--dtype bf16`` (every model built in bf16: AdamW then keeps bf16 moments, ours fp32 masters on the host),
``--clip MAX_NORM`` (the gradients' norm clipped every step, as each contender's users do it; not with
``overlap_step``),
``--gpu-cap-gib N`` (the process may allocate at most N GiB of the GPU). ``--state-dtype`` applies to ours only.
For ours, the host RAM a size needs is its own exact estimate (``estimate_host_memory`` over meta tensors).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import io
import json
import logging
import math
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zero_offload import OffloadOptimizer, functional  # noqa: E402
from zero_offload.cost_model import measure_copy_rate  # noqa: E402
from zero_offload.host_memory import available_host_bytes  # noqa: E402
from zero_offload.options import STATE_DTYPES, dtypes_by_name  # noqa: E402
from zero_offload.report import meta_params  # noqa: E402
from zero_offload import timeline as timeline_mod  # noqa: E402

LR, WD = 1e-4, 0.01
GIB = 2**30


@dataclasses.dataclass
class RunOptions:
    """What applies to every contender (set once from the command line): activation checkpointing, the model's
    dtype, gradient clipping, and the state dtype of ours."""

    checkpoint: bool = False
    clip: Optional[float] = None  # max norm of the gradients, each contender clipping its own way
    dtype: Optional[torch.dtype] = None  # None: each contender's own (fp32, DeepSpeed bf16)
    state_dtype: torch.dtype = torch.float32


RUN = RunOptions()
DTYPE_CHOICES = dtypes_by_name((torch.float32, torch.bfloat16))
STATE_DTYPE_CHOICES = dtypes_by_name(STATE_DTYPES)

# name -> (layers, d_model, heads); GPT-2/GPT-3 shapes. Embeddings are tied, so "1.3b" is GPT-3 XL's 1.3B.
PRESETS = {
    "tiny": (4, 256, 4),
    "small": (6, 512, 8),
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "760m": (24, 1536, 16),
    "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 32),
    "6.7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
}
# mode -> defaults for what a preset does not fix.
MODE_DEFAULTS = {
    "gpu": dict(preset="1.3b", seq=1024, batch=16, vocab=50304, steps=10, warmup=3),
    "cpu": dict(preset="tiny", seq=128, batch=4, vocab=8192, steps=20, warmup=2),
}


# ------------------------------------------------------------------------------------------------- the model --
@dataclasses.dataclass
class Config:
    layers: int
    d_model: int
    heads: int
    seq: int
    batch: int
    vocab: int

    def params(self) -> int:
        d = self.d_model
        return self.vocab * d + self.seq * d + self.layers * (12 * d * d + 13 * d) + 2 * d  # tied lm_head

    def describe(self) -> str:
        return (f"{self.layers} layers, d_model {self.d_model}, {self.heads} heads, seq {self.seq}, batch "
                f"{self.batch}, vocab {self.vocab}: {self.params() / 1e6:,.1f}M params, "
                f"{self.batch * self.seq:,} tokens/step")


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.vocab, cfg.d_model), nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.wte.weight
        self.checkpoint = RUN.checkpoint
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            # Activation checkpointing (--checkpoint): only each block's input is kept; backward recomputes it.
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint and self.training else block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def make_batches(cfg: Config, n: int, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(n):
        tok = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        out.append((tok[:, :-1].contiguous().to(device), tok[:, 1:].contiguous().to(device)))
    return out


def build_model(cfg: Config, device: torch.device, seed: int, dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(seed)  # seeds the CUDA generator too: every contender starts from the same weights
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # created in it: no transient copy in another dtype
    try:
        with torch.device(device):  # initialised where it trains: a CPU init of a multi-billion model takes minutes
            return GPT(cfg)
    finally:
        torch.set_default_dtype(previous)


# ------------------------------------------------------------------------------------------------ contenders --
class Runner:
    """One contender's training step, split into the phases the benchmark times."""

    label = ""

    def __init__(self, model: nn.Module, opt: Any, amp: bool):
        self.model, self.opt, self.amp = model, opt, amp

    def forward(self, x, y):
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if self.amp else contextlib.nullcontext()
        with ctx:
            return self.model(x, y)

    def backward(self, loss):
        loss.backward()

    def step(self):
        if RUN.clip is not None:
            self.clip(RUN.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def clip(self, max_norm: float):
        """Ours clips what it holds (released gradients included); the others clip the gradients on the model."""
        if isinstance(self.opt, OffloadOptimizer):
            self.opt.clip_grad_norm_(max_norm)
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def finish(self):
        """Apply anything still pending (delayed_update), so that the step is really done."""
        flush = getattr(self.opt, "flush", None)
        if flush is not None:
            flush()

    def close(self):
        self.model = self.opt = None


class DeepSpeedRunner(Runner):
    def __init__(self, engine):
        super().__init__(engine, engine.optimizer, amp=False)

    def forward(self, x, y):
        return self.model(x, y)

    def backward(self, loss):
        self.model.backward(loss)

    def step(self):
        self.model.step()  # the engine zeroes the gradients itself

    def finish(self):
        pass

    def close(self):
        destroy = getattr(self.model, "destroy", None)
        if destroy is not None:
            with contextlib.suppress(Exception):
                destroy()
        super().close()


def _import_torchao():
    errors = []
    for mod in ("torchao.optim", "torchao.prototype.low_bit_optim"):  # current path, then the older one
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                module = __import__(mod, fromlist=["CPUOffloadOptimizer"])
            return module.CPUOffloadOptimizer
        except Exception as exc:  # not installed, or an incompatible torch
            errors.append(f"{mod}: {type(exc).__name__}: {exc}")
    raise ImportError("torchao's CPUOffloadOptimizer is not importable (" + "; ".join(errors) + ")")


_DS_INITIALISED = False


def _deepspeed_engine(model: nn.Module, cfg: Config):
    """ZeRO stage 2, optimizer state offloaded to the CPU (DeepSpeedCPUAdam), bf16, on a world of one."""
    global _DS_INITIALISED
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        import deepspeed
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    with contextlib.suppress(Exception):
        deepspeed.utils.logger.setLevel(logging.WARNING)
    if not _DS_INITIALISED:
        _rendezvous_here()
        with contextlib.redirect_stdout(io.StringIO()):  # its banner; failures raise
            deepspeed.init_distributed(dist_backend="nccl")
        _DS_INITIALISED = True
    config = {
        "train_micro_batch_size_per_gpu": cfg.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": RUN.clip or 0.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": WD}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    with contextlib.redirect_stdout(io.StringIO()):  # the config dump and op-build chatter; failures raise
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _rendezvous_here() -> None:
    """The environment of a process group of this one process (a free port, unless one is set)."""
    if not os.environ.get("MASTER_PORT"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in dict(MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        os.environ.setdefault(key, value)


def _world_of_one() -> None:
    """A process group of this one process (NCCL), once: FSDP2's ``fully_shard`` needs one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    _rendezvous_here()
    dist.init_process_group("nccl", rank=0, world_size=1)


def _ours_fsdp2_offload(model, cfg, amp):
    """Ours under FSDP2 at world 1 with ``CPUOffloadPolicy``: each block its own unit, the rest the root's; the
    shards on the host (pinned), gathered to the GPU unit by unit, stepped by ours where FSDP keeps them. The model
    comes on the meta device (its ``build``): materialised as host shards and zeroed (the values do not matter to
    what fits, and a CPU init of billions of parameters would take minutes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    _world_of_one()
    mesh = init_device_mesh("cuda", (1,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=True))
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=True))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
    return Runner(model, OffloadOptimizer(model.parameters(), lr=LR, weight_decay=WD, **_state_kw()), amp)


@dataclasses.dataclass
class Contender:
    key: str
    label: str
    make: Callable[[nn.Module, Config, bool], Runner]  # (model, cfg, amp) -> Runner
    modes: tuple  # "gpu", "cpu"
    grad_bytes: int = 4  # per parameter, device -> host (for the hidden-transfer estimate)
    param_bytes: int = 4  # per parameter, host -> device
    # Per parameter of host RAM, roughly (find-max refuses sizes beyond the available RAM). torchao and DeepSpeed
    # pin through PyTorch's caching host allocator, which rounds each block up to a power of two: hence 24.
    host_bytes: int = 16
    requires: Optional[str] = None  # the package it needs: without it the contender is reported, not tried
    dtype: torch.dtype = torch.float32  # the model is built in this dtype
    build: Optional[str] = None  # the device the model is built on, if not the run's ("meta": its make places it)


def _ours(**kw):
    """Ours with the options ``kw``; on the host placement unless they name one (the default, ``"auto"``, has its
    own row, ``ours-auto``): every other row measures the all-host route it always measured."""
    kw = {"placement": "host", **kw}

    def make(model, cfg, amp):
        return Runner(model, OffloadOptimizer(model.parameters(), lr=LR, weight_decay=WD, **_state_kw(kw), **kw), amp)
    make.kw = kw
    return make


def _state_kw(kw: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``state_dtype`` for ours from ``--state-dtype``, passed only when not the default (fp32) and the contender
    does not set its own."""
    if RUN.state_dtype == torch.float32 or "state_dtype" in (kw or {}):
        return {}
    return dict(state_dtype=RUN.state_dtype)


def host_need(con: "Contender", cfg: "Config") -> int:
    """Host RAM a contender takes for ``cfg``: ours from its own exact estimate (over meta stand-ins, so every
    option and state dtype counts), the others from their bytes per parameter."""
    if not con.key.startswith("ours"):
        return con.host_bytes * cfg.params()
    kw = getattr(con.make, "kw", {})
    est = OffloadOptimizer.estimate_host_memory(meta_params(cfg.params(), _model_dtype(con)), pin_memory=True,
                                                delayed_update="delayed" in con.key, **_state_kw(kw),
                                                **{k: v for k, v in kw.items() if k == "state_dtype"})
    return est.total_bytes


def _model_dtype(con: "Contender") -> torch.dtype:
    return RUN.dtype if RUN.dtype is not None else con.dtype


def _torchao(model, cfg, amp):
    """torchao offloads each gradient as backward makes it, then nothing can clip them: with ``--clip`` they stay
    on the GPU for torch's clip (its documented way)."""
    cls = _import_torchao()
    return Runner(model, cls(model.parameters(), torch.optim.AdamW, offload_gradients=RUN.clip is None, fused=True,
                             lr=LR, weight_decay=WD), amp)


CONTENDERS = [
    Contender("adamw", "torch AdamW fused (GPU-resident)",
              lambda m, c, a: Runner(m, torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, fused=True), a),
              ("gpu",), 0, 0, 0),
    Contender("adamw-ref", "torch AdamW foreach=False",
              lambda m, c, a: Runner(m, torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, foreach=False), a),
              ("cpu",), 0, 0, 0),
    Contender("adamw-fused", "torch AdamW fused",
              lambda m, c, a: Runner(m, torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, fused=True), a),
              ("cpu",), 0, 0, 0),
    Contender("ours", "OffloadOptimizer placement='host'", _ours(), ("gpu", "cpu")),
    Contender("ours-stream", "OffloadOptimizer stream_grads", _ours(stream_grads=True), ("cpu",)),
    Contender("ours-release", "OffloadOptimizer release_grads", _ours(release_grads=True), ("gpu",)),
    # The first quarter of the model (the last gradients backward produces) keeps its state on the GPU.
    Contender("ours-gpu25", "OffloadOptimizer gpu_fraction=0.25", _ours(gpu_fraction=0.25), ("gpu",), host_bytes=12),
    Contender("ours-gpuauto", "OffloadOptimizer gpu_fraction='auto'", _ours(gpu_fraction="auto"), ("gpu",)),
    # Each bucket's home: stepped on the host (as every row above: "ours" under the name the capped matrix gives
    # it), parked on the host and stepped on the GPU, or chosen after the second step by the cost model (the
    # default).
    Contender("ours-host", "OffloadOptimizer placement='host'", _ours(placement="host"), ("gpu",)),
    Contender("ours-parked", "OffloadOptimizer placement='parked'", _ours(placement="parked"), ("gpu",),
              host_bytes=8),
    Contender("ours-auto", "OffloadOptimizer placement='auto' (the default)", _ours(placement="auto"), ("gpu",)),
    Contender("ours-bf16state", "OffloadOptimizer state_dtype=bf16", _ours(state_dtype=torch.bfloat16), ("gpu",),
              host_bytes=10),
    Contender("ours-overlap", "OffloadOptimizer release+overlap_step",
              _ours(release_grads=True, overlap_step=True, nonfinite="ignore"), ("gpu",)),
    Contender("ours-delayed", "OffloadOptimizer release+delayed_update",
              _ours(release_grads=True, delayed_update=True), ("gpu",), host_bytes=20),
    Contender("torchao", "torchao CPUOffloadOptimizer", _torchao, ("gpu",), host_bytes=24, requires="torchao"),
    # FSDP2 at world 1 with CPUOffloadPolicy: the parameters' shards on the host, ours stepping them there.
    Contender("ours-fsdp2-offload", "OffloadOptimizer under FSDP2 CPUOffloadPolicy (world 1)", _ours_fsdp2_offload,
              ("gpu",), build="meta"),
    # Built in bf16 directly: an fp32 model that DeepSpeed then casts would cost it 6 bytes per parameter of GPU
    # memory more at construction than in training, which bounds --find-max.
    Contender("deepspeed", "DeepSpeed ZeRO-2 offload (bf16 model)",
              lambda m, c, a: DeepSpeedRunner(_deepspeed_engine(m, c)), ("gpu",), 2, 2, 24, "deepspeed",
              torch.bfloat16),
]
# --find-max without --only: the anchor, the variant of ours with the least GPU memory, and the other offloaders.
FIND_MAX_DEFAULT = ("adamw", "ours-release", "torchao", "deepspeed")
ANCHOR = {"gpu": "adamw", "cpu": "adamw-ref"}


# ------------------------------------------------------------------------------------------------- measuring --
def _sync(cuda: bool):
    if cuda:
        torch.cuda.synchronize()


def free_memory(cuda: bool):
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        # torchao, DeepSpeed and the bandwidth probe pin through PyTorch's caching host allocator, which keeps
        # freed blocks pinned: the next contender must find that RAM available.
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()


def _missing(con: Contender) -> Optional[str]:
    if con.requires is not None and importlib.util.find_spec(con.requires) is None:
        return f"{con.requires} is not installed"
    if RUN.clip is not None and con.key == "ours-overlap":
        return "overlap_step cannot clip (its buckets are updated during backward)"
    return None


def _is_oom(exc: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    text = str(exc).lower()
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in text or "alloc_failed" in text


def _iteration(runner: Runner, batch, cuda: bool, phases: Optional[List[List[float]]]):
    """One training step; with ``phases``, the device is synchronised between phases and their times appended
    as [forward, backward, step, total]."""
    x, y = batch
    if phases is not None:
        _sync(cuda)
    t0 = time.perf_counter()
    loss = runner.forward(x, y)
    if phases is not None:
        _sync(cuda)
    t1 = time.perf_counter()
    runner.backward(loss)
    if phases is not None:
        _sync(cuda)
    t2 = time.perf_counter()
    runner.step()
    if phases is not None:
        _sync(cuda)
        t3 = time.perf_counter()
        phases.append([t1 - t0, t2 - t1, t3 - t2, t3 - t0])
    return loss


def _start_timeline(runner: Runner, args) -> None:
    if args.timeline and isinstance(runner.opt, OffloadOptimizer):
        runner.opt.record_timeline()
        runner.opt.timeline()


def _timeline_result(runner: Runner, key: str, steps: int, args) -> Optional[Dict[str, Any]]:
    """``--timeline``: the recorded events per step (count and ms by kind), printed, and a Chrome trace."""
    if not (args.timeline and isinstance(runner.opt, OffloadOptimizer)):
        return None
    events = runner.opt.timeline()
    runner.opt.record_timeline(False)
    Path(args.timeline).mkdir(parents=True, exist_ok=True)
    timeline_mod.chrome_trace(events, str(Path(args.timeline) / f"{key}.json"))
    table = {k: {"per_step": v["count"] / steps, "ms_per_step": v["ms"] / steps}
             for k, v in sorted(timeline_mod.breakdown(events).items())}
    print(f"timeline of {key} (per step, host clock; trace in {args.timeline}/{key}.json):")
    for k, v in table.items():
        print(f"  {k:24s} {v['per_step']:7.1f} x {v['ms_per_step']:9.3f} ms")
    return table


def _failure(exc: BaseException, args) -> Dict[str, Any]:
    if args.verbose:
        traceback.print_exc()
    text = str(exc).strip()
    brief = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]
    return dict(status="OOM" if _is_oom(exc) else "failed", error=brief)


def _summary(phases: List[List[float]], step_s: float, loss) -> Dict[str, Any]:
    return dict(status="ok", step_s=step_s, fwd_s=statistics.median(p[0] for p in phases),
                bwd_s=statistics.median(p[1] for p in phases), opt_s=statistics.median(p[2] for p in phases),
                loss=float(loss.detach()))


def measure(con: Contender, cfg: Config, batches, args, device: torch.device) -> Dict[str, Any]:
    """GPU: one contender alone on the device (peak memory must be its own), from an empty allocator."""
    if _missing(con):
        return dict(status="not installed", error=_missing(con))
    free_memory(True)
    torch.cuda.reset_peak_memory_stats()
    runner = None
    try:
        runner = con.make(build_model(cfg, con.build or device, args.seed, _model_dtype(con)), cfg, True)
        for i in range(args.warmup):
            _iteration(runner, batches[i % len(batches)], True, [])
        phases: List[List[float]] = []
        for i in range(args.steps):
            loss = _iteration(runner, batches[(args.warmup + i) % len(batches)], True, phases)
        # Free-running pass: events on the compute stream, nothing synchronised by us until the end.
        _start_timeline(runner, args)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
        for i in range(args.steps):
            events[i].record()
            _iteration(runner, batches[(args.warmup + args.steps + i) % len(batches)], True, None)
        events[-1].record()
        torch.cuda.synchronize()
        step_s = statistics.median(events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(args.steps))
        runner.finish()
        torch.cuda.synchronize()
        result = _summary(phases, step_s, loss)
        result["timeline"] = _timeline_result(runner, con.key, args.steps, args)
        result.update(peak_bytes=torch.cuda.max_memory_allocated(), rest_bytes=torch.cuda.memory_allocated(),
                      reserved_bytes=torch.cuda.max_memory_reserved())
        return result
    except Exception as exc:
        return _failure(exc, args)
    finally:
        if runner is not None:
            runner.close()
        del runner
        free_memory(True)


def measure_interleaved(contenders: Dict[str, Contender], cfg: Config, batches, args) -> Dict[str, Dict[str, Any]]:
    """CPU: every contender's model lives at once (small models) and they take steps round by round, so that drift
    on a shared machine moves them all alike; medians per contender."""
    rows: Dict[str, Dict[str, Any]] = {}
    runners: Dict[str, Runner] = {}
    for key, con in contenders.items():
        try:
            runners[key] = con.make(build_model(cfg, torch.device("cpu"), args.seed, _model_dtype(con)), cfg, False)
        except Exception as exc:
            rows[key] = _failure(exc, args)
    phases: Dict[str, List[List[float]]] = {key: [] for key in runners}
    losses: Dict[str, Any] = {}
    for i in range(args.warmup + args.steps):
        for key in list(runners):
            if i == args.warmup:
                _start_timeline(runners[key], args)
            try:
                losses[key] = _iteration(runners[key], batches[i % len(batches)], False,
                                         phases[key] if i >= args.warmup else [])
            except Exception as exc:
                rows[key] = _failure(exc, args)
                runners.pop(key).close()
    for key, runner in runners.items():
        runner.finish()
        rows[key] = _summary(phases[key], statistics.median(p[3] for p in phases[key]), losses[key])
        rows[key]["timeline"] = _timeline_result(runner, key, args.steps, args)
        runner.close()
    free_memory(False)
    return {key: rows[key] for key in contenders}


def probes(numel: int, cuda: bool) -> Dict[str, float]:
    """The offload work's parts, each alone: the CPU kernel over ``numel`` fp32 elements (timed on at most 2**25
    and scaled linearly), and pinned-memory copy bandwidth each way (as ``placement="auto"`` measures it, the best
    of three copies; here of 256 MiB)."""
    out: Dict[str, float] = {}
    n = min(numel, 2**25)
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    m, v = torch.zeros(n), torch.zeros(n)
    times = []
    for step in range(1, 5):
        t0 = time.perf_counter()
        functional.cpu_adam_(p, g, m, v, step=step, lr=LR, weight_decay=WD)
        times.append(time.perf_counter() - t0)
    out["cpu_adam_s"] = statistics.median(times[1:]) * numel / n
    del p, g, m, v
    if cuda:
        for name, up in (("d2h", False), ("h2d", True)):
            out[f"{name}_gbps"] = measure_copy_rate(torch.device("cuda"), 256 * 2**20, up=up) / 1e9
        free_memory(True)
    return out


# ------------------------------------------------------------------------------------------------- reporting --
def machine(cuda: bool) -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    ram = available_host_bytes()
    s = (f"{cpu}, {os.cpu_count()} logical CPUs, {torch.get_num_threads()} torch threads, "
         f"{'?' if ram is None else f'{ram / GIB:.0f} GiB'} host RAM available, torch {torch.__version__}, "
         f"python {platform.python_version()}, kernel path {functional.path_reason()}")
    if cuda:
        prop = torch.cuda.get_device_properties(0)
        s += f"\ngpu: {prop.name}, {prop.total_memory / GIB:.1f} GiB, CUDA {torch.version.cuda}"
    return s


def _fmt(value: Optional[float], spec: str, dash: str = "-") -> str:
    return dash if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def print_table(rows: Dict[str, Dict[str, Any]], contenders: Dict[str, Contender], anchor: Optional[Dict[str, Any]],
                probe: Dict[str, float], numel: int, cuda: bool):
    anchor_ok = anchor is not None and anchor.get("status") == "ok"
    anchor_fb = anchor["step_s"] - anchor["opt_s"] if anchor_ok else None
    head = f"  {'contender':<40} {'step ms':>8} {'step x':>6} {'fwd ms':>8} {'bwd ms':>8} {'opt ms':>8}"
    if cuda:
        head += f" {'added ms':>8} {'hidden':>6} {'peak GiB':>8} {'peak x':>6} {'rsv GiB':>8} {'rest GiB':>8}"
    print(head + f" {'loss':>7}")
    for key, r in rows.items():
        label = contenders[key].label
        if r["status"] != "ok":
            print(f"  {label:<40} {r['status']}: {r['error']}")
            continue
        ratio = r["step_s"] / anchor["step_s"] if anchor_ok else None
        line = (f"  {label:<40} {r['step_s'] * 1e3:8.1f} {_fmt(ratio, '6.2f'):>6} {r['fwd_s'] * 1e3:8.1f} "
                f"{r['bwd_s'] * 1e3:8.1f} {r['opt_s'] * 1e3:8.1f}")
        if cuda:
            con = contenders[key]
            added = hidden = None
            if anchor_fb is not None and key != ANCHOR["gpu"]:
                added = r["step_s"] - anchor_fb
                work = (numel * con.grad_bytes / (probe["d2h_gbps"] * 1e9) + probe["cpu_adam_s"]
                        + numel * con.param_bytes / (probe["h2d_gbps"] * 1e9))
                hidden = min(1.0, max(0.0, 1.0 - added / work)) if con.grad_bytes else None
                r.update(added_s=added, offload_work_s=work, hidden=hidden)
            mem_ratio = r["peak_bytes"] / anchor["peak_bytes"] if anchor_ok else None
            r["peak_ratio"], r["step_ratio"] = mem_ratio, ratio
            hidden_txt = "-" if hidden is None else f"{100 * hidden:.0f}%"
            line += (f" {_fmt(None if added is None else added * 1e3, '8.1f'):>8} {hidden_txt:>6}"
                     f" {r['peak_bytes'] / GIB:8.2f} {_fmt(mem_ratio, '6.2f'):>6} {r['reserved_bytes'] / GIB:8.2f}"
                     f" {r['rest_bytes'] / GIB:8.2f}")
        print(line + f" {r['loss']:7.4f}")


# ------------------------------------------------------------------------------------------------ find-max --
def find_max(con: Contender, base: Config, args, device: torch.device) -> Dict[str, Any]:
    """Largest layer count (at the base width) that trains one step; the bound says what stopped the next size up."""
    if _missing(con):
        return dict(layers=0, params=0, bound=_missing(con))
    ram = available_host_bytes()

    def attempt(layers: int) -> str:
        cfg = dataclasses.replace(base, layers=layers)
        if ram is not None and host_need(con, cfg) > 0.85 * ram:
            return "host RAM"
        runner = None
        try:
            runner = con.make(build_model(cfg, con.build or device, args.seed, _model_dtype(con)), cfg, True)
            x, y = make_batches(cfg, 1, device, args.seed)[0]
            runner.backward(runner.forward(x, y))
            runner.step()
            runner.finish()
            torch.cuda.synchronize()
            return "ok"
        except Exception as exc:
            if _is_oom(exc):
                return "GPU OOM"
            return f"failed: {type(exc).__name__}: {str(exc).strip()[:200]}"
        finally:
            if runner is not None:
                runner.close()
            del runner
            free_memory(True)

    tried: Dict[int, str] = {}

    def ok(layers: int) -> bool:
        # Any failure counts as "does not fit" (with its reason kept): a cudaHostRegister refused at a large size
        # bounds the search as much as an OOM does.
        tried[layers] = attempt(layers)
        print(f"    {con.key}: {layers} layers ({dataclasses.replace(base, layers=layers).params() / 1e9:.3f}B "
              f"params): {tried[layers]}", flush=True)
        return tried[layers] == "ok"

    # From the base size: double while it fits, or halve until it does; then bisect to ~3%. Throughout, lo fits
    # (or is 0) and hi is a size tried that does not.
    lo, hi = 0, base.layers
    if ok(hi):
        lo, hi = hi, hi * 2
        while ok(hi):
            lo, hi = hi, hi * 2
            if hi > 4096:
                return dict(layers=lo, params=dataclasses.replace(base, layers=lo).params(), bound="search cap")
    else:
        while lo == 0 and hi > 1:
            if ok(hi // 2):
                lo = hi // 2
            else:
                hi //= 2
        if lo == 0:
            return dict(layers=0, params=0, bound=tried[min(tried)])
    while hi - lo > max(1, lo // 32):
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return dict(layers=lo, params=dataclasses.replace(base, layers=lo).params(), bound=tried[hi])


# ---------------------------------------------------------------------------------------------------- main --
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS, key=lambda k: PRESETS[k][0] * PRESETS[k][1] ** 2),
                    default=None, help="model shape (default: 1.3b on a GPU, tiny on CPU); --layers etc. override it")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--d-model", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 1024 on a GPU, 128 on CPU)")
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences per step (default 16 on a GPU, 4 on CPU); on a GPU pick one where the AdamW "
                         "step takes about 1 s")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 50304 on a GPU, 8192 on CPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per pass (default 10 on a GPU, 20 on CPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3 on a GPU, 2 on CPU)")
    ap.add_argument("--only", default=None,
                    help="comma-separated contenders: " + ", ".join(c.key for c in CONTENDERS) + " (default: all "
                         "that apply to the mode)")
    ap.add_argument("--cpu", action="store_true", help="run the CPU mode even where a GPU is available")
    ap.add_argument("--find-max", action="store_true",
                    help="GPU: find each contender's largest trainable model (scaling --layers) instead of timing")
    ap.add_argument("--find-max-batch", type=int, default=1, help="batch for --find-max (default 1)")
    ap.add_argument("--checkpoint", action="store_true",
                    help="activation checkpointing of every block, for every contender")
    ap.add_argument("--dtype", choices=sorted(DTYPE_CHOICES), default=None,
                    help="build every contender's model in this dtype (default: fp32, DeepSpeed bf16)")
    ap.add_argument("--state-dtype", choices=sorted(STATE_DTYPE_CHOICES), default="fp32",
                    help="OffloadOptimizer(state_dtype=...) for ours: fp32 (default), bf16 or int8 (8-bit block-wise)")
    ap.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                    help="clip the gradients' norm every step: ours with opt.clip_grad_norm_, torchao with its "
                         "gradients kept on the GPU and torch's clip, DeepSpeed with gradient_clipping")
    ap.add_argument("--gpu-cap-gib", type=float, default=None,
                    help="cap the GPU memory this process may allocate (torch.cuda.set_per_process_memory_fraction)")
    ap.add_argument("--cap-after", default=None, metavar="ROW[+GIB]",
                    help="GPU: run the rows up to ROW uncapped, then cap the process at ROW's peak plus GIB (default "
                         "1): e.g. 'ours-host+1', the all-host placement's peak plus 1 GiB, where AdamW does not fit; "
                         "AdamW's time comes from its uncapped row in the same process")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--verbose", action="store_true", help="print the traceback of a contender that fails")
    ap.add_argument("--timeline", default=None, metavar="DIR",
                    help="record ours' step timeline (OffloadOptimizer.record_timeline) over the timed steps: print "
                         "host waits, kernels, copies, commits and rollbacks per step, and write DIR/<key>.json "
                         "Chrome traces")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cuda = torch.cuda.is_available() and not args.cpu
    RUN.checkpoint, RUN.state_dtype = args.checkpoint, STATE_DTYPE_CHOICES[args.state_dtype]
    RUN.dtype = DTYPE_CHOICES[args.dtype] if args.dtype else None
    if args.clip is not None and not args.clip > 0:
        ap.error("--clip must be a positive max norm")
    RUN.clip = args.clip
    if args.gpu_cap_gib is not None:
        if not cuda:
            ap.error("--gpu-cap-gib needs a GPU")
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap_gib * GIB / total))
    mode = "gpu" if cuda else "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    defaults = MODE_DEFAULTS[mode]
    for name in ("seq", "batch", "vocab", "steps", "warmup"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    preset = args.preset or defaults["preset"]
    layers, d_model, heads = PRESETS[preset]
    cfg = Config(args.layers or layers, args.d_model or d_model, args.heads or heads, args.seq, args.batch,
                 args.vocab)
    if cfg.d_model % cfg.heads:
        ap.error(f"--d-model {cfg.d_model} is not a multiple of --heads {cfg.heads}")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")

    applicable = {c.key: c for c in CONTENDERS if mode in c.modes}
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        unknown = [k for k in keys if k not in {c.key for c in CONTENDERS}]
        if unknown:
            ap.error(f"unknown contender(s) {', '.join(unknown)}; choose from {', '.join(c.key for c in CONTENDERS)}")
        skipped = [k for k in keys if k not in applicable]
        if skipped:
            print(f"not in {mode} mode, skipped: {', '.join(skipped)}")
        contenders = {k: applicable[k] for k in keys if k in applicable}
    elif args.find_max:
        contenders = {k: applicable[k] for k in FIND_MAX_DEFAULT if k in applicable}
    else:
        contenders = applicable

    def save():
        """The results so far (after each contender: a run cut short keeps what it measured)."""
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))

    print(f"machine: {machine(cuda)}")
    if not cuda:
        print("\n*** No CUDA GPU here: this is the CPU mode (model on CPU, fp32 unless --dtype). The GPU figures (peak GPU memory, "
              "hidden transfers, torchao, DeepSpeed, release_grads/overlap_step/delayed_update, --find-max) need a "
              "GPU. ***\n")
    print(f"model ({mode}, preset {preset}): {cfg.describe()}")
    options = dict(checkpoint=args.checkpoint, dtype=args.dtype, state_dtype=args.state_dtype, clip=args.clip,
                   gpu_cap_gib=args.gpu_cap_gib)
    print("options: " + ", ".join(f"{k} {v}" for k, v in options.items()))
    results: Dict[str, Any] = dict(machine=machine(cuda), mode=mode, config=dataclasses.asdict(cfg), options=options)

    if args.find_max:
        if not cuda:
            print("--find-max needs a GPU: nothing to search on CPU.")
            return
        base = dataclasses.replace(cfg, batch=args.find_max_batch)
        print(f"\nfind-max: layers at d_model {base.d_model}, {base.heads} heads, seq {base.seq}, batch {base.batch}; "
              f"sizes whose host state (~B/param x params) exceeds 85% of available RAM are not tried")
        found = results["find_max"] = {}
        for key, con in contenders.items():
            found[key] = find_max(con, base, args, device)
            print(f"  {con.key}: {found[key]['layers']} layers, {found[key]['params'] / 1e9:.2f}B params; next size "
                  f"up: {found[key]['bound']}", flush=True)
            save()
        anchor = found.get(ANCHOR[mode])
        print(f"\n  {'contender':<40} {'layers':>6} {'params':>10} {'x AdamW':>8}  next size up")
        for key, f in found.items():
            ratio = f["params"] / anchor["params"] if anchor and anchor["params"] else None
            print(f"  {contenders[key].label:<40} {f['layers']:6d} {f['params'] / 1e9:9.2f}B "
                  f"{_fmt(ratio, '8.2f'):>8}  {f['bound']}")
    else:
        batches = make_batches(cfg, 4, device, args.seed)
        probe = probes(cfg.params(), cuda)
        line = f"offload work alone: CPU Adam kernel {probe['cpu_adam_s'] * 1e3:.1f} ms over {cfg.params():,} elements"
        if cuda:
            line += (f"; pinned copies {probe['d2h_gbps']:.1f} GB/s device->host, {probe['h2d_gbps']:.1f} GB/s "
                     f"host->device")
        print(line + f"\nsteps: {args.warmup} warm-up, then {args.steps} timed" +
              (" (free-running, CUDA events) + a second pass of {} with synchronised phases".format(args.steps)
               if cuda else ", contenders interleaved round by round") + "\n", flush=True)
        results["probes"] = probe
        if cuda:
            rows = results["rows"] = {}
            for key, con in contenders.items():
                t0 = time.perf_counter()
                rows[key] = measure(con, cfg, batches, args, device)
                r = rows[key]
                _cap_after(args, key, r, results)
                status = (f"step {r['step_s'] * 1e3:.1f} ms, peak {r['peak_bytes'] / GIB:.2f} GiB allocated "
                          f"({r['reserved_bytes'] / GIB:.2f} reserved), {r['rest_bytes'] / GIB:.2f} GiB after"
                          if r["status"] == "ok" else f"{r['status']}: {r['error']}")
                print(f"  ran {con.label}: {status} ({time.perf_counter() - t0:.0f} s)", flush=True)
                save()
        else:
            rows = results["rows"] = measure_interleaved(contenders, cfg, batches, args)
        anchor_label = applicable[ANCHOR[mode]].label
        print(f"\nmedians; 'step x' and 'peak x' are ratios to {anchor_label} (see the module docstring for each "
              "column):")
        print_table(rows, contenders, rows.get(ANCHOR[mode]), probe, cfg.params(), cuda)
    save()


def _cap_after(args, key: str, row: Dict[str, Any], results: Dict[str, Any]) -> None:
    """``--cap-after ROW[+GIB]``: once ``ROW`` has run, cap the process at its peak plus GIB for the rows after it
    (recorded in the results' options)."""
    if not args.cap_after:
        return
    name, _, plus = args.cap_after.partition("+")
    if key != name or row.get("status") != "ok":
        return
    cap = row["peak_bytes"] + float(plus or 1.0) * GIB
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    results["options"]["gpu_cap_gib"] = round(cap / GIB, 2)
    print(f"  capped at {cap / GIB:.2f} GiB ({name}'s peak plus {float(plus or 1.0):g} GiB) for the rows after it",
          flush=True)


if __name__ == "__main__":
    main()

"""Data-parallel training with the optimizer state sharded over the ranks (ZeRO) by ``OffloadOptimizer``.

Launch one process per GPU (or, without GPUs, per CPU worker)::

    torchrun --nproc_per_node=2 examples/train_ddp.py            # gloo on CPU, NCCL when CUDA is there
    torchrun --nproc_per_node=2 examples/train_ddp.py --stream   # gradients reduce-scattered in backward on CPU
    torchrun --nproc_per_node=2 examples/train_ddp.py --ddp      # the model wrapped in DDP (ZeRO-1)

A small GPT-style model learns a synthetic task (predict the next token of noisy repeated patterns); each rank
trains on its own part of every global batch, and the loss averaged over the ranks is printed by rank 0. Every
rank keeps 1/N of the fp32 masters and Adam moments in its host memory. Halfway, the optimizer state is saved with
``torch.distributed.checkpoint`` (sharded, reshardable: it could resume on any number of ranks) into a temporary
folder, loaded back, and the folder removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

from zero_offload import OffloadOptimizer

VOCAB, SEQ = 64, 32


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, d: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(SEQ, d))
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx):
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos[: idx.shape[1]])))


def batch(step: int, rank: int, world: int, global_batch: int, device):
    """This rank's rows of the global batch of ``step``: repeated random patterns with 10% noise tokens."""
    gen = torch.Generator().manual_seed(step)
    period = torch.randint(2, 6, (global_batch, 1), generator=gen)
    pattern = torch.randint(0, VOCAB, (global_batch, 6), generator=gen)
    pos = torch.arange(SEQ + 1).expand(global_batch, -1) % period
    seq = pattern.gather(1, pos)
    noise = torch.rand(seq.shape, generator=gen) < 0.1
    seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=gen), seq)
    rows = slice(rank * global_batch // world, (rank + 1) * global_batch // world)
    return seq[rows, :-1].to(device), seq[rows, 1:].to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--ddp", action="store_true", help="wrap the model in DDP (the optimizer then takes slices)")
    ap.add_argument("--stream", action="store_true", help="reduce-scatter gradients in backward on CPU too")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda" if cuda else "cpu")

    torch.manual_seed(rank)  # different on every rank on purpose: the optimizer broadcasts rank 0's weights
    model = TinyGPT().to(device)
    net = nn.parallel.DistributedDataParallel(model) if args.ddp else model
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "pos" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "pos" not in n)]
    # Without DDP, each bucket's gradients are reduce-scattered from backward hooks as soon as they are final (the
    # default on CUDA; --stream asks for it on CPU too), and release_grads drops them from the parameters once
    # sent: opt.clip_grad_norm_ then clips from the reduced shards, with no second reduction.
    opt = OffloadOptimizer([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                           lr=3e-3, process_group=dist.group.WORLD, grads_reduced=args.ddp,
                           stream_grads=True if args.stream else None, release_grads=not args.ddp)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps, pct_start=0.1)
    if rank == 0:
        est = opt.estimate_host_memory()
        n = sum(p.numel() for p in model.parameters())
        print(f"world {world} ({'nccl' if cuda else 'gloo'}{', DDP' if args.ddp else ''}"
              f"{', streamed' if not args.ddp and (cuda or args.stream) else ''}): {n:,} parameters, "
              f"optimizer state on this rank {est.state_bytes / n:.2f} bytes/param (12/{world} = {12 / world:.2f})")

    ckpt = shared_checkpoint_dir(rank)
    try:
        train(args, net, opt, sched, ckpt, rank, world, device, cuda)
    finally:
        if rank == 0:  # every rank has loaded the checkpoint: each step's all_reduce comes after it
            shutil.rmtree(ckpt, ignore_errors=True)
    dist.destroy_process_group()


def shared_checkpoint_dir(rank: int) -> str:
    """A temporary folder made by rank 0 (one node: every rank sees it), its name sent to the others."""
    holder = [tempfile.mkdtemp(prefix="zero_offload_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(holder)
    return holder[0]


def train(args, net, opt, sched, ckpt, rank, world, device, cuda) -> None:
    """The training loop; halfway, the sharded optimizer state goes through ``torch.distributed.checkpoint``."""
    for step in range(args.steps):
        x, y = batch(step, rank, world, args.global_batch, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(net(x).float().reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        if step == args.steps // 2:  # save and restore the sharded state, as a resumed run would
            dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=ckpt)
            sd = {"optim": opt.sharded_state_dict()}
            dcp.load(sd, checkpoint_id=ckpt)
            opt.load_sharded_state_dict(sd["optim"])
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {mean.item() / world:.3f}", flush=True)


if __name__ == "__main__":
    main()

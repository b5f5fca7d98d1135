"""Training a model sharded by FSDP2 (``fully_shard``) with ``OffloadOptimizer``: the parameters sharded over the
GPUs by FSDP2 as usual, the optimizer state of each rank's shards in that rank's host memory.

    torchrun --nproc_per_node=2 examples/train_fsdp2.py                     # NCCL with GPUs, gloo on CPU
    python examples/train_fsdp2.py --world 2                                # a CPU demo: spawns 2 processes
    torchrun --nproc_per_node=2 examples/train_fsdp2.py --optimizer adamw   # torch.optim.AdamW, to compare

FSDP2 does every collective: it all-gathers each block's parameters for forward and backward, reduce-scatters
the gradients, and each rank's optimizer updates only its own shard (``p.to_local()``), which the next forward
gathers again. ``OffloadOptimizer(model.parameters(), ...)`` is built exactly as ``torch.optim.AdamW`` would be:
nothing of the model or mesh is passed to it. On GPUs the forward and backward run in bf16
(``MixedPrecisionPolicy``) and the fp32 shards are the master weights.

The loop is a usual one: two param groups (no weight decay on norms, biases and embeddings), a OneCycle LR
schedule, ``torch.nn.utils.clip_grad_norm_`` (on FSDP2's DTensor gradients it computes the norm over all ranks),
and, halfway, a checkpoint through ``torch.distributed.checkpoint``: ``get_state_dict`` / ``set_state_dict``
give and take sharded (DTensor) state dicts, saved and loaded in parallel by every rank and reshardable (the
checkpoint could resume on any number of ranks). The run restores it into a newly built model, optimizer and
schedule, as a restarted job would, and goes on.

On GPUs each FSDP unit's gradient shards stream to the host from FSDP's own hooks, as its reduce-scatter ends,
while backward goes on; ``--optimizer adamw`` runs the same loop with ``torch.optim.AdamW`` on the GPU shards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_ddp import VOCAB, TinyGPT, batch  # noqa: E402  (the same model and synthetic task)

from zero_offload import OffloadOptimizer  # noqa: E402


def build(args, device: torch.device, cuda: bool):
    """The model, sharded; its optimizer and LR schedule. Every rank builds the same initial weights (FSDP2 keeps
    each rank's own chunk of what that rank built: it does not broadcast)."""
    torch.manual_seed(0)
    with device:
        model = TinyGPT(d=args.width, layers=args.layers)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
    kw = dict(mesh=mesh, mp_policy=policy) if policy else dict(mesh=mesh)
    for block in model.blocks:  # one FSDP unit per block, then the root (embeddings, final norm, head)
        fully_shard(block, **kw)
    fully_shard(model, **kw)

    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "pos" not in n and "tok" not in n]
    rest = [p for n, p in model.named_parameters() if not any(p is q for q in decay)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    if args.optimizer == "offload":
        opt = OffloadOptimizer(groups, lr=args.lr)
    else:
        opt = torch.optim.AdamW(groups, lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    return model, opt, sched


class TrainState(Stateful):
    """What a checkpoint holds; ``dcp.save`` and ``dcp.load`` call these two methods."""

    def __init__(self, model, opt, sched):
        self.model, self.opt, self.sched = model, opt, sched

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.opt)  # sharded: DTensors placed like the parameters
        return {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict()}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.sched.load_state_dict(sd["sched"])


def train(args, device: torch.device) -> list:
    """The training loop, on every rank of the initialised default group; returns the loss of each step (the mean
    over the ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device.type == "cuda"
    model, opt, sched = build(args, device, cuda)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        local = sum(p.to_local().numel() for p in model.parameters())
        print(f"world {world} ({'NCCL, bf16 compute' if cuda else 'gloo, CPU'}), {type(opt).__name__}: "
              f"{n:,} parameters, {local:,} in rank 0's shards", flush=True)

    ckpt = shared_dir(rank)
    losses = []
    try:
        for step in range(args.steps):
            x, y = batch(step, rank, world, args.global_batch, device)
            loss = F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a DTensor: the norm over all ranks
            opt.step()
            sched.step()
            opt.zero_grad()
            if step == args.steps // 2:  # a restart: save, build everything anew, load, go on
                dcp.save({"train": TrainState(model, opt, sched)}, checkpoint_id=ckpt)
                del model, opt, sched
                model, opt, sched = build(args, device, cuda)
                dcp.load({"train": TrainState(model, opt, sched)}, checkpoint_id=ckpt)
                if rank == 0:
                    print(f"step {step:3d}  checkpoint saved and restored into a new model and optimizer")
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                print(f"step {step:3d}  loss {losses[-1]:.3f}  grad norm {norm.item():.3f}  "
                      f"lr {sched.get_last_lr()[0]:.2e}", flush=True)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(ckpt, ignore_errors=True)
    return losses


def launch(args) -> None:
    """One process of the run: its group (the env:// variables torchrun sets), its device, the loop."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    try:
        train(args, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def shared_dir(rank: int) -> str:
    """A temporary folder made by rank 0 (one node: every rank sees it), its name sent to the others."""
    holder = [tempfile.mkdtemp(prefix="zero_offload_fsdp2_") if rank == 0 else None]
    dist.broadcast_object_list(holder)
    return holder[0]


def _spawned(rank: int, world: int, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    launch(args)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--optimizer", choices=["offload", "adamw"], default="offload",
                    help="offload: zero_offload.OffloadOptimizer (default); adamw: torch.optim.AdamW")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--world", type=int, default=None,
                    help="without torchrun: spawn this many processes here (a CPU demo with gloo; with GPUs, one "
                         "per GPU)")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:  # torchrun (or another launcher that sets the env:// variables)
        launch(args)
        return
    world = args.world or 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.multiprocessing.spawn(_spawned, args=(world, args), nprocs=world)


if __name__ == "__main__":
    main()

"""OffloadOptimizer under accelerate's FSDP2 plugin, end to end: the optimizer is built over the plain model, as
accelerate's examples build AdamW; ``Accelerator.prepare(model, opt, scheduler)`` applies ``fully_shard`` and
switches the optimizer's groups to FSDP2's sharded parameters; the loop is accelerate's own (``accumulate``,
``backward``, ``clip_grad_norm_``, a warm-up schedule). The same run with ``torch.optim.AdamW`` is the reference:
the parameters and both moments must agree after every optimizer step.

On GPUs (the lease plan's second command runs it; accelerate is in the device's image):

    torchrun --nproc_per_node=1 examples/accelerate_fsdp2.py --steps 12

accelerate takes FSDP on accelerators only: on CPUs it would prepare the model for DDP. Without CUDA this script
therefore sets accelerate's distributed type to FSDP before ``prepare``, so that the same plugin code runs over
gloo (what the tests run; its last line names the device):

    torchrun --nproc_per_node=2 examples/accelerate_fsdp2.py --steps 4
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from zero_offload import OffloadOptimizer

LR, WD, MAX_NORM, ACCUMULATE = 1e-2, 0.1, 0.5, 2


class Block(nn.Module):
    """A pre-norm MLP block: the unit the plugin wraps (``transformer_based_wrap``)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int = 96, width: int = 32, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def run(make_opt, steps: int, cpu_fsdp: bool):
    """``steps`` optimizer steps of accelerate's loop; each step's full parameters and moments, by name."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Block"], reshard_after_forward=True)
    acc = Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=ACCUMULATE, cpu=cpu_fsdp)
    if cpu_fsdp:  # (the processes are accelerate's MULTI_CPU ones, over gloo)
        acc.state.distributed_type, acc.state.fsdp_plugin = DistributedType.FSDP, plugin
    if acc.distributed_type != DistributedType.FSDP:
        raise SystemExit(f"accelerate prepared for {acc.distributed_type}, not FSDP: launch with torchrun")
    torch.manual_seed(0)
    model = Model()
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    model, opt, sched = acc.prepare(model, opt, sched)
    rank, world = acc.process_index, acc.num_processes
    history = []
    for micro in range(steps * ACCUMULATE):
        ids = torch.randint(0, 96, (4 * world, 17), generator=torch.Generator().manual_seed(micro))[rank::world]
        ids = ids.to(acc.device)
        with acc.accumulate(model):
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            snap = {}
            for name, p in model.named_parameters():
                snap[name] = p.full_tensor().detach().cpu().clone()
                state = opt.state[p]
                for key in ("exp_avg", "exp_avg_sq"):  # (this rank's shard: ours lives on the host, AdamW's on the GPU)
                    snap[f"{name}.{key}"] = state[key].to_local().detach().cpu().clone()
            history.append(snap)
    shards = {name: (tuple(p.placements), tuple(p.to_local().shape)) for name, p in model.named_parameters()}
    return history, acc, shards


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps (each of %d micro-batches)" % ACCUMULATE)
    args = ap.parse_args()
    cpu_fsdp = not torch.cuda.is_available()
    reference, _, _ = run(lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, foreach=False),
                       args.steps, cpu_fsdp)
    ours, acc, shards = run(lambda m: OffloadOptimizer(m.parameters(), lr=LR, weight_decay=WD), args.steps, cpu_fsdp)
    assert len(ours) == len(reference) == args.steps
    worst = 0.0
    for step, (a, b) in enumerate(zip(reference, ours)):
        for name, value in a.items():
            torch.testing.assert_close(b[name], value, msg=lambda m: f"step {step}, {name}: {m}")
            worst = max(worst, (b[name] - value).abs().max().item())
    first, last = reference[0], reference[-1]
    assert any(not torch.equal(first[n], last[n]) for n in first if not n.endswith("exp_avg_sq"))  # (it trained)
    if acc.num_processes > 1:  # (the parameters really are sharded over the processes)
        assert all(local[0] < ours[0][name].shape[0] for name, (_, local) in shards.items() if local[0] > 1), shards
    if acc.is_main_process:
        print(f"OffloadOptimizer under accelerate's FSDP2 plugin on {acc.num_processes} x {acc.device.type}: same "
              f"parameters as torch.optim.AdamW and the same moments after each of {args.steps} steps (accumulation "
              f"{ACCUMULATE}, clipped at {MAX_NORM}, warm-up schedule); largest difference {worst:.2e}")
    acc.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

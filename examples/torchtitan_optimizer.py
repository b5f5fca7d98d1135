"""OffloadOptimizer in torchtitan: its optimizer container builds each optimizer by name, so a subclass that knows the
name "OffloadAdamW" is the whole swap. In a torchtitan trainer config, put ``OffloadOptimizersContainer.Config``
where ``OptimizersContainer.Config`` (or ``default_adamw(...)``) was::

    from torchtitan_optimizer import offload_adamw
    config = Trainer.Config(..., optimizer=offload_adamw(lr=3e-4))

The parameters it is given are FSDP2's (torchtitan applies ``parallelize_module`` and ``fully_shard`` before it
builds the optimizers), and its state dict is torchtitan's flat, FQN-keyed one, so torchtitan's checkpointer saves
and loads it as AdamW's. ``--tp N`` adds tensor parallelism as torchtitan's recipes do (a (dp, tp) mesh: the
embedding ``RowwiseParallel``, a ``SequenceParallel`` norm, ``ColwiseParallel`` and ``RowwiseParallel`` linears),
and resumes the checkpoint on a (1, world) mesh, resharded by DCP.

Run here (CPU processes, gloo; torchtitan installed): a model trained by torchtitan's container with AdamW and with
OffloadOptimizer, clipped, checked equal, then a DCP round trip of the container's state dict.

    torchrun --nproc_per_node=2 examples/torchtitan_optimizer.py --steps 6
    torchrun --nproc_per_node=4 examples/torchtitan_optimizer.py --steps 6 --tp 2
"""

import argparse
import dataclasses
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from zero_offload import OffloadOptimizer


class OffloadOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container, which also builds ``"OffloadAdamW"``: an OffloadOptimizer (AdamW's
    arithmetic, its state on the host). Its ``implementation`` setting (fused/foreach) is for torch's optimizers:
    OffloadOptimizer's groups do not take it."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., torch.optim.Optimizer]:
        if name == "OffloadAdamW":
            return OffloadOptimizer
        return OptimizersContainer._resolve_optimizer_factory(name)

    @staticmethod
    def _build_impl_kwargs(config: Any) -> dict:
        kw = OptimizersContainer._build_impl_kwargs(config)
        if any(g.optimizer_name == "OffloadAdamW" for g in config.param_groups):
            kw = {}  # (fused= and foreach= are torch's optimizers' group keys)
        return kw


def offload_adamw(lr: float = 8e-4, **kwargs: Any) -> OffloadOptimizersContainer.Config:
    """torchtitan's ``default_adamw`` with OffloadOptimizer: one group of every parameter."""
    kwargs = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, **kwargs, "lr": lr}
    return OffloadOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="OffloadAdamW", optimizer_kwargs=kwargs)])


def _model(mesh) -> nn.Module:
    """FSDP2 over ``mesh["dp"]``; where the mesh's ``tp`` dimension is larger than 1, tensor parallelism first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 32), nn.LayerNorm(32), nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 64))
    if mesh["tp"].size() > 1:
        parallelize_module(model, mesh["tp"], {
            "0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),  # the sequence split over tp
            "1": SequenceParallel(),
            "2": ColwiseParallel(input_layouts=Shard(1)),
            "4": RowwiseParallel(output_layouts=Replicate()),
        })
    for layer in (model[2], model[4]):
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _loss(model: nn.Module, step: int, mesh) -> torch.Tensor:
    """Each data-parallel rank its rows of the batch (its tensor-parallel peers the same ones)."""
    rank, world = mesh.get_local_rank("dp"), mesh["dp"].size()
    ids = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(step))[rank::world]
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def train(config: Any, steps: int, mesh, checkpoint: str = None, then=None):
    """``steps`` clipped steps under ``config``'s container; with ``checkpoint``, a DCP save of its state dict
    half way, loaded into a new model and container (on the mesh ``then``, if given) that go on. The final
    parameters (full tensors)."""
    model = _model(mesh)
    opt = config.build(model_parts=[model])
    for step in range(steps):
        if checkpoint is not None and step == steps // 2:
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=checkpoint)
            mesh = then or mesh
            model = _model(mesh)  # (the same initial weights: only the load makes them the trained ones)
            opt = config.build(model_parts=[model])
            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            dcp.load(sd, checkpoint_id=checkpoint)
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
        opt.zero_grad()
        _loss(model, step, mesh).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return {name: p.full_tensor() for name, p in model.named_parameters()}


def adamw(lr: float = 8e-4, **kwargs: Any) -> OptimizersContainer.Config:
    kwargs = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, **kwargs, "lr": lr}
    return OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs=kwargs)],
        implementation="for-loop")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: 1, FSDP2 alone)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    then = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp")) if args.tp > 1 else None
    reference = train(adamw(lr=1e-2), args.steps, mesh)
    ours = train(offload_adamw(lr=1e-2), args.steps, mesh)
    with tempfile.TemporaryDirectory() as tmp:
        path = [tmp]
        dist.broadcast_object_list(path)  # (one folder for every rank)
        resumed = {}
        for name, config in (("AdamW", adamw(lr=1e-2)), ("ours", offload_adamw(lr=1e-2))):
            resumed[name] = train(config, args.steps, mesh, checkpoint=f"{path[0]}/{name}", then=then)
        dist.barrier()
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(resumed["ours"][name], resumed["AdamW"][name],
                                   msg=lambda m: f"{name}, resumed: {m}")
    if dist.get_rank() == 0:
        where = f"a ({world // args.tp}, {args.tp}) mesh" if args.tp > 1 else "FSDP2"
        print(f"OffloadOptimizer in torchtitan's optimizer container on {where}: same parameters as "
              f"torch.optim.AdamW after {args.steps} steps, and after a DCP round trip of the container's state dict"
              + (f" resumed on a (1, {world}) mesh" if then is not None else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

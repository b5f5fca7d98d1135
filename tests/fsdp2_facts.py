"""What FSDP2 (``fully_shard``) and DCP do that an optimizer under them relies on, observed on CPU with gloo.

Each ``fact_*`` function runs on every rank of a process group (``fn(rank, world)``) on the harness's model
(tests/fsdp2_harness.py: uneven rows, a rank with an empty shard, tied weights, several units) and returns what it
saw, as plain values. tests/test_fsdp2.py asserts the ones the integration builds on, so a torch release that
changes them fails there first; docs/fsdp2-notes.md explains them. Run as a script to print them all:

    PYTHONPATH=. python tests/fsdp2_facts.py [--world 2 3]
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2_harness as h


def _model(world: int, **recipe) -> nn.Module:
    return h.build_model(world, h.Recipe(**recipe))


def _backward(model: nn.Module, rank: int, world: int, step: int = 0) -> None:
    h.loss_on(model, step, 0, rank, world).backward()


def _where(t) -> str:
    return f"{type(t).__name__} {str(t.device)}"


# --------------------------------------------------------------------------------------------- the hooks --
def fact_hooks(rank: int, world: int) -> Dict[str, Any]:
    """When and in which order FSDP runs post-accumulate-grad hooks of its sharded parameters, what p.grad is then."""
    out: Dict[str, Any] = {}
    for reshard in (True, False):
        model = _model(world, reshard_after_forward=reshard)
        names = {p: n for n, p in model.named_parameters()}
        events: List[str] = []
        grads: Dict[str, Any] = {}

        def hook(p):
            stack = set()
            frame = sys._getframe()
            while frame is not None:  # (inspect.stack reads source files: seconds here)
                stack.add(frame.f_code.co_name)
                frame = frame.f_back
            events.append(("final_callback " if "_root_post_backward_final_callback" in stack else "") + names[p])
            g = p.grad
            grads[names[p]] = dict(type=type(g).__name__, placements=str(tuple(g.placements)),
                                   local_shape=tuple(g.to_local().shape), contiguous=g.to_local().is_contiguous(),
                                   param_local_shape=tuple(p.to_local().shape), global_shape=tuple(g.shape))

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        def mark(i):
            def forward_hook(mod, args, output):
                output.register_hook(lambda g: events.append(f"<grad at blocks.{i}>"))
            return forward_hook

        for i, block in enumerate(model.blocks):  # when the gradient reaches a block's output: its backward starts
            block.register_forward_hook(mark(i))
        _backward(model, rank, world, step=1)  # step 1: logit_bias is used
        out[f"events reshard_after_forward={reshard}"] = list(events)
        if reshard:
            out["grads"] = grads
            # Accumulation across backwards without zero_grad: FSDP adds into p.grad's local tensor, then the hook.
            before = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
            events.clear()
            _backward(model, rank, world, step=1)
            out["second backward adds into p.grad"] = all(
                torch.allclose(p.grad.to_local(), 2 * before[n]) for n, p in model.named_parameters())
            out["second backward hooks"] = len(events) - 2
            # Gradient accumulation without sync: no reduce-scatter, no hook, p.grad stays None.
            model.zero_grad(set_to_none=True)
            events.clear()
            model.set_requires_gradient_sync(False)
            _backward(model, rank, world, step=1)
            out["no-sync backward: hooks"] = len(events) - 2
            out["no-sync backward: p.grad all None"] = all(p.grad is None for p in model.parameters())
            model.set_requires_gradient_sync(True)
            events.clear()
            _backward(model, rank, world, step=1)
            out["synced backward after a no-sync one: hooks"] = len(events) - 2
            out["synced backward after a no-sync one: sum of both"] = all(
                torch.allclose(p.grad.to_local(), 2 * before[n], atol=1e-6) for n, p in model.named_parameters())
    # A parameter unused in a step gets no gradient and no hook (logit_bias at step 0).
    model = _model(world)
    hooked = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: hooked.append(n))
    _backward(model, rank, world, step=0)
    out["unused parameter: hook / grad"] = ("logit_bias" in hooked, model.logit_bias.grad is not None)
    return out


def fact_write_back(rank: int, world: int) -> Dict[str, Any]:
    """Writing into p.to_local() in place is what the next forward's all-gather reads (also with bf16 compute and
    with CPUOffloadPolicy); the local tensor is a view into FSDP's padded shard."""
    out: Dict[str, Any] = {}
    for label, recipe in (("fp32", {}), ("bf16 compute", dict(mixed_precision=True)),
                          ("CPUOffloadPolicy", dict(cpu_offload=True))):
        model = _model(world, **recipe)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().copy_(torch.full_like(p.to_local(), 0.5 + rank))
        seen: Dict[str, Any] = {}
        up = model.blocks[0].up
        handle = up.register_forward_pre_hook(
            lambda mod, args: seen.update(dtype=mod.weight.dtype, values=sorted(set(mod.weight.flatten().tolist())),
                                          type=type(mod.weight).__name__))
        _backward(model, rank, world)
        handle.remove()
        p = model.blocks[0].up.weight
        out[label] = dict(gathered_values=seen["values"], compute_dtype=str(seen["dtype"]),
                          unsharded_type=seen["type"], sharded_dtype=str(p.dtype), param=_where(p),
                          grad=_where(p.grad), grad_dtype=str(p.grad.dtype))
    # The local tensors and the parameter objects stay the same through the first forward (FSDP's lazy init),
    # backward, and state-dict loads (sharded, full from rank 0, and nn.Module.load_state_dict).
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    model = _model(world)
    ident = lambda: [(id(p), p.to_local().data_ptr()) for p in model.parameters()]  # noqa: E731
    first = ident()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    _backward(model, rank, world)
    stable = [ident() == first]
    set_model_state_dict(model, get_model_state_dict(model))
    stable.append(ident() == first)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    stable.append(ident() == first)
    model.load_state_dict(get_model_state_dict(model))
    stable.append(ident() == first)
    out["same parameters and local storage after fwd/bwd, sharded load, full load, load_state_dict"] = stable
    # Dtypes: bf16 compute without reduce_dtype still gives fp32 gradients; a bf16 model has bf16 everything.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for label, dtype, policy in (("bf16 compute, no reduce_dtype", torch.float32,
                                  MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
                                 ("bf16 model", torch.bfloat16, MixedPrecisionPolicy())):
        torch.manual_seed(0)
        net = h.Net().to(dtype)
        for block in net.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(net, mesh=mesh, mp_policy=policy)
        _backward(net, rank, world)
        out[label] = (str(net.embed.weight.dtype), str(net.embed.weight.grad.dtype))
    out["local view of a padded storage"] = {
        n: (p.to_local().numel(), p.to_local().untyped_storage().nbytes() // p.element_size())
        for n, p in model.named_parameters()}
    return out


# ------------------------------------------------------------------------------- clipping and the scaler --
def fact_clip_and_scaler(rank: int, world: int) -> Dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode

    out: Dict[str, Any] = {}
    model = _model(world)
    _backward(model, rank, world)
    for foreach in (None, False):
        with CommDebugMode() as comm:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, foreach=foreach)
        out[f"clip foreach={foreach}"] = dict(type=type(norm).__name__, placements=str(norm.placements),
                                              collectives={str(k): v for k, v in comm.get_comm_counts().items()})
    # GradScaler: its found_inf is agreed over the mesh (an inf in one rank's shard is seen by all).
    model = _model(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scaler.scale(h.loss_on(model, 0, 0, rank, world)).backward()
    if rank == 0:
        with torch.no_grad():
            model.blocks[0].down.weight.grad.to_local().view(-1)[0] = float("inf")
    with CommDebugMode() as comm:
        scaler.unscale_(opt)
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]  # private: what unscale_ found
    out["scaler"] = dict(found_inf={str(k): v.item() for k, v in found.items()},
                         collectives={str(k): v for k, v in comm.get_comm_counts().items()})
    # FSDP1's ShardedGradScaler also works on DTensor gradients.
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = _model(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    sharded = ShardedGradScaler(device="cpu", init_scale=2.0 ** 8)
    sharded.scale(h.loss_on(model, 0, 0, rank, world)).backward()
    if rank == 0:
        with torch.no_grad():
            model.blocks[0].down.weight.grad.to_local().view(-1)[0] = float("inf")
    sharded.step(opt)
    sharded.update()
    out["ShardedGradScaler: scale after an inf in rank 0's shard"] = sharded.get_scale()
    # The inf-norm on a rank whose shard is empty (last: it leaves the ranks out of step).
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, norm_type=float("inf"), foreach=False)
        out["clip inf-norm"] = "ok"
    except RuntimeError as exc:
        out["clip inf-norm"] = f"{type(exc).__name__}: {exc}"
        # The ranks with non-empty shards wait in the norm's all-reduce (a max of one scalar): release them.
        dist.all_reduce(torch.zeros(()), op=dist.ReduceOp.MAX, group=model.embed.weight.device_mesh.get_group())
    return out


# ------------------------------------------------------------------------------------------ checkpoints --
class _Traced(torch.optim.AdamW):
    """AdamW that records the attributes DCP reads (names only) and what load_state_dict receives."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "log", [])

    def __getattribute__(self, name):
        if not name.startswith("__") and name != "log":
            log = object.__getattribute__(self, "__dict__").get("log")
            if log is not None:
                log.append(name)
        return object.__getattribute__(self, name)

    def load_state_dict(self, *args, **kwargs):
        sd = kwargs.get("state_dict", args[0] if args else None)
        entry = next(iter(sd["state"].values()))
        self.log.append(("load_state_dict args", len(args), sorted(kwargs),
                         type(next(iter(sd["state"]))).__name__, type(sd["param_groups"][0]["params"][0]).__name__,
                         {k: _where(v) for k, v in entry.items()}))
        object.__setattr__(self, "loaded", sd)
        return super().load_state_dict(*args, **kwargs)


def fact_state_dict(rank: int, world: int) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.tensor import DTensor

    out: Dict[str, Any] = {}

    def calls(opt):
        seen = [x for x in opt.log if isinstance(x, str)]
        opt.log.clear()
        return list(dict.fromkeys(seen))

    model = _model(world)
    opt = _Traced(model.parameters(), lr=1e-2, foreach=False)
    opt.log.clear()
    before = [p.to_local().clone() for p in model.parameters()]
    sd = get_optimizer_state_dict(model, opt)
    out["get on a fresh optimizer: calls"] = calls(opt)
    out["get on a fresh optimizer: step after"] = opt.state[model.embed.weight]["step"].item()
    out["get on a fresh optimizer: params unchanged, grads None"] = (
        all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters())),
        all(p.grad is None for p in model.parameters()))
    entry = sd["state"]["blocks.0.gain"]
    out["sharded entry"] = {k: (f"DTensor{tuple(v.shape)} {v.placements} local {tuple(v.to_local().shape)}"
                                if isinstance(v, DTensor) else f"{type(v).__name__} {v.dtype} {tuple(v.shape)}")
                            for k, v in entry.items()}
    out["keys"] = (list(sd["state"])[:3], sd["param_groups"][0]["params"][:3])
    _backward(model, rank, world)
    opt.step()
    opt.log.clear()
    get_optimizer_state_dict(model, opt)
    out["get: calls"] = calls(opt)
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out["full entry"] = {k: _where(v) + f" {tuple(v.shape)}" for k, v in full["state"]["embed.weight"].items()}
    rank0 = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["full+cpu_offload: entries on this rank"] = len(rank0.get("state", {}))
    sharded = get_optimizer_state_dict(model, opt)
    # A fresh optimizer while the parameters still hold gradients: _init_optim_state returns early (it takes
    # gradients as a sign of initialised state), so the full-state load has no local template.
    try:
        set_optimizer_state_dict(model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False), full,
                                 options=StateDictOptions(full_state_dict=True))
        out["set full into a fresh optimizer, grads present"] = "ok"
    except AssertionError as exc:
        out["set full into a fresh optimizer, grads present"] = f"{type(exc).__name__}: {exc}"
    model.zero_grad(set_to_none=True)
    for label, sdict, options in (
            ("set sharded", sharded, None),
            ("set full", full, StateDictOptions(full_state_dict=True)),
            ("set full broadcast_from_rank0", rank0, StateDictOptions(full_state_dict=True,
                                                                       broadcast_from_rank0=True))):
        new = _Traced(model.parameters(), lr=1e-2, foreach=False)
        new.log.clear()
        set_optimizer_state_dict(model, new, sdict, options=options)
        loaded = [x for x in new.log if not isinstance(x, str)]
        out[f"{label}: calls"] = calls(new)
        out[f"{label}: load_state_dict got"] = loaded[0][1:]
        out[f"{label}: equal"] = all(
            torch.equal(new.state[p]["exp_avg"].to_local(), opt.state[p]["exp_avg"].to_local())
            for p in model.parameters())
        # Which tensor load_state_dict receives: the caller's, the optimizer's own (its state_dict() is DCP's
        # template, written in place), or a new one. The optimizer's state made first, so it has its own tensors.
        new = _Traced(model.parameters(), lr=1e-2, foreach=False)
        get_optimizer_state_dict(model, new)
        own = new.state[model.embed.weight]["exp_avg"].to_local().data_ptr()
        given = sdict.get("state", {}).get("embed.weight", {}).get("exp_avg") if sdict else None
        given = given.to_local().data_ptr() if isinstance(given, DTensor) else None
        set_optimizer_state_dict(model, new, sdict, options=options)
        got = new.loaded["state"]["embed.weight"]["exp_avg"].to_local().data_ptr()
        out[f"{label}: load_state_dict receives"] = ("the caller's tensor" if got == given else
                                                     "the optimizer's own tensor" if got == own else "a new tensor")
    return out


# ------------------------------------------------------------------------------ other meshes and policies --
def fact_layouts(rank: int, world: int) -> Dict[str, Any]:
    """What parameters look like under CPUOffloadPolicy, HSDP, tensor parallelism and FSDP + TP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    out: Dict[str, Any] = {}
    try:
        torch.manual_seed(0)
        fully_shard(h.Net(), mesh=init_device_mesh("cpu", (world,)), offload_policy=CPUOffloadPolicy())
        out["CPUOffloadPolicy(pin_memory=True) on CPU"] = "ok"
    except RuntimeError as exc:
        out["CPUOffloadPolicy(pin_memory=True) on CPU"] = f"{type(exc).__name__}: {exc}"
    model = _model(world, cpu_offload=True)
    hooks = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: hooks.append(p))
    _backward(model, rank, world)
    p = model.blocks[0].up.weight
    out["CPUOffloadPolicy"] = dict(param=_where(p), grad=_where(p.grad), hooks=len(hooks),
                                   local_pinned=p.to_local().is_pinned())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    from torch.optim.optimizer import _default_to_fused_or_foreach

    out["AdamW default on CPU DTensors: (fused, foreach)"] = _default_to_fused_or_foreach(
        list(model.parameters()), differentiable=False, use_fused=False)
    opt.step()
    for shape in [(world, 1), (1, world)] + ([(2, world // 2)] if world % 2 == 0 and world > 2 else []):
        model = h.build_model(world, h.Recipe(mesh=shape))
        hooks.clear()
        for q in model.parameters():
            q.register_post_accumulate_grad_hook(lambda q: hooks.append(q))
        _backward(model, rank, world)
        q = model.blocks[0].up.weight
        out[f"HSDP mesh {shape}"] = dict(placements=str(q.placements), mesh_ndim=q.device_mesh.ndim,
                                         mesh_dims=str(q.device_mesh.mesh_dim_names), local=tuple(q.to_local().shape),
                                         grad=str(q.grad.placements), hooks=len(hooks))
    torch.manual_seed(0)
    block = h.Block()
    parallelize_module(block, init_device_mesh("cpu", (world,)), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    out["tensor parallel (1-D mesh)"] = {n: f"{type(q).__name__} {getattr(q, 'placements', '')}"
                                         for n, q in block.named_parameters()}
    if world % 2 == 0:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        block = h.Block()
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
        out["FSDP + TP (2-D mesh)"] = {n: f"{q.placements} on {q.device_mesh.mesh_dim_names}"
                                       for n, q in block.named_parameters()}
    return out


def fsdp_units(model: nn.Module) -> Dict[str, List[str]]:
    """FSDP units and their parameters' fqns, by public API only: each ``FSDPModule`` owns its parameters that no
    nested ``FSDPModule`` owns (a parameter tied across units belongs to the first unit that manages it: FSDP2
    itself assigns it so)."""
    from torch.distributed.fsdp import FSDPModule

    names = {p: n for n, p in model.named_parameters()}
    units = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    owned: set = set()
    out = {}
    for name, module in reversed(units):  # named_modules lists parents first: take the innermost units first
        params = [p for p in module.parameters() if p not in owned]
        owned.update(params)
        out[name or "<root>"] = [names[p] for p in params]
    return out


def fsdp_managed(model_or_none=None) -> Dict[int, str]:
    """The sharded parameters FSDP2 manages anywhere in this process, found from the parameters' side (what an
    optimizer can do: it is not given the model). Private: the composable-API state registry and FSDPState's
    param groups; no public way exists."""
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    found = {}
    for module, ref in list(_module_state_mapping.items()):
        state = ref()
        if isinstance(state, FSDPState):
            groups = getattr(state, "_fsdp_param_groups", None)  # (a list in torch 2.13; one group in 2.11)
            if groups is None:
                groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
            for group in groups:
                for fsdp_param in group.fsdp_params:
                    found[id(fsdp_param.sharded_param)] = type(module).__name__
    return found


def fact_units(rank: int, world: int) -> Dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = _model(world)
    out: Dict[str, Any] = {"units (public walk)": fsdp_units(model)}
    out["unit classes"] = {n or "<root>": type(m).__name__ for n, m in model.named_modules()
                           if isinstance(m, FSDPModule)}
    state = fully_shard.state(model.blocks[0])  # public accessor; what it returns is private
    out["fully_shard.state(block)"] = type(state).__name__
    managed = fsdp_managed()
    out["managed (private registry): all model params"] = all(id(p) in managed for p in model.parameters())
    torch.manual_seed(0)
    tp = nn.Linear(4, 4)
    parallelize_module(tp, init_device_mesh("cpu", (world,)), ColwiseParallel())
    out["TP colwise weight: placements / ndim / FSDP-managed"] = (str(tp.weight.placements),
                                                                   tp.weight.device_mesh.ndim,
                                                                   id(tp.weight) in fsdp_managed())
    return out


FACTS = {f.__name__: f for f in (fact_hooks, fact_write_back, fact_clip_and_scaler, fact_state_dict, fact_layouts,
                                 fact_units)}


def all_facts(rank: int, world: int) -> Dict[str, Any]:
    """Every fact, on every rank."""
    return {name: fn(rank, world) for name, fn in FACTS.items()}


def main():
    import argparse
    import pprint

    from test_distributed import launch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[2, 3])
    args = ap.parse_args()
    print(f"torch {torch.__version__}, gloo on CPU")
    for world in args.world:
        results = launch(all_facts, world, timeout=300)
        for rank, facts in results.items():
            print(f"\n======== world {world}, rank {rank}")
            for name, value in facts.items():
                print(f"--- {name}")
                pprint.pprint(value, width=120, sort_dicts=False)


if __name__ == "__main__":
    main()

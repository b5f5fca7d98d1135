"""The planner under FSDP2 with the model known (``python -m zero_offload --model CFG --fsdp N``): each rank's
buckets cut at FSDP2's units as the optimizer cuts them, and the GPU memory FSDP2 itself takes (the gathered units,
their gradients, the reduce-scatter input) as rows of the plan.

The reference for the buckets is an ``OffloadOptimizer`` built over FSDP2's shards of the harness's model
(tests/fsdp2_harness.py: uneven shards, a parameter with fewer rows than ranks, tied embeddings, root parameters at
both ends of the model's parameter order), each block a unit and the root the rest, on gloo at world 2: its own buckets on each rank,
as on a GPU (the CUDA stand-ins, and no storage taken over, as for a shard on a GPU) and on the host (a CPU mesh,
whose shards' padded storage the optimizer takes over).
"""

from __future__ import annotations

import json
from itertools import chain

import pytest
import torch

import fsdp2_harness as h
from test_report import install_fake_transformers
from zero_offload import OffloadOptimizer
from zero_offload.fsdp_units import model_units
from zero_offload.memory_plan import fsdp_plan
from zero_offload.report import main

pytestmark = h.NEEDS_FSDP2

BLOCKS = 3
BUCKETS = (64, 4096)  # a cap that cuts inside units too, and one that only the units cut
MIX = {"resident": 0.3, "parked": 0.4}  # of the 5 buckets a rank (at 4096): the first resident, the next parked


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return h.Net(blocks=BLOCKS)


def built_buckets(rank: int, world: int):
    """In a spawned rank: per (where, bucket_numel), the optimizer's own buckets over FSDP2's shards of the harness
    model ((elements, flat length) each) and its ``estimate_host_memory()`` total. ``"gpu"``: built on the CUDA
    stand-ins (the slots take over the shards' storage, as on a GPU); ``"host"``: on the CPU mesh as it is."""
    import cuda_standins

    out = {}
    for where in ("gpu", "host"):
        for bucket_numel in BUCKETS:
            model = h.build_model(world, h.Recipe(), model=_net())
            if where == "gpu":
                with cuda_standins.installed():
                    opt = OffloadOptimizer(model.parameters(), lr=1e-3, bucket_numel=bucket_numel)
            else:
                opt = OffloadOptimizer(model.parameters(), lr=1e-3, bucket_numel=bucket_numel)
            buckets = list(chain.from_iterable(opt._buckets))
            out[where, bucket_numel] = ([(b.layout.numel, b.layout.padded_numel) for b in buckets],
                                        opt.estimate_host_memory().total_bytes)
    model = h.build_model(world, h.Recipe(), model=_net())
    with cuda_standins.installed():
        opt = OffloadOptimizer(model.parameters(), lr=1e-3, bucket_numel=4096, placement=MIX)
        out["homes"] = {home: vars(cost) for home, cost in opt.estimate_host_memory().homes.items()}
    return out


def test_the_plan_cuts_each_ranks_buckets_at_fsdp2s_units_as_the_optimizer_does():
    """Per rank: the planner's bucket count, elements and padding are the optimizer's own, and the plan of that rank
    holds the host RAM the optimizer's estimate holds. Planned without the units (as before), the count differs:
    the units cut the buckets (at 4096, only they do: a bucket for each block, and two for the root's parameters,
    first and last in the model)."""
    from test_distributed import launch

    per_rank = launch(built_buckets, 2, timeout=300.0)
    params = list(_net().parameters())
    units = model_units(_net())
    assert units.blocks == BLOCKS and units.keys.count(-1) == 4  # embed, norm (2), logit_bias; head tied to embed
    for (where, bucket_numel) in (k for k in per_rank[0] if k != "homes"):
        device = "cuda" if where == "gpu" else "cpu"
        plan = fsdp_plan(params, 0, torch.float32, 2, units=units, bucket_numel=bucket_numel, device=device)
        uncut = fsdp_plan(params, 0, torch.float32, 2, bucket_numel=bucket_numel, device=device)
        for rank, built in per_rank.items():
            layouts, total = built[where, bucket_numel]
            what = (where, bucket_numel, rank)
            row = next(r for r in plan.rank_buckets if r.first <= rank <= r.last)
            assert row.buckets == len(layouts), what
            assert row.numel == sum(n for n, _ in layouts), what
            assert row.padding == sum(p - n for n, p in layouts), what
            mine = fsdp_plan(params, 0, torch.float32, 2, units=units, bucket_numel=bucket_numel, device=device,
                             rank=rank)
            assert mine.host.total_bytes == total, what
            assert mine.numel == row.numel and mine.fsdp_rank == rank, what
            if bucket_numel == 4096:  # (at 64 the cap alone cuts almost every slot apart)
                assert len(layouts) == BLOCKS + 2 != next(
                    r for r in uncut.rank_buckets if r.first <= rank <= r.last).buckets, what
    # Placed in homes, the buckets cut at the units: each home's figures on each rank are the optimizer's.
    for rank, built in per_rank.items():
        plan = fsdp_plan(params, 0, torch.float32, 2, units=units, bucket_numel=4096, placement=MIX, rank=rank)
        assert {home: vars(cost) for home, cost in plan.host.homes.items()} == built["homes"], rank
        assert {home: cost["buckets"] for home, cost in built["homes"].items()} == {"resident": 1, "parked": 1,
                                                                                    "host": 3}, rank
    # The ranks differ here (rank 1 holds fewer rows, and none of each block's gain): both are planned.
    plan = fsdp_plan(params, 0, torch.float32, 2, units=units, bucket_numel=4096)
    assert [(r.first, r.last) for r in plan.rank_buckets] == [(0, 0), (1, 1)]


def test_model_units_finds_the_blocks_and_the_root():
    net = _net()
    units = model_units(net)
    names = [n for n, _ in net.named_parameters()]
    assert [k for n, k in zip(names, units.keys) if n.startswith("blocks.")] == [b for b in range(BLOCKS)
                                                                                for _ in range(5)]
    assert units.block_name == "Block" and "blocks" in units.how
    whole = model_units(net, "whole")
    assert set(whole.keys) == {-1} and whole.blocks == 0
    net._no_split_modules = ["Block"]  # (Hugging Face's name for its blocks)
    assert model_units(net).keys == units.keys and "_no_split_modules" in model_units(net).how
    with pytest.raises(ValueError, match="Invalid fsdp units: 'layers'"):
        model_units(net, "layers")


@pytest.mark.parametrize("param, reduce", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                           (torch.bfloat16, torch.bfloat16)])
def test_fsdp2s_own_gpu_memory_is_rows_of_both_columns(param, reduce):
    """The harness model at world 4 (VOCAB 11, DIM 6, HIDDEN 5): an all-gather gives each parameter N ceil(rows/N)
    rows. Root: embed 12 x 6 (11 rows padded to 12), norm 8 + 8 (6 padded to 8), logit_bias 12: 100 elements. A
    block: up 8 x 6 + 8, down 8 x 5 + 8 (6 rows to 8), gain 4 x 6 (1 row to 4): 128. Gathered: the root and two
    blocks (the running one and the one prefetched); gradients (unpadded): the root's 66 + 6 + 6 + 11 = 89 and a
    block's 30 + 5 + 30 + 6 + 6 = 77; reduce-scatter input: the largest unit, 128, in reduce_dtype."""
    params = list(_net().parameters())
    plan = fsdp_plan(params, 0, torch.float32, 4, units=model_units(_net()), param_dtype=param, reduce_dtype=reduce)
    p, r = param.itemsize, reduce.itemsize
    own = {"FSDP2 gathered": (100 + 2 * 128) * p, "FSDP2 unit gradients": (89 + 77) * p,
           "FSDP2 reduce-scatter": 128 * r}
    assert {k: v for k, v in plan.ours["gpu"].items() if k.startswith("FSDP2")} == own
    assert {k: v for k, v in plan.adamw["gpu"].items() if k.startswith("FSDP2")} == own
    shards = plan.numel * 4  # the rank's fp32 shards, and as much for their gradients
    assert plan.total("ours", "gpu") == 2 * shards + sum(own.values())
    whole = fsdp_plan(params, 0, torch.float32, 4, units=model_units(_net(), "whole"), param_dtype=param,
                      reduce_dtype=reduce)
    # One unit: the whole model gathered once (100 + 3 x 128), its gradients (89 + 3 x 77), its reduce-scatter input.
    assert {k: v for k, v in whole.ours["gpu"].items() if k.startswith("FSDP2")} == {
        "FSDP2 gathered": 484 * p, "FSDP2 unit gradients": 320 * p, "FSDP2 reduce-scatter": 484 * r}


# --------------------------------------------------------------------------------------------- the command line --
@pytest.fixture
def fake_transformers(monkeypatch):
    """``--model`` through transformers' Auto classes, which give the harness model here."""
    install_fake_transformers(monkeypatch, _net)


def test_the_command_line_plans_the_units_and_says_so(fake_transformers, capsys):
    main(["--model", "net/config.json", "--fsdp", "4", "--param-dtype", "bf16", "--reduce-dtype", "fp32",
          "--bucket-numel", "4096", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["fsdp_units"]["units"] == BLOCKS + 1 and data["fsdp_units"]["blocks"] == BLOCKS
    plan = fsdp_plan(list(_net().parameters()), 0, torch.float32, 4, units=model_units(_net()), bucket_numel=4096,
                     param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert data["fsdp_units"]["ranks"] == [{"first": r.first, "last": r.last, "buckets": r.buckets,
                                           "numel": r.numel, "padding": r.padding} for r in plan.rank_buckets]
    assert data["per_rank"]["OffloadOptimizer"]["gpu"]["FSDP2 gathered"] == (100 + 2 * 128) * 2
    main(["--model", "net/config.json", "--fsdp", "4", "--param-dtype", "bf16", "--bucket-numel", "4096"])
    out = capsys.readouterr().out
    assert "FSDP2 units" in out and f"{BLOCKS} blocks (Block, found by" in out, out
    assert "FSDP2 gathered (bf16)" in out and "FSDP2 reduce-scatter (bf16)" in out, out
    assert "which the planner cannot size" not in out, out
    main(["--model", "net/config.json", "--fsdp", "4", "--fsdp-units", "whole", "--json"])
    assert json.loads(capsys.readouterr().out)["fsdp_units"]["units"] == 1


def test_without_the_model_the_units_are_unknown_and_said_so(capsys):
    main(["--params", "7B", "--fsdp", "8"])
    out = capsys.readouterr().out
    assert "which the planner cannot size" in out and "FSDP2 gathered" not in out, out
    with pytest.raises(SystemExit):
        main(["--params", "7B", "--fsdp", "8", "--fsdp-units", "whole"])
    assert "--fsdp-units needs --model" in capsys.readouterr().err

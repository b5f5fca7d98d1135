"""Each home's figures (zero_offload/home_costs.py): the host RAM and GPU memory its buckets hold, the bytes they copy
each way per step and the elements the CPU kernel steps, in ``opt.estimate_host_memory()``, in the plan before the
optimizer is built, and in the planner (``python -m zero_offload --params N --placement ...``). Every figure is
checked against arithmetic written here from docs/placement.md's bytes per parameter:

* host home (a GPU bucket): host RAM 4 B master + 8 B moments + the gradient buffer (4 B fp32; 2 B bf16, whose
  kernel writes the new parameter into it: no staging); gradients down and parameters up, 4 + 4 B (2 + 2 for bf16);
  the kernel steps every parameter; no GPU memory;
* parked: its state on the host, 8 B (12 B with the fp32 master of bf16 parameters); as much on the GPU while it is
  stepped, and up and down each step; no kernel;
* resident: no host RAM; the state on the GPU, 8 B (12 B for bf16); nothing crosses.

Sharded over a process_group (per rank), a parked or resident bucket's GPU bytes add the rank's shard of the reduced
gradients, the parameters' bytes of the shard (4 B, 2 B for bf16), held through the step; the full gradient the
reduce-scatter reads is transient, not held.

Under FSDP2 on a GPU (the planner's ``--fsdp N``, per rank), a parked or resident bucket takes over the storage FSDP
keeps for its shards, as one GPU binds a parameter to its slot: one GPU's figures per rank (fp32: 8 B parked on the
host and across PCIe each way, 8 B resident on the GPU; bf16: 12 B, no staging copy beside the shard).

State buffers are allocated padded (``padded_numel``), gradients and parameters cross by their elements.
"""

from __future__ import annotations

import json
from itertools import chain

import pytest
import torch

import cuda_standins
from test_optimizer import TinyTransformer, param_groups
from test_twin_flow import BUCKET
from zero_offload import OffloadOptimizer
from zero_offload.cost_model import ASSUMED_RATES
from zero_offload.home_costs import HomeCost
from zero_offload.memory_plan import fsdp_plan
from zero_offload.report import count_plan, main, memory_plan, meta_params

MIX = {"resident": 0.3, "parked": 0.4}  # TinyTransformer's first group: 1 bucket resident, 2 parked, 3 host


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch)


def _expected(home: str, numel: int, padded: int, buckets: int, dtype: torch.dtype) -> HomeCost:
    """docs/placement.md's bytes per parameter (module docstring), for ``buckets`` buckets of ``numel`` parameters
    in ``padded`` elements."""
    size = 4 if dtype == torch.float32 else 2
    state = 8 if dtype == torch.float32 else 12  # moments, and the separate fp32 master of bf16 parameters
    if home == "host":
        return HomeCost(buckets, numel, (4 + 8 + size) * padded, 0, size * numel, size * numel, numel)
    if home == "parked":
        return HomeCost(buckets, numel, state * padded, state * padded, state * padded, state * padded, 0)
    return HomeCost(buckets, numel, 0, state * padded, 0, 0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_estimate_shows_each_homes_bytes_and_traffic_per_step(cuda_branches, dtype):
    torch.manual_seed(0)
    model = TinyTransformer().to(dtype)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement=MIX)
    buckets = list(chain.from_iterable(opt._buckets))
    held = opt.estimate_host_memory()
    assert set(held.homes) == {"host", "parked", "resident"}
    for home in ("host", "parked", "resident"):
        mine = [b for b in buckets if b.home.kind == home]
        expected = _expected(home, sum(b.layout.numel for b in mine), sum(b.layout.padded_numel for b in mine),
                             len(mine), dtype)
        assert held.homes[home] == expected, home
    # The homes' host RAM is the estimate's; the plan before building says the same.
    assert sum(c.host_bytes for c in held.homes.values()) == held.total_bytes
    planned = OffloadOptimizer.estimate_host_memory(param_groups(model), bucket_numel=BUCKET, placement=MIX)
    assert planned.homes == held.homes
    # The predicted times: the bytes and elements at the rates given.
    host = held.homes["host"]
    assert host.seconds(ASSUMED_RATES) == pytest.approx(
        {"kernel": host.kernel_numel / 4.91e9, "up": host.up_bytes / 50.6e9, "down": host.down_bytes / 50.6e9})


def test_a_cpu_models_buckets_cross_nothing():
    """CPU parameters are stepped on the host whatever the placement: the kernel steps them all, nothing crosses."""
    model = TinyTransformer()
    est = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement=MIX).estimate_host_memory()
    numel = sum(p.numel() for p in model.parameters())
    assert set(est.homes) == {"host"}
    host = est.homes["host"]
    assert (host.numel, host.kernel_numel, host.up_bytes, host.down_bytes, host.gpu_bytes) == (numel, numel, 0, 0, 0)
    assert host.host_bytes == est.total_bytes


B = 1024  # elements per bucket (a multiple of the alignment: no padding), 10 buckets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("placement, counts", [
    ("host", {"host": 10}), ("parked", {"parked": 10}), ("resident", {"resident": 10}),
    ({"resident": 0.2, "parked": 0.3}, {"resident": 2, "parked": 3, "host": 5}),
    ("auto", {"host": 10}),  # (placed after the second step: planned as all on the host)
])
def test_the_plan_shows_each_homes_figures(dtype, placement, counts):
    plan = count_plan(10 * B, dtype, bucket_numel=B, placement=placement)
    assert plan.host.homes == {h: _expected(h, n * B, n * B, n, dtype) for h, n in counts.items()}
    assert plan == memory_plan(meta_params(10 * B, dtype, B), bucket_numel=B, placement=placement)
    # The table's rows follow: the resident state in ours' GPU rows, the parked state in neither (on the GPU only
    # while stepped), the host rows the host and parked buckets' buffers.
    state = 8 if dtype == torch.float32 else 12
    gpu_state = sum(v for k, v in plan.ours["gpu"].items() if k not in ("params", "gradients"))
    assert gpu_state == state * B * counts.get("resident", 0)
    assert plan.total("ours", "host") == sum(c.host_bytes for c in plan.host.homes.values())


def test_the_plan_of_many_buckets_is_the_plan_of_its_stand_ins():
    """count_plan adds up each home's run of buckets arithmetically: the same figures as planning them all."""
    for numel in (37 * B + 320, 40 * B):
        for placement in ({"resident": 0.1, "parked": 0.55}, {"parked": 0.5}, {"resident": 1.0}):
            assert count_plan(numel, torch.bfloat16, bucket_numel=B, placement=placement) == memory_plan(
                meta_params(numel, torch.bfloat16, B), bucket_numel=B, placement=placement), (numel, placement)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_planner_takes_placement_and_predicts_each_homes_time(capsys, dtype):
    main(["--params", str(10 * B), "--bucket-numel", str(B), "--dtype", dtype, "--placement",
          "resident=0.2,parked=0.3", "--json"])
    out = json.loads(capsys.readouterr().out)
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    assert out["placement"] == {"resident": 0.2, "parked": 0.3}
    rates = out["rates"]
    for home, n in (("resident", 2), ("parked", 3), ("host", 5)):
        expected = _expected(home, n * B, n * B, n, torch_dtype)
        row = out["homes_per_rank"][home]
        assert {k: v for k, v in row.items() if k != "seconds_per_step"} == vars(expected)
        assert row["seconds_per_step"] == pytest.approx({
            "kernel": expected.kernel_numel / rates["kernel_elements_per_s"],
            "up": expected.up_bytes / rates["upload_bytes_per_s"],
            "down": expected.down_bytes / rates["download_bytes_per_s"]})
    if not torch.cuda.is_available():  # (with a GPU the rates are measured, and said so)
        assert rates["kernel_elements_per_s"] == 4.91e9 and rates["upload_bytes_per_s"] == 50.6e9
        assert rates["source"].startswith("assumed (no GPU here): the H100 host of the first lease")
    # The text names the homes, their figures and where the rates come from.
    main(["--params", str(10 * B), "--bucket-numel", str(B), "--dtype", dtype, "--placement", "parked"])
    text = capsys.readouterr().out
    assert "homes            placement='parked'" in text and "* parked: GPU memory from its reload" in text
    assert ("assumed (no GPU here)" in text) != torch.cuda.is_available()
    # The flags it had still work, and their plan is the host placement's.
    main(["--params", str(10 * B), "--bucket-numel", str(B), "--dtype", dtype, "--gpu-fraction", "0.2", "--json"])
    fraction = json.loads(capsys.readouterr().out)
    assert fraction["homes_per_rank"]["resident"]["buckets"] == 2 and fraction["placement"] == "host"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("home", ["parked", "resident"])
def test_sharded_the_planner_gives_each_ranks_share_of_a_gpu_home(capsys, home, dtype):
    """Over a process_group each rank holds its shard of every bucket: half the elements, state and copies of one
    rank's plan at world 2. Its GPU bytes are its shard's state (8 B of moments per parameter, 12 with a bf16
    model's fp32 master) and its shard of the reduced gradients (the parameters' 4 B, 2 for bf16), held through the
    step; no full gradient buffer (the reduce-scatter reads a transient one). A parked shard's state crosses each
    way; a resident one's stays."""
    main(["--params", str(10 * B), "--bucket-numel", str(B), "--dtype", dtype, "--placement", home, "--world-size",
          "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    row = out["homes_per_rank"][home]
    size, state, shard = (4, 8, 5 * B) if dtype == "fp32" else (2, 12, 5 * B)
    assert row["buckets"] == 10 and row["numel"] == shard
    assert row["gpu_bytes"] == (state + size) * shard
    assert row["up_bytes"] == row["down_bytes"] == (state * shard if home == "parked" else 0)
    assert row["kernel_numel"] == 0 and row["host_bytes"] == (state * shard if home == "parked" else 0)
    # The GPU rows: the whole parameters and gradients (10 B elements), and a resident shard's state and gradients.
    gpu = out["totals_per_rank"]["OffloadOptimizer"]["gpu"]
    assert gpu == 2 * size * 10 * B + ((state + size) * shard if home == "resident" else 0)


@pytest.mark.parametrize("argv, match", [
    (["--placement", "gpu"], "Invalid placement: 'gpu'"),
    (["--placement", "resident=0.7,parked=0.5"], "Invalid placement"),
    (["--placement", "resident=lots"], "a share is a number from 0 to 1"),
    (["--placement", "parked", "--gpu-fraction", "0.5"], "alias"),
    (["--placement", "parked", "--device", "cpu"], "placement applies to a CUDA model"),
    (["--placement", "parked", "--state-dtype", "bf16"], "fp32 state only"),
])
def test_the_planner_refuses_a_placement_the_optimizer_refuses_naming_it(capsys, argv, match):
    with pytest.raises(SystemExit) as exc:
        main(["--params", "1B"] + argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ under FSDP2 --
def _expected_fsdp(home: str, numel: int, buckets: int, dtype: torch.dtype) -> HomeCost:
    """docs/placement.md's bytes per parameter of one rank's FSDP2 shards on a GPU (module docstring), for ``buckets``
    buckets of ``numel`` parameters without padding: as on one GPU, the shards' storage taken over by a GPU home (the
    moments, 8 B, and the fp32 master of bf16 shards, 4 B; an fp32 shard is its own master, a bf16 one the staging
    slot the update writes)."""
    if home == "host":
        return _expected(home, numel, numel, buckets, dtype)
    state = 8 if dtype == torch.float32 else 12
    if home == "parked":
        return HomeCost(buckets, numel, state * numel, state * numel, state * numel, state * numel, 0)
    return HomeCost(buckets, numel, 0, state * numel, 0, 0, 0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("placement, counts", [
    ("host", {"host": 10}), ("parked", {"parked": 10}), ("resident", {"resident": 10}),
    ("resident=0.2,parked=0.3", {"resident": 2, "parked": 3, "host": 5}),
    ("auto", {"host": 10}),  # (placed after the second step: planned as all on the host)
])
def test_an_fsdp2_plan_gives_each_homes_figures_per_rank(capsys, dtype, placement, counts):
    """--fsdp 2 --placement ...: each rank places the buckets of its own shards (half the model, 10 buckets), a
    GPU home taking the shards' storage over (one GPU's bytes per parameter)."""
    main(["--params", str(20 * B), "--bucket-numel", str(B), "--dtype", dtype, "--fsdp", "2", "--placement",
          placement, "--json"])
    out = json.loads(capsys.readouterr().out)
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    rows = {h: {k: v for k, v in row.items() if k != "seconds_per_step"} for h, row in out["homes_per_rank"].items()}
    assert rows == {h: vars(_expected_fsdp(h, n * B, n, torch_dtype)) for h, n in counts.items()}
    # The host RAM is the homes' (a resident bucket holds none), and the GPU rows carry the resident state.
    assert out["totals_per_rank"]["OffloadOptimizer"]["host"] == sum(r["host_bytes"] for r in rows.values())
    shards = 10 * B * torch_dtype.itemsize  # the rank's shards and their gradients, on the GPU
    resident = rows.get("resident", {}).get("gpu_bytes", 0)
    assert out["totals_per_rank"]["OffloadOptimizer"]["gpu"] == 2 * shards + resident


def test_an_fsdp2_plan_on_the_host_placement_is_unchanged():
    """The host placement's FSDP2 plan is the plan of one rank's shards as before: that count planned alone."""
    for device in ("cuda", "cpu"):
        for dtype in (torch.float32, torch.bfloat16):
            plan = fsdp_plan(None, 20 * B, dtype, 2, bucket_numel=B, device=device)
            alone = count_plan(10 * B, dtype, bucket_numel=B, device=device)
            if device == "cpu":  # (FSDP's own gradients: no gradient buffer, as fsdp_plan has always said)
                assert plan.total("ours", "host") == alone.total("ours", "host") - alone.host.buffers["grad"]
            else:
                assert (plan.ours, plan.host, plan.pinned) == (alone.ours, alone.host, alone.pinned), dtype


NET_WIDTH = 64  # every shard 4096 elements at world 2 (a multiple of the alignment: no padding), one bucket each


def _fsdp_net(dtype: torch.dtype) -> torch.nn.Module:
    """Six layers, alternately 64 -> 128 and 128 -> 64 (weights 128 x 64 and 64 x 128)."""
    torch.manual_seed(0)
    widths = [NET_WIDTH, 2 * NET_WIDTH] * 3 + [NET_WIDTH]
    return torch.nn.Sequential(*(torch.nn.Linear(a, b, bias=False) for a, b in zip(widths, widths[1:]))).to(dtype)


FSDP_MIX = {"resident": 0.34, "parked": 0.34}  # 6 buckets a rank: 2 resident, 2 parked, 2 on the host
FSDP_BUCKET = NET_WIDTH * NET_WIDTH


def built_over_fsdp2_shards(rank: int, world: int):
    """In a spawned rank: an optimizer over FSDP2's shards (each layer a unit) on the CUDA stand-ins, per dtype: its
    ``estimate_host_memory()`` (total, homes), the GPU bytes its resident buckets hold and the bytes its parked
    buckets park."""
    import cuda_standins
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _fsdp_net(dtype)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with cuda_standins.installed():
            opt = OffloadOptimizer(model.parameters(), lr=1e-3, bucket_numel=FSDP_BUCKET, placement=FSDP_MIX)
            held = opt.estimate_host_memory()
            buckets = list(chain.from_iterable(opt._buckets))
            out[dtype] = (held.total_bytes, {h: vars(c) for h, c in held.homes.items()},
                          sum(sum(b.device_bytes().values()) for b in buckets if b.home.kind == "resident"),
                          sum(b.home.nbytes_parked() for b in buckets if b.home.kind == "parked"))
    return out


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_an_fsdp2_plan_is_what_an_optimizer_over_fsdp2s_shards_holds():
    """The planner's FSDP2 plan of a model (rank 0's shards), and each rank's optimizer built over FSDP2's shards of
    it (on the CUDA stand-ins, gloo at world 2): the same figures per home, the documented arithmetic's, and what
    the built buckets hold (resident: on the GPU; parked: on the host, what crosses each way)."""
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch >= 2.6")
    from test_distributed import launch

    per_rank = launch(built_over_fsdp2_shards, 2, timeout=240.0)
    for dtype in (torch.float32, torch.bfloat16):
        plan = fsdp_plan(list(_fsdp_net(dtype).parameters()), 0, dtype, 2, bucket_numel=FSDP_BUCKET,
                         placement=FSDP_MIX)
        expected = {h: vars(_expected_fsdp(h, 2 * FSDP_BUCKET, 2, dtype)) for h in ("host", "parked", "resident")}
        assert {h: vars(c) for h, c in plan.host.homes.items()} == expected, dtype
        for rank, built in per_rank.items():
            total, homes, resident_gpu, parked = built[dtype]
            assert homes == expected, (rank, dtype)
            assert total == plan.host.total_bytes, (rank, dtype)
            assert resident_gpu == expected["resident"]["gpu_bytes"], (rank, dtype)
            assert parked == expected["parked"]["up_bytes"] == expected["parked"]["down_bytes"], (rank, dtype)


@pytest.mark.parametrize("placement", [{"resident": 0.3, "parked": 0.2}, "parked", {"resident": 0.5}])
def test_a_sharded_count_plan_keeps_every_gpu_stepped_parameters_gradients_as_the_layout_plan_does(placement):
    """Sharded over 2 ranks with release_grads, the buckets stepped on the GPU keep their whole gradients there
    (only streamed buckets drop theirs): the plan from a count (``--params``) and the plan from the parameters agree
    (10 buckets of 2**16 elements), and both are that arithmetic."""
    from zero_offload.memory_plan import count_plan, memory_plan

    kw = dict(bucket_numel=2**16, world_size=2, release_grads=True, placement=placement)
    params = [torch.empty(2**16, device="meta") for _ in range(10)]
    by_params, by_count = memory_plan(params, **kw), count_plan(10 * 2**16, torch.float32, **kw)
    shares = placement if isinstance(placement, dict) else {placement: 1.0}
    stepped = sum(round(10 * v) for v in shares.values()) * 2**16
    expected = 4 * (stepped + min(10 * 2**16 - stepped, 2 * 2**16))
    assert by_params.ours["gpu"]["gradients"] == by_count.ours["gpu"]["gradients"] == expected

"""Ranks of an FSDP2 mesh that part ways (issue 54), on CPU with gloo at world 2, each against FSDP2 +
``torch.optim.AdamW(foreach=False)`` on the same mesh, or a refusal raised on every rank that names what differs and
leaves every local shard as it was:

* a rank failing at ``step()`` names the parameter's whole shape (not its local shard's);
* ranks that put a parameter in different param groups, or (HSDP) replicas built with different ``state_dtype``;
* HSDP with a GradScaler where only one replica finds an inf: every rank skips and backs its scale off;
* a rank running ``torch.optim.AdamW`` where the others run ``OffloadOptimizer``.

The jobs run in one spawn (tests/fsdp2_harness.py ``run_jobs``), apart from tests/test_fsdp2.py's: its fixture runs
every recipe, these need a few calls.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import pytest
import torch
import torch.distributed as dist

import fsdp2_harness as h
from zero_offload import OffloadOptimizer

try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (public since torch 2.6)
except ImportError:
    fully_shard = None

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
              pytest.mark.skipif(fully_shard is None, reason="FSDP2 needs torch >= 2.6")]

ADAMW = functools.partial(torch.optim.AdamW, foreach=False)


def _step_raising(model, call) -> Tuple[Optional[str], Optional[str], bool]:
    """``call()``: the type and message of what it raised, and whether every local shard is as it was."""
    before = [p.to_local().clone() for p in model.parameters()]
    kind = message = None
    try:
        call()
    except Exception as exc:  # noqa: BLE001 (the test reads what was raised)
        kind, message = type(exc).__name__, str(exc)
    return kind, message, all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before))


# ------------------------------------------------------------------------------- a rank failing at step() --
def refuse_misshapen_grad(rank, world):
    """Rank 1's gradient of the first block's up-projection replaced by a DTensor whose local part has one row (its
    shard has 2): rank 1 raises naming the parameter with its whole shape, rank 0 that rank 1 raised; nothing is
    updated."""
    from torch.distributed.tensor import DTensor

    model = h.build_model(world, h.RECIPES["plain"])
    opt = OffloadOptimizer(model.named_parameters(), lr=h.LR, weight_decay=h.WEIGHT_DECAY)
    h.loss_on(model, 0, 0, rank, world).backward()
    p = model.blocks[0].up.weight
    if rank == 1:
        p.grad = DTensor.from_local(torch.zeros(1, p.shape[1]), p.device_mesh, p.placements, shape=p.shape,
                                    stride=p.stride(), run_check=False)
    return _step_raising(model, opt.step), tuple(p.shape), tuple(p.to_local().shape)


# -------------------------------------------------------------------------- what each parameter steps with --
def _groups(model, extra_decayed: Tuple[str, ...] = ()):
    """Matrices (and the vectors named in ``extra_decayed``) with weight decay; the other vectors without."""
    named = list(model.named_parameters())
    decayed = [p for n, p in named if p.ndim >= 2 or n in extra_decayed]
    rest = [p for n, p in named if not (p.ndim >= 2 or n in extra_decayed)]
    return [{"params": decayed}, {"params": rest, "weight_decay": 0.0}]


def refuse_param_in_other_group(rank, world, one_group: bool = False):
    """Rank 1 puts ``blocks.0.up.bias`` in the decayed group (rank 0 in the other one; with ``one_group``, rank 1
    has one group of every parameter, decayed): every rank raises naming that parameter (the first in FSDP's order
    whose group differs) and weight_decay, where it trained on; nothing is updated. Then every rank with rank 0's
    groups: the same step as AdamW's (params of every local shard)."""
    out = []
    for make in (OffloadOptimizer, ADAMW):
        model = h.build_model(world, h.RECIPES["plain"])
        if rank == 1 and make is OffloadOptimizer:
            groups = ([{"params": list(model.parameters())}] if one_group
                      else _groups(model, ("blocks.0.up.bias",)))
        else:
            groups = _groups(model)
        opt = make(groups, lr=h.LR, weight_decay=h.WEIGHT_DECAY)
        h.loss_on(model, 1, 0, rank, world).backward()  # (step 1's: every parameter has a gradient)
        out.append((model, opt))
    (ours, opt), (ref, ref_opt) = out
    refused = _step_raising(ours, opt.step)
    ours = h.build_model(world, h.RECIPES["plain"])
    opt = OffloadOptimizer(_groups(ours), lr=h.LR, weight_decay=h.WEIGHT_DECAY)
    for model, o in ((ours, opt), (ref, ref_opt)):
        o.zero_grad()
        h.loss_on(model, 0, 0, rank, world).backward()
        o.step()
    pairs = [(a.to_local(), b.to_local()) for a, b in zip(ours.parameters(), ref.parameters())]
    return refused, pairs


def refuse_state_dtype_on_one_replica(rank, world):
    """HSDP (two replicas of one shard): rank 1 built with ``state_dtype=torch.bfloat16``: every rank raises naming
    state_dtype; nothing is updated."""
    recipe = h.RECIPES["hsdp_replicate"]
    model = h.build_model(world, recipe)
    kw = {"state_dtype": torch.bfloat16} if rank == 1 else {}
    opt = OffloadOptimizer(model.parameters(), lr=h.LR, weight_decay=h.WEIGHT_DECAY, **kw)
    h.loss_on(model, 0, 0, rank, world).backward()
    return _step_raising(model, opt.step)


# ------------------------------------------------------------------------- HSDP with a GradScaler --
def scaler_inf_on_replicas(rank, world, make_opt, ranks: Tuple[int, ...], unscale: str = ""):
    """HSDP (two replicas of one shard) with a GradScaler for four steps; at step 1 an inf is put into the first
    block's up-projection's gradient on ``ranks`` after backward (after FSDP's all-reduce: the replicas' verdicts
    differ where ``ranks`` is one of them). ``unscale``: "torch" (``scaler.unscale_`` then torch's clip) or "opt"
    (``scaler.unscale_`` then ``opt.clip_grad_norm_``, torch's for AdamW); else ``scaler.step`` alone. Returns, per
    step, the scale after ``update()`` and whether the step left every local shard as it was; and the final local
    shards."""
    import dataclasses

    recipe = dataclasses.replace(h.RECIPES["hsdp_replicate"], clip=None, scaler=True)
    loop = h.make_loop(world, recipe, make_opt)
    model, opt, scaler = loop.model, loop.opt, loop.scaler
    steps = []
    for step in range(4):
        opt.zero_grad()
        scaler.scale(h.loss_on(model, step, 0, rank, world)).backward()
        if step == 1 and rank in ranks:
            model.blocks[0].up.weight.grad.to_local()[0, 0] = float("inf")
        before = [p.to_local().clone() for p in model.parameters()]
        if unscale:
            scaler.unscale_(opt)
            if unscale == "opt" and hasattr(opt, "clip_grad_norm_"):
                opt.clip_grad_norm_(h.CLIP)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), h.CLIP)
        scaler.step(opt)
        scaler.update()
        steps.append((scaler.get_scale(), all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(),
                                                                                             before))))
    return steps, [p.to_local().clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------- a mismatched peer --
def mismatched_peer(rank, world):
    """Rank 0 builds OffloadOptimizer, rank 1 ``torch.optim.AdamW`` (a config typo on one host), and both train:
    what each raised (type and message) at which step, and whether rank 0's shards were left as they were. No rank
    may abort the process (gloo's ``EnforceNotMet``, a collective paired with one of another size)."""
    model = h.build_model(world, h.RECIPES["plain"])
    opt = (OffloadOptimizer if rank == 0 else ADAMW)(model.parameters(), lr=h.LR, weight_decay=h.WEIGHT_DECAY)
    for step in range(3):
        before = [p.to_local().clone() for p in model.parameters()]
        try:
            opt.zero_grad()
            h.loss_on(model, step, 0, rank, world).backward()
            opt.step()
        except Exception as exc:  # noqa: BLE001 (the test reads what was raised)
            unchanged = all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before))
            return step, type(exc).__name__, str(exc), unchanged
    return None


JOBS = {
    "misshapen_grad": h.Call(refuse_misshapen_grad),
    "other_group": h.Call(refuse_param_in_other_group),
    "other_group_count": h.Call(refuse_param_in_other_group, (True,)),
    "state_dtype_hsdp": h.Call(refuse_state_dtype_on_one_replica),
}
# In a spawn of their own (a rank left waiting for a peer until gloo's timeout fails the rest of its spawn).
SCALER_JOBS = {
    # The reference: AdamW with the inf on every replica (each skips and backs off, as ours does mesh-wide).
    **{f"scaler/{how or 'step'}/{name}": h.Call(scaler_inf_on_replicas, (make, ranks, how))
       for how in ("", "torch", "opt")
       for name, make, ranks in (("adamw", ADAMW, (0, 1)), ("ours", OffloadOptimizer, (1,)))},
}


@pytest.fixture(scope="module")
def world2():
    return h.run_jobs(2, JOBS, timeout=240)


@pytest.fixture(scope="module")
def scaler_runs():
    return h.run_jobs(2, SCALER_JOBS, timeout=240)


def test_a_rank_failing_at_step_names_the_whole_shape(world2):
    out = world2["misshapen_grad"].per_rank
    (kind1, message1, unchanged1), shape, local1 = out[1]
    (kind0, message0, unchanged0), _, _ = out[0]
    assert kind1 == "RuntimeError", message1
    assert f"'blocks.0.up.weight') of shape {shape} (this rank's shard: {local1})" in message1, message1
    assert "has shape (1, 6)" in message1, message1
    assert kind0 == "RuntimeError" and "rank 1 raised at step()" in message0, message0
    assert unchanged0 and unchanged1


@pytest.mark.parametrize("job", ["other_group", "other_group_count"])
def test_a_parameter_in_another_group_on_one_rank_is_refused_naming_it(world2, job):
    for rank, ((kind, message, unchanged), pairs) in world2[job].per_rank.items():
        assert kind == "RuntimeError", (rank, kind, message)
        assert "the ranks step 'blocks.0.up.bias' of shape (5,)" in message, (rank, message)
        assert "weight_decay: 0.0 on rank 0, 0.1 on rank 1" in message, (rank, message)
        assert unchanged, rank
        for ours, adamw in pairs:
            torch.testing.assert_close(ours, adamw)


def test_replicas_with_different_state_dtype_are_refused_naming_it(world2):
    for rank, (kind, message, unchanged) in world2["state_dtype_hsdp"].per_rank.items():
        assert kind == "RuntimeError", (rank, kind, message)
        assert "state_dtype" in message and "0.0 on rank 0, 1.0 on rank 1" in message, (rank, message)
        assert unchanged, rank


@pytest.mark.parametrize("how", ["step", "torch", "opt"])
def test_hsdp_scaler_inf_on_one_replica_skips_and_backs_off_on_every_rank(scaler_runs, how):
    """Ours with the inf on one replica against AdamW with it on both: every rank skips step 1 and halves its scale
    (AdamW alone would step the other replica and keep its scale: the replicas would part), then trains on alike."""
    ours, ref = scaler_runs[f"scaler/{how}/ours"].per_rank, scaler_runs[f"scaler/{how}/adamw"].per_rank
    for rank in ours:
        (steps, params), (ref_steps, ref_params) = ours[rank], ref[rank]
        assert [s for s, _ in steps] == [s for s, _ in ref_steps], (rank, steps, ref_steps)
        assert [skipped for _, skipped in steps] == [False, True, False, False], (rank, steps)
        assert steps[1][0] == steps[0][0] / 2, (rank, steps)
        for a, b in zip(params, ref_params):
            torch.testing.assert_close(a, b)


def test_a_peer_running_adamw_is_named_and_no_rank_aborts():
    """Rank 0's exchange runs on a group of its own, so it never pairs with the next forward's all-gather of rank 1
    (running AdamW): rank 0 raises, naming a peer that is not at its exchange, with nothing updated; rank 1's
    all-gather waits for rank 0 and times out with a Python exception; neither process aborts."""
    from test_distributed import launch

    out = launch(mismatched_peer, 2, timeout=240, expect_errors=True)
    assert all(status == "ok" for status, _ in out.values()), out  # (an abort: "exited with code -6")
    (_, ours), (_, theirs) = out[0], out[1]
    assert ours is not None and ours[0] == 0 and ours[1] == "RuntimeError", ours
    assert "a peer is not at this exchange" in ours[2] and "not be running OffloadOptimizer" in ours[2], ours
    assert ours[3], "rank 0 updated its shards"
    assert theirs is not None and theirs[0] == 1 and theirs[1] == "RuntimeError", theirs

"""The streams of a sharded bucket stepped on the GPU (``placement`` resident or parked, ``ShardedDeviceRoute``): its
reduce-scatters and all-gathers run off the compute stream, as DDP's and FSDP2's do.

What a GPU would order, checked on the CUDA stand-ins (tests/cuda_standins.py: each stand-in stream keeps account of
what it waits for, and each device collective of a bucket of the stream it was issued on, which waits for it from
then on, as NCCL's ``Work.wait()`` makes it), gloo, world 2, the ranks forked as test_distributed's are:

* each reduce-scatter is issued on a side stream that has waited for everything the compute stream had queued (the
  gradients are written there), from an input made on that side stream (see ``ShardedDeviceRoute._scatter``);
* when backward ends (``step()`` not begun) the compute stream waits for none of them: backward never did;
* the compute stream waits for each bucket's reduce-scatters before it reads their shard: the gate's statistics and
  the update;
* each all-gather is issued on a side stream that has waited for the compute stream (the update wrote the shard),
  the compute stream waits for none while the updates run (each may overlap the previous bucket's all-gather), and
  for every one of them before ``step()`` returns.

And the run still equals ``torch.optim.AdamW(foreach=False)`` on the whole batch, parameters and gathered state
every step (default fp32 tolerance, as test_placement_sharded's). On ``main`` (every collective issued on the compute
stream, which ``Work.wait()`` then made wait for it at once) the second point fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import test_distributed as td
import test_placement_sharded as tps
from zero_offload import _torch_fused

STEPS = 3
CASES = {
    "parked": dict(placement="parked"),
    "resident_clip": dict(placement="resident", clip=0.3),
    # (a later micro-batch's shard lands beside the gradient's and is added on the collective stream)
    "parked_release_accumulate": dict(placement="parked", release_grads=True, accumulate=2, clip=0.3),
    "resident_at_step": dict(placement="resident", stream_grads=False),  # (reduce-scattered at step())
    "mix": dict(placement=tps.MIX, clip=0.3),  # (beside buckets stepped on the host)
}
pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
              pytest.mark.skipif(not _torch_fused.AVAILABLE, reason="torch < 2.4 has no fused AdamW for CPU tensors "
                                 "to stand in for the GPU's")]


class _Reads:
    """Where the compute stream reads a GPU bucket's shard of the reduced gradients (the gate's statistics, the
    update), a check that it waits for every reduce-scatter of the bucket issued this step (since ``since``) and, at
    the update, for no all-gather; each update then counts as work queued on the compute stream. ``gpu``: the
    buckets of the optimizer under test; ``seen``: the reads, as (what, bucket)."""

    def __init__(self, compute):
        import zero_offload.transport.sharded as sharded
        import zero_offload.update as update

        self.compute, self.gpu, self.since, self.seen = compute, [], 0, []
        norm, run_rule = sharded.device_sq_norm, update.run_rule

        def statistics(tensors):
            self.check("statistics", next(b for b in self.gpu if b.grads.allocated and b.grad is tensors[0]))
            return norm(tensors)

        def updated(bucket, *args, **kwargs):
            if bucket.home.on_device:
                self.check("update", bucket)
            out = run_rule(bucket, *args, **kwargs)
            if bucket.home.on_device:
                compute.tick()  # the update wrote the shard on the compute stream
            return out

        sharded.device_sq_norm, update.run_rule = statistics, updated

    def check(self, what, bucket):
        import cuda_standins

        issued = cuda_standins.LEDGER.issued[self.since:]
        scatters = {c.id for c in issued if c.what == "reduce_scatter" and c.where == f"gradients of {bucket.where}"}
        gathers = {c.id for c in issued if c.what == "all_gather"}
        assert scatters, f"{what} of {bucket.where}: read before any reduce-scatter of it"
        assert scatters <= self.compute.collectives, \
            f"{what} of {bucket.where}: the compute stream reads the shard before waiting for its reduce-scatter"
        if what == "update":
            assert not gathers & self.compute.collectives, f"the update of {bucket.where} waits for an all-gather"
        self.seen.append((what, bucket.where))


def _streams_worker(rank, world):
    import cuda_standins

    tps._on_standins()
    ledger = cuda_standins.LEDGER
    compute = ledger.compute
    reads = _Reads(compute)
    seen = {}
    for name, kw in CASES.items():
        kw = dict(kw)
        placement, accumulate, clip = kw.pop("placement"), kw.pop("accumulate", 1), kw.pop("clip", None)
        model, opt, ref_model = tps._make(rank, placement, **kw)
        ref = torch.optim.AdamW(tps.groups(ref_model), lr=1e-2, foreach=False)
        gpu = [b for g in opt._buckets for b in g if b.home.on_device]
        grads_of = {f"gradients of {b.where}" for b in gpu}
        params_of = {f"parameters of {b.where}" for b in gpu}
        for p in model.parameters():
            p.register_hook(lambda g: compute.tick())  # (its gradient is written on the compute stream)
        reads.gpu = gpu
        for step in range(STEPS):
            where = f"{name}, step {step}"
            since = reads.since = len(ledger.issued)
            opt.zero_grad()
            for micro in range(accumulate):
                (td.loss_on(model, step, micro, td.rows_of(rank, world)) / accumulate).backward()
            # Backward is over, step() has not begun: no reduce-scatter waited for on the compute stream.
            scattered = [c for c in ledger.issued[since:] if c.what == "reduce_scatter" and c.where in grads_of]
            if kw.get("stream_grads", True):
                assert {c.where for c in scattered} == grads_of, (where, scattered)
                assert len(scattered) == accumulate * len(grads_of), (where, scattered)
            else:
                assert not scattered, (where, scattered)
            assert not {c.id for c in scattered} & compute.collectives, \
                f"{where}: the compute stream waits for a reduce-scatter before backward ends"
            del reads.seen[:]
            norm = opt.clip_grad_norm_(clip) if clip is not None else None
            opt.step()
            ref_norm = td._ref_step(ref_model, ref, step, accumulate=accumulate, clip=clip)
            if norm is not None:
                torch.testing.assert_close(norm, ref_norm, msg=lambda m: f"{where} norm: {m}")
            tps._same(model, ref_model, opt, ref, where)
            issued = ledger.issued[since:]
            scattered = [c for c in issued if c.what == "reduce_scatter" and c.where in grads_of]
            gathered = [c for c in issued if c.what == "all_gather"]
            for c in scattered + [c for c in gathered if c.where in params_of]:
                assert c.stream is not compute, f"{where}: {c.what} of {c.where} issued on the compute stream"
                assert c.saw_compute, f"{where}: {c.what} of {c.where} issued before its stream waited for compute's"
            for c in scattered:
                assert c.input_stream is c.stream, f"{where}: the input of {c.where} not made on its stream"
            assert {c.where for c in gathered if c.where in params_of} == params_of, (where, gathered)
            assert {c.id for c in gathered} <= compute.collectives, \
                f"{where}: step() returned before the compute stream waited for every all-gather"
            # Every GPU bucket's shard read by the gate's statistics and by its update, each after its reduce-scatter.
            assert sorted(set(reads.seen)) == sorted({(w, b.where) for w in ("statistics", "update") for b in gpu}), \
                (where, reads.seen)
        seen[name] = len(gpu)
    return seen


def test_gpu_buckets_collectives_run_off_the_compute_stream():
    results = td.launch(_streams_worker, 2)
    assert results[0] == results[1]
    assert all(n > 0 for n in results[0].values()), results[0]


def _raising_worker(rank, world):
    """A step whose update raises (on every rank alike) after earlier GPU buckets' all-gathers were issued."""
    import cuda_standins
    import zero_offload.update as update

    tps._on_standins()
    ledger = cuda_standins.LEDGER
    compute = ledger.compute
    model, opt, _ = tps._make(rank, "resident")
    gpu = [b for g in opt._buckets for b in g if b.home.on_device]
    assert len(gpu) >= 2, gpu
    run_rule, updates = update.run_rule, []

    def updated(bucket, *args, **kwargs):
        if bucket.home.on_device:
            updates.append(bucket)
            if len(updates) == 2:
                raise RuntimeError("the update refused (stand-in)")
        out = run_rule(bucket, *args, **kwargs)
        if bucket.home.on_device:
            compute.tick()
        return out

    update.run_rule = updated
    since = len(ledger.issued)
    opt.zero_grad()
    td.loss_on(model, 0, 0, td.rows_of(rank, world)).backward()
    try:
        opt.step()
    except RuntimeError as e:
        assert "refused (stand-in)" in str(e), e
    else:
        raise AssertionError("step() did not raise")
    gathered = [c for c in ledger.issued[since:] if c.what == "all_gather"]
    assert gathered, "no all-gather issued before the update raised"
    # What reads the parameters next on the compute stream (the next forward, a checkpoint of the model) follows
    # the all-gathers the step issued, as it does after a step that returns; the host waited for them too.
    assert {c.id for c in gathered} <= compute.collectives, \
        "step() raised and left the compute stream not waiting for an all-gather in flight"
    assert all(lane.channel.gather is None for lane in opt._transport.lanes)
    return len(gathered)


def test_a_step_that_raises_leaves_no_all_gather_unwaited():
    """A step whose update raises (a class's own check, on every rank alike) after earlier buckets' all-gathers were
    issued on the collective stream: the compute stream still waits for them before anything reads the parameters
    (on a GPU, the next forward or a checkpoint of the model would otherwise read them while they are written)."""
    results = td.launch(_raising_worker, 2)
    assert results[0] == results[1] and results[0] > 0, results

"""What the per-step host work of a bucket stepped on the GPU saves must not change what it computes
(benchmarks/parked_overhead.py times it):

* Lion's device update steps per-parameter gradients where autograd left them (no flat copy of the bucket's
  gradients): bitwise ``zero_offload.Lion`` every step, fp32 and bf16 models, under a GradScaler.
* A parked bucket's per-parameter views of its device copies are cut once and kept while those copies' memory is
  the same: after every reload they are views into the memory that reload filled (never into memory given back),
  and the device memory is given back between steps.
* A class stepped whole that keeps another shape, or another key, at a later step than the probe saw is still
  refused, with the same message, though the shapes are checked only where the class replaced a tensor.

On CPU-only machines the GPU is the stand-in of tests/cuda_standins.py.
"""

from __future__ import annotations

from itertools import chain

import pytest
import torch

import cuda_standins
import test_park_class as park_class
import test_park_factored as park_factored
import zero_offload.rules.lion as lion_rule
from test_park_class import _homes, _same, _step_both
from zero_offload import Lion, offload

SHAPES = park_class.SHAPES + [(130,), (3, 2, 5)]
LION_KW = dict(lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1)


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch, needs_fused=False)


def _buckets(opt):
    return list(chain.from_iterable(opt._buckets))


# ------------------------------------------------------------------------------------------------------------ Lion --
def test_lion_parked_steps_the_gradients_where_autograd_left_them(cuda_branches, monkeypatch):
    """No flat copy of the bucket's gradients: the update reads each parameter's ``.grad`` itself (fp32, no scale),
    and is bitwise ``zero_offload.Lion`` every step, parameters and ``exp_avg``."""
    read = []
    single = lion_rule._single_tensor_lion

    def spy(params, grads, exp_avgs, **kw):
        read.append([g.untyped_storage().data_ptr() for g in grads])
        return single(params, grads, exp_avgs, **kw)

    monkeypatch.setattr(lion_rule, "_single_tensor_lion", spy)
    ours, theirs = park_class._params(SHAPES), park_class._params(SHAPES)
    opt = offload(Lion, park_class._groups(ours, dict(maximize=True)), placement="parked",
                  bucket_numel=park_class.BUCKET, **LION_KW)
    ref = Lion(park_class._groups(theirs, dict(maximize=True)), **LION_KW)
    assert set(_homes(opt)) == {"parked"} and len(_homes(opt)) > 2
    for step in range(4):
        read.clear()
        _step_both(ours, opt, theirs, ref, step)
        _same(ours, opt, theirs, ref, f"step {step}")
        grads = {p.grad.untyped_storage().data_ptr() for p in ours}
        assert read and all(ptr in grads for ptrs in read for ptr in ptrs), f"step {step}: a gradient was copied"
        assert sum(len(ptrs) for ptrs in read) == len(ours), step


def test_lion_parked_on_a_bf16_model_steps_its_masters_as_lion_steps_fp32_parameters(cuda_branches):
    """bf16 gradients upcast per parameter: the fp32 masters equal Lion's fp32 parameters bit for bit."""
    park_class.bf16_masters_run(Lion, park_class._params(SHAPES), park_class.BUCKET, **LION_KW)


def test_lion_parked_under_a_gradscaler_is_bitwise_lion_under_one(cuda_branches):
    """The unscale multiplies each parameter's gradient (a power of two: exact); the overflow step is skipped."""
    ours, theirs = park_class._params(), park_class._params()
    opt = offload(Lion, ours, placement="parked", bucket_numel=park_class.BUCKET, **LION_KW)
    park_class.scaled_run(ours, opt, theirs, Lion(theirs, **LION_KW), _same)

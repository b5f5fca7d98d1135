"""The Lion rule (:mod:`zero_offload.rules.lion`) over flat buffers against ``zero_offload.Lion(foreach=False)``
stepping the same parameters one tensor each (tests/rule_runs.py): params, ``exp_avg`` and ``param_out`` every
step, the SIMD tail sizes, one run over many slots with padding, runs longer than a chunk, gradients in fp32, bf16
and fp16 with a gradient multiplier, gradients read where they lie (``Run.grads``), bf16 state."""

from __future__ import annotations

import functools

import pytest
import torch

from rule_runs import compare
from zero_offload import Lion
from zero_offload.rules import lion as lion_rule
from zero_offload.rules.lion import CHUNK, LION

SIZES = [1, 7, 15, 17, 4097, 278011]


def _ref(**kwargs):
    return functools.partial(Lion, foreach=False, **kwargs)


GROUP = dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1, maximize=False)


@pytest.mark.parametrize("n", SIZES)
def test_lion_rule_tail_sizes(n):
    compare(LION, GROUP, _ref(**GROUP), [n], zero_padding=["exp_avg"])


@pytest.mark.parametrize("chunk", [CHUNK, 4096])
def test_lion_rule_many_slots_in_one_run_longer_than_a_chunk(chunk, monkeypatch):
    monkeypatch.setattr(lion_rule, "CHUNK", chunk)
    sizes = SIZES + [CHUNK + 3] if chunk == CHUNK else SIZES
    assert sum(sizes) > chunk
    compare(LION, GROUP, _ref(**GROUP), sizes, steps=3, zero_padding=["exp_avg"])


@pytest.mark.parametrize("grad_dtype,out_dtype", [(torch.float32, None), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float16, torch.float16)])
@pytest.mark.parametrize("segments", [False, True])
def test_lion_rule_low_precision_grads_scale_and_param_out(grad_dtype, out_dtype, segments):
    compare(LION, GROUP, _ref(**GROUP), [7, 4097, 70000], grad_dtype=grad_dtype, grad_scale=0.25,
            segments=segments, out_dtype=out_dtype, zero_padding=["exp_avg"])


@pytest.mark.parametrize("group", [dict(lr=0.003, betas=(0.95, 0.98), weight_decay=0.0, maximize=True),
                                   dict(lr=0.1, betas=(0.0, 0.5), weight_decay=1.0, maximize=False)])
def test_lion_rule_hyperparameters(group):
    compare(LION, group, _ref(**group), [17, 4097], steps=5, grad_scale=2.0)


def test_lion_rule_bf16_state():
    compare(LION, GROUP, _ref(**GROUP), [1, 17, 4097, 278011], steps=4, state_dtype=torch.bfloat16,
            grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16, zero_padding=["exp_avg"])


def test_lion_rule_declarations_and_validation():
    assert [b.name for b in LION.buffers] == ["exp_avg"] and LION.step_key is None
    assert LION.optimizer_class is Lion and torch.bfloat16 in LION.state_dtypes
    assert LION.defaults == {k: v for k, v in Lion([torch.nn.Parameter(torch.zeros(1))]).defaults.items()}
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1: 1.5"):
        LION.hyper(dict(GROUP, betas=(0.9, 1.5)))
    with pytest.raises(ValueError, match="Invalid learning rate: -0.1"):
        LION.hyper(dict(GROUP, lr=-0.1))
    assert LION.hyper(dict(GROUP, lr=torch.tensor(0.5))).lr == 0.5

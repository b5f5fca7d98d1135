"""Drive an update rule (:mod:`zero_offload.rules`) directly on flat buffers, the way the state store does, beside
its torch reference stepping the same parameters one tensor each: one bucket of parameters laid out in aligned
slots with zero padding between them, one run over all of them each step.

:func:`compare` checks, after every step, each parameter's master slice against the reference parameter, each
state buffer's slice against the reference's state of the same name, the per-parameter step count, the low-precision
``param_out`` against the reference parameter rounded, and that the padding stays zero in the masters (and in each
buffer for which the caller says so).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from zero_offload.rules.base import Rule, Run

ALIGN = 64  # the state home's slot alignment


def offsets_of(numels: Sequence[int]) -> List[int]:
    out, cursor = [], 0
    for n in numels:
        out.append(cursor)
        cursor += (n + ALIGN - 1) // ALIGN * ALIGN
    return out + [cursor]


@dataclasses.dataclass
class FlatBucket:
    """The flat buffers of one bucket as the state home would hold them (``state`` by buffer name)."""

    numels: List[int]
    offsets: List[int]
    master: torch.Tensor
    state: Dict[str, torch.Tensor]
    step: int = 0

    @staticmethod
    def of(init: Sequence[torch.Tensor], rule: Rule, hyper: Any, state_dtype=torch.float32) -> "FlatBucket":
        numels = [t.numel() for t in init]
        offsets = offsets_of(numels)
        master = torch.zeros(offsets[-1])
        for o, t in zip(offsets, init):
            master[o:o + t.numel()] = t.reshape(-1)
        state = {b.name: torch.zeros(offsets[-1], dtype=state_dtype) for b in rule.needed(hyper)}
        return FlatBucket(numels, offsets[:-1], master, state)

    def slot(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        return flat[self.offsets[i]:self.offsets[i] + self.numels[i]]

    def padding(self, flat: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(flat.numel(), dtype=torch.bool)
        for i in range(len(self.numels)):
            mask[self.offsets[i]:self.offsets[i] + self.numels[i]] = False
        return flat[mask]

    def step_rule(self, rule: Rule, hyper: Any, grads: Sequence[torch.Tensor], grad_scale: float = 1.0,
                  segments: bool = False, out_dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
        """One update of the whole bucket as one run; returns ``param_out`` (None without ``out_dtype``)."""
        self.step += 1
        flat_grad = None
        if not segments:
            flat_grad = torch.zeros(self.master.numel(), dtype=grads[0].dtype)
            for i, g in enumerate(grads):
                self.slot(flat_grad, i).copy_(g.reshape(-1))
        out = None if out_dtype is None else torch.full_like(self.master, 7.0, dtype=out_dtype)
        rule.update(Run(master=self.master, grad=flat_grad, grads=list(grads) if segments else None,
                        offsets=list(self.offsets), state=self.state, scales={}, step=self.step,
                        grad_scale=grad_scale, param_out=out), hyper)
        return out


def compare(rule: Rule, group: Dict[str, Any], reference: Callable[..., torch.optim.Optimizer],
            numels: Sequence[int], steps: int = 4, grad_dtype=torch.float32, grad_scale: float = 1.0,
            segments: bool = False, out_dtype: Optional[torch.dtype] = None, state_dtype=torch.float32,
            zero_padding: Sequence[str] = (), seed: int = 0) -> FlatBucket:
    """Step ``rule`` (hyperparameters ``group``) and ``reference(params)`` ``steps`` times on parameters of
    ``numels`` elements and compare (see the module docstring). With a bf16 ``state_dtype`` the reference's state
    is rounded to bf16 after each step, which is what storing it in bf16 means."""
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(n, generator=gen) for n in numels]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    ref = reference(params)
    hyper = rule.hyper(group)
    bucket = FlatBucket.of(init, rule, hyper, state_dtype)
    for _ in range(steps):
        grads = [torch.randn(n, generator=gen).to(grad_dtype) for n in numels]
        for p, g in zip(params, grads):
            p.grad = g.float() * grad_scale
        ref.step()
        out = bucket.step_rule(rule, hyper, grads, grad_scale, segments, out_dtype)
        for i, p in enumerate(params):
            state = ref.state[p]
            if state_dtype != torch.float32:
                for name in bucket.state:
                    state[name].copy_(state[name].to(state_dtype))
            torch.testing.assert_close(bucket.slot(bucket.master, i), p.detach(), msg=f"param {i}")
            for name, flat in bucket.state.items():
                torch.testing.assert_close(bucket.slot(flat, i).float(), state[name].float(),
                                           msg=f"{name} of param {i}")
            if rule.step_key is not None:
                assert float(state[rule.step_key]) == bucket.step
            if out is not None:
                torch.testing.assert_close(bucket.slot(out, i), p.detach().to(out_dtype), rtol=0, atol=0)
        assert not bucket.padding(bucket.master).any(), "the masters' padding changed"
        for name in zero_padding:
            assert not bucket.padding(bucket.state[name]).any(), f"the padding of {name} changed"
    return bucket

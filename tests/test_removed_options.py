"""Options that were removed (issue 52: ``speculate`` and ``speculation_memory``, with speculation itself). Passing
one, at any of the places that take offload options, is a ``TypeError`` that names it, says it was removed and why
(the measured step times) and what to use instead; and nothing is built: the parameters keep their storage and get
no hook. On the CUDA stand-ins (tests/cuda_standins.py), where the gradients would stream from backward hooks, so a
half-built optimizer would show (the same call without the option hooks every parameter: the check can fail)."""

from __future__ import annotations

import inspect

import pytest
import torch

import cuda_standins
from test_optimizer import TinyTransformer, param_groups
from zero_offload import OffloadOptimizer, offload
from zero_offload.options import OFFLOAD_OPTIONS

REMOVED = [("speculate", True), ("speculate", False), ("speculate", None), ("speculation_memory", 0),
           ("speculation_memory", None)]


def _entry_points():
    """(where the error says it came from, a call taking a model and the option by name, whether the call without
    it builds an optimizer)."""
    return [
        ("OffloadOptimizer", lambda model, kw: OffloadOptimizer(param_groups(model), lr=1e-3, **kw), True),
        ("offload", lambda model, kw: offload(torch.optim.AdamW, model.parameters(), lr=1e-3, **kw), True),
        ("offload", lambda model, kw: offload(torch.optim.SGD, model.parameters(), lr=1e-3, momentum=0.9, **kw),
         True),
        ("OffloadOptimizer.estimate_host_memory",
         lambda model, kw: OffloadOptimizer.estimate_host_memory(param_groups(model), **kw), False),
    ]


@pytest.mark.parametrize("name,value", REMOVED, ids=lambda v: repr(v))
@pytest.mark.parametrize("where,call,builds", _entry_points(),
                         ids=["constructor", "offload-adamw", "offload-sgd", "plan"])
def test_a_removed_option_is_a_type_error_that_says_why_and_builds_nothing(monkeypatch, name, value, where, call,
                                                                           builds):
    assert cuda_standins.install(monkeypatch.setattr) is not None
    torch.manual_seed(0)
    model = TinyTransformer()
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(TypeError) as info:
        call(model, {name: value})
    message = str(info.value)
    assert message.startswith(f"{where}: the option {name!r} was removed"), message
    for said in ("2.61x", "1.99x", "docs/benchmarks.md", "placement='auto'", "'parked'", "overlap_step=True"):
        assert said in message, (said, message)
    for n, p in model.named_parameters():
        ptr, value_before = before[n]
        assert p.data_ptr() == ptr, n  # not rebound into a bucket
        assert torch.equal(p, value_before), n
        assert not p._post_accumulate_grad_hooks, n  # no gradient stream hooked
    built = call(model, {})  # (kept: a dropped optimizer takes its hooks away)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert built is not None and trained and all(bool(p._post_accumulate_grad_hooks) == builds for p in trained)


def test_the_error_comes_before_any_other_check():
    """A removed option beside a bad value of a live one: the removed option is what the error names."""
    model = TinyTransformer()
    with pytest.raises(TypeError, match="'speculate' was removed"):
        OffloadOptimizer(param_groups(model), lr=-1.0, bucket_numel=0, speculate=True)


def test_an_instance_plan_refuses_it_too():
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model))
    with pytest.raises(TypeError, match="estimate_host_memory: the option 'speculation_memory' was removed"):
        opt.estimate_host_memory(param_groups(model), speculation_memory=1 << 30)


def test_removed_options_are_no_longer_options():
    """Not in OFFLOAD_OPTIONS, the constructor's signature or its docstring; an unknown name keeps Python's
    error."""
    signature = inspect.signature(OffloadOptimizer.__init__).parameters
    for name in ("speculate", "speculation_memory"):
        assert name not in OFFLOAD_OPTIONS and name not in signature
        assert f"{name} (" not in OffloadOptimizer.__doc__
    with pytest.raises(TypeError, match="unexpected keyword argument 'speculative'"):
        OffloadOptimizer(param_groups(TinyTransformer()), speculative=True)

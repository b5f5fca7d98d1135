"""Stand-ins that run the CUDA-only branches of zero_offload on CPU tensors (see test_cuda_branches.py).

The bucket layouts are told their parameters are on ``cuda:0`` (and the default placement, ``"auto"``, takes the
model for a GPU one); streams and events do nothing (a CPU copy is complete when it returns); tensors created for that
device are made on the CPU. Python in those branches then
runs for real; stream synchronisation does not exist here, so it is not tested. Nor, by themselves, are devices:
every tensor is a CPU tensor, so a host buffer handed to a GPU op passes; tests/device_check.py adds that check.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, List

import torch

import zero_offload.buckets as buckets_module
import zero_offload.cost_model as cost_model
import zero_offload.options as options_module
from zero_offload import _torch_fused


class Device:
    """Stands for ``cuda:0`` in the bucket layouts: its ``type`` picks the CUDA branches, and it equals the CPU
    device the tensors really are on (the check that a parameter has not moved)."""

    type = "cuda"
    index = 0

    def __eq__(self, other) -> bool:
        return other is self or other == torch.device("cpu")

    def __hash__(self) -> int:
        return hash("cuda:0 (stand-in)")

    def __repr__(self) -> str:
        return "cuda:0 (stand-in)"


class Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Event:
    def __init__(self, *args, **kwargs):
        self.recorded = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        assert self.recorded, "waited for an event that was never recorded"

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def installed():
    """The stand-ins for the duration of a ``with`` block (outside pytest: a spawned rank's job), then the real
    attributes back. Yields :func:`install`'s list."""
    saved = []

    def setattr_(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        yield install(setattr_)
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def install(setattr_: Callable[[object, str, object], None], default_host: bool = False) -> List[int]:
    """Install the stand-ins with ``setattr_`` (pytest's ``monkeypatch.setattr``, or ``setattr`` in a spawned
    process). Returns a list that grows by one entry per param group planned on the stand-in device. With
    ``default_host``, the default placement is left at the host, as for a CPU model (for the tests of the host
    route's CUDA branches, whose helpers build optimizers with the default options)."""
    device, current, planned = Device(), Stream(), []
    plan = buckets_module.plan_buckets

    def plan_on_cuda(params, max_numel, **kw):
        planned.append(len(params))
        return [dataclasses.replace(layout, device=device) for layout in plan(params, max_numel, **kw)]

    def on_cpu(make):
        def made(*args, **kwargs):
            if isinstance(kwargs.get("device"), Device):
                kwargs["device"] = "cpu"
            return make(*args, **kwargs)
        return made

    setattr_(buckets_module, "plan_buckets", plan_on_cuda)
    setattr_(buckets_module, "should_pin", lambda device, pin_memory: False)
    # The model counts as on a GPU (the default placement is "auto" there; not where torch < 2.4 has no fused CPU
    # AdamW to stand in for the GPU's update), whose copies run at a PCIe 4 link's rate ("auto" measures them after
    # the second step; the stand-in streams time nothing).
    gpu_model = not default_host and _torch_fused.AVAILABLE
    setattr_(options_module, "gpu_params", lambda params: gpu_model)
    setattr_(cost_model, "measure_copy_rate", lambda device, nbytes=0, up=True: 25e9)
    setattr_(torch.cuda, "Stream", Stream)
    setattr_(torch.cuda, "Event", Event)
    setattr_(torch.cuda, "current_stream", lambda device=None: current)
    setattr_(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    # A device with room to spare (uploads in backward and parked reloads ask).
    setattr_(torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 40))
    setattr_(torch.cuda, "memory_reserved", lambda device=None: 0)
    setattr_(torch.cuda, "memory_allocated", lambda device=None: 0)
    setattr_(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    setattr_(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)  # (uncapped)
    setattr_(torch.Tensor, "record_stream", lambda self, stream: None)
    for name in ("empty", "zeros"):
        setattr_(torch, name, on_cpu(getattr(torch, name)))
    return planned


def fixture_body(monkeypatch, needs_fused: bool = True, default_host: bool = False):
    """The body of a test module's ``cuda_branches`` fixture (``yield from fixture_body(monkeypatch)``): the
    stand-ins installed for the test, ``monkeypatch`` handed on, and a check that some optimizer used them. With
    ``needs_fused``, skipped where torch has no fused AdamW for CPU tensors to stand in for the GPU's (torch < 2.4);
    ``default_host``: see :func:`install`."""
    if needs_fused and not _torch_fused.AVAILABLE:
        import pytest

        pytest.skip("torch < 2.4 has no fused AdamW for CPU tensors to stand in for the GPU's")
    planned = install(monkeypatch.setattr, default_host)
    yield monkeypatch
    assert planned, "no optimizer was built on the stand-in device"


def install_in_rank() -> None:
    """In a spawned rank (for the process's life): :func:`install`, and each collective of ``zero_offload``'s
    process-group transport waited for as it starts (the stand-in streams order nothing, so a collective's result
    must be there before the next stand-in copy reads it)."""
    import zero_offload.distributed

    install(setattr)
    start = zero_offload.distributed.Comm.start

    def start_and_wait(comm, *args, **kwargs):
        pending = start(comm, *args, **kwargs)
        pending.wait()
        return pending

    zero_offload.distributed.Comm.start = start_and_wait

"""The room a GPU-stepped home counts on (tests/cuda_standins.py's GPU, its memory faked): within the process's
memory cap (``torch.cuda.set_per_process_memory_fraction``, as the lease plan's capped rows set it), and what happens
where the allocator cannot give what the room check counted. Each run against AdamW every step, default fp32
tolerance."""

from __future__ import annotations

import copy
from itertools import chain

import pytest
import torch

import cuda_standins
from test_optimizer import TinyTransformer, assert_same, loss_fn, param_groups
from test_twin_flow import BUCKET, _buckets, clipped_step_beside_adamw, fake_gpu_memory
from zero_offload import OffloadOptimizer


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch)


def _homes(opt):
    return [[b.home.kind for b in group] for group in opt._buckets]


def test_the_room_on_a_gpu_is_within_the_processs_memory_cap(monkeypatch):
    """A process capped with ``torch.cuda.set_per_process_memory_fraction`` (the lease plan's capped rows stand in
    for a smaller GPU so) gets an out-of-memory error beyond its fraction of the GPU however much the driver has
    free: the room a reload in backward asks for, and the room ``"auto"`` gives resident state, count the cap."""
    from zero_offload.placement import _device_room
    from zero_offload.transport.device import device_room

    gib = 2**30
    # (the fake GPU: 80 GiB, 30 free; the allocator holds 40, 38 allocated, 39 at the peak)
    fake_gpu_memory(monkeypatch, 30 * gib, reserved=40 * gib, peak=39 * gib, allocated=38 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)
    assert device_room("cuda") == (30 + 40 - 38) * gib
    assert _device_room("cuda", 1.0) == (30 + 40 - 39 - 1) * gib
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.5)  # 40 GiB
    assert device_room("cuda") == (40 - 38) * gib
    assert _device_room("cuda", 1.0) == (40 - 39 - 1) * gib


def test_under_a_memory_cap_the_state_comes_up_at_step(cuda_branches):
    """The driver has memory to spare (the stand-in's 1 TiB), but the process is capped at 1 KiB, less than a
    bucket's state: a parked bucket's state comes up at ``step()``, not in backward (where the allocation would
    raise), and the trajectory is AdamW's."""
    cuda_branches.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 2.0**-30)
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement="parked", gpu_margin_gib=0.0)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    opt.record_timeline()
    for step in range(3):
        for o, m in ((opt, model), (ref, ref_model)):
            o.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
        assert not [e for e in opt.timeline() if e.what == "reload"], step
        opt.step()
        ref.step()
        assert_same(model, ref_model, opt, ref, f"step {step}")
        assert [e for e in opt.timeline() if e.what == "reload"], step


def test_under_a_memory_cap_auto_keeps_no_state_resident_beyond_it(cuda_branches):
    """As in the test above it (a fast upload: resident and parked buckets without a cap), but the process capped at
    its peak plus the margin: no room for resident state, however much the driver has free; the trajectory stays
    AdamW's."""
    import zero_offload.cost_model as cost_model

    monkeypatch = cuda_branches
    monkeypatch.setattr(cost_model, "measure_copy_rate", lambda device, nbytes=0, up=True: 1e15)
    monkeypatch.setattr(cost_model, "measure_kernel_rate", lambda numel=0: 1e6)
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement="auto", gpu_margin_gib=1.0)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    fake_gpu_memory(monkeypatch, 40 * 2**30, peak=2**20, allocated=0)  # (of 80 GiB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: (2**30 + 2**20) / 80 / 2**30)
    for step in range(4):
        clipped_step_beside_adamw(opt, model, ref, ref_model, step)
    homes = set(chain.from_iterable(_homes(opt)))
    assert "resident" not in homes and homes != {"host"}, homes  # (parked: in the memory backward freed)


def _parked_beside_adamw(backward, held=lambda opt: 0):
    """Three steps of a parked TinyTransformer beside AdamW, ``backward[0]`` True while backward runs: no bucket's
    state is up when backward ends, ``held(opt)`` bytes of device memory are kept after backward and after
    ``step()`` (none expected), and the trajectory is AdamW's."""
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement="parked")
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    for step in range(3):
        backward[0] = True
        for o, m in ((opt, model), (ref, ref_model)):
            o.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
        backward[0] = False
        assert all(b.home.twins is None for b in _buckets(opt))
        assert held(opt) == 0, step
        opt.step()
        ref.step()
        assert_same(model, ref_model, opt, ref, f"step {step}")
        assert held(opt) == 0, step


def test_a_reload_in_backward_out_of_memory_comes_up_at_step(cuda_branches):
    """The room check passed but the allocator cannot give the memory (a fragmented cache): the reload in backward
    is dropped, backward goes on, and ``step()`` brings the state up; the trajectory is AdamW's."""
    from zero_offload.state.parked_home import ParkedHome

    backward, real = [False], ParkedHome.reload

    def reload(home, *args, **kwargs):
        if backward[0]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        return real(home, *args, **kwargs)

    cuda_branches.setattr(ParkedHome, "reload", reload)
    _parked_beside_adamw(backward)


def test_a_reload_in_backward_that_runs_out_of_memory_midway_holds_no_device_memory(cuda_branches):
    """The allocator gives the device copy of a parked bucket's first buffer (``exp_avg``) but not the second's: the
    reload is dropped, and the copy it did get is given back at once, not held through the rest of backward (where
    memory is short) until ``step()`` brings the state up; the trajectory is AdamW's."""
    from zero_offload.state.parked_home import ParkedHome

    backward, real = [False], ParkedHome._device_copy

    def device_copy(home, name, buf):
        if backward[0] and name != "exp_avg":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        return real(home, name, buf)

    def held(opt):  # (bytes of the device copies' storage, kept between steps: none outside a step)
        return sum(t.untyped_storage().nbytes() for b in _buckets(opt) for t in b.home._held.values())

    cuda_branches.setattr(ParkedHome, "_device_copy", device_copy)
    _parked_beside_adamw(backward, held)

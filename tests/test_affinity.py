"""ZERO_OFFLOAD_PIN_THREADS: which CPUs the kernel's threads are bound to, that the binding happens (read back from
/proc, not from what the code says it did) and changes no number, and the knob's bad values."""

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from zero_offload import OffloadOptimizer, affinity

ROOT = Path(__file__).resolve().parents[1]


def _topology(cores):
    """core_of for a machine described as {cpu: (package, core)}."""
    return lambda cpu: cores[cpu]


def test_one_cpu_per_physical_core_first_and_the_first_core_last():
    # 2 packages x 2 cores x 2 SMT threads, siblings numbered as Linux numbers them on x86 (cpu, cpu + 4).
    cores = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1), 4: (0, 0), 5: (0, 1), 6: (1, 0), 7: (1, 1)}
    assert affinity.kernel_cpus(list(cores), _topology(cores)) == [1, 2, 3, 5, 6, 7, 0, 4]


def test_the_allowed_mask_is_respected():
    cores = {2: (0, 1), 3: (0, 2), 6: (0, 1), 7: (0, 2)}
    assert affinity.kernel_cpus([7, 2, 3, 6], _topology(cores)) == [3, 7, 2, 6]


def test_one_core_gives_its_cpus_as_they_are():
    assert affinity.kernel_cpus([0, 1], _topology({0: (0, 0), 1: (0, 0)})) == [0, 1]


@pytest.mark.parametrize("value", ["2", "yes please", "-1"])
def test_a_bad_value_is_refused_naming_it_at_construction(monkeypatch, value):
    monkeypatch.setenv(affinity.ENV, value)
    with pytest.raises(ValueError, match=f"Invalid {affinity.ENV}={value!r}"):
        affinity.requested()
    p = torch.nn.Parameter(torch.ones(7))
    with pytest.raises(ValueError, match=f"Invalid {affinity.ENV}={value!r}"):
        OffloadOptimizer([p], lr=1e-3)


def test_unset_or_off_binds_nothing(monkeypatch):
    class NoBinding:
        def pin_team(self, cpus):
            raise AssertionError("bound although not asked")

    for value in (None, "", "0", "off"):
        if value is None:
            monkeypatch.delenv(affinity.ENV, raising=False)
        else:
            monkeypatch.setenv(affinity.ENV, value)
        assert affinity.ensure(NoBinding()) is None
        assert "left to the OS" in affinity.status()


def _cpus(listed):
    """A /proc Cpus_allowed_list ("0-3,5") as a set of CPUs."""
    out = set()
    for part in listed.strip().split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


_CHILD = textwrap.dedent("""
    import os, sys, torch
    from zero_offload import _build, affinity, functional
    if _build.load_native() is None or functional.resolve_path() not in ("avx512", "avx2", "neon", "scalar"):
        print("SKIP native kernel unavailable"); sys.exit(0)
    torch.set_num_threads(2)
    n = 278011
    g = torch.Generator().manual_seed(0)
    p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m, v = torch.zeros(n), torch.zeros(n)
    ref = torch.nn.Parameter(p.clone())
    adamw = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    for step in (1, 2, 3):
        functional.cpu_adam_(p, grad, m, v, step=step, lr=1e-2, weight_decay=0.1)
        ref.grad = grad.clone()
        adamw.step()
        st = adamw.state[ref]
        torch.testing.assert_close((p, m, v), (ref.detach(), st["exp_avg"], st["exp_avg_sq"]))
    def allowed(tid):
        for line in open(f"/proc/self/task/{tid}/status"):
            if line.startswith("Cpus_allowed_list:"):
                return line.split()[1]
    import threading
    print("MAIN", allowed(threading.get_native_id()))
    print("TASKS", sorted(allowed(t) for t in os.listdir("/proc/self/task")))
    print("EXPECT", affinity.kernel_cpus()[0])
    print("STATUS", affinity.status())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="binding threads needs Linux and two CPUs")
def test_the_kernels_helper_thread_is_bound_and_the_update_is_unchanged():
    env = {**os.environ, affinity.ENV: "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout.strip())
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    tasks = [_cpus(t) for t in ast.literal_eval(lines["TASKS"])]
    # The calling thread keeps the mask it had; exactly one more thread (the team's second) is on the expected CPU.
    assert _cpus(lines["MAIN"]) == os.sched_getaffinity(0)
    assert tasks.count({int(lines["EXPECT"])}) == 1, tasks
    assert "bound" in lines["STATUS"]

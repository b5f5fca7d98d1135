"""Where the CPU kernel's threads run: with ``ZERO_OFFLOAD_PIN_THREADS=1`` in the environment, the threads of the
intra-op team that runs the native kernel (torch's, ``torch.get_num_threads()`` of them) are bound one to a CPU,
one per physical core first, away from the core of the thread that calls the kernel (the one that drives the GPU,
which stays where the OS puts it and keeps that core to itself while there are cores enough). Unbound, the OS may
move a kernel thread mid-pass, stack two on the SMT siblings of one core, or on the core the driving thread needs to
launch the GPU's work (DeepSpeed binds its CPU-Adam threads to cores and reports 15% from it).

Off by default until a GPU lease measures it (``benchmarks/gpu_suite.py`` runs the host step with it on and off).
Binding is done once per calling thread and team size, the first time that thread runs a native update, by the team
threads themselves (:func:`ensure`). It binds only the team's helper threads, never the caller: torch reuses the same
team for the intra-op work the calling thread starts, so torch's own CPU ops from that thread run on those CPUs too.
For every OpenMP team of the process instead, start it with ``OMP_PROC_BIND=close OMP_PLACES=cores``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from zero_offload.host_memory import env_flag

__all__ = ["ENV", "ensure", "kernel_cpus", "requested", "status"]

ENV = "ZERO_OFFLOAD_PIN_THREADS"

_lock = threading.Lock()
_bound: Dict[Tuple[int, int], List[int]] = {}  # (calling thread, team size) -> each team thread's CPU


def requested() -> bool:
    """``ZERO_OFFLOAD_PIN_THREADS`` as a boolean (:func:`~zero_offload.host_memory.env_flag`; unset: off); a typo
    is a ``ValueError`` naming it, at construction and at the first native call."""
    return env_flag(ENV, False, "bind the CPU kernel's threads, one per physical core",
                    "leave them where the OS puts them")


def _core_of(cpu: int) -> Tuple[int, int]:
    """(package, core) of a logical CPU, from sysfs; a CPU of its own where sysfs does not say."""
    topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text())
    except (OSError, ValueError):
        return -1, cpu


def kernel_cpus(allowed: Optional[List[int]] = None,
                core_of: Callable[[int], Tuple[int, int]] = _core_of) -> List[int]:
    """The CPUs the kernel's team threads 1, 2, ... are bound to, in that order: one logical CPU of each physical
    core but the first, then those cores' SMT siblings, then the first core's CPUs (left to the calling thread while
    the team fits elsewhere).

    Args:
        allowed (List[int], optional): the logical CPUs this process may run on. Default: its affinity mask.
        core_of (callable): a CPU's (package, core) (default: read from sysfs).
    """
    cpus = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    cores: Dict[Tuple[int, int], List[int]] = {}
    for cpu in cpus:
        cores.setdefault(core_of(cpu), []).append(cpu)
    groups = list(cores.values())
    if len(groups) < 2:
        return cpus
    first, rest = groups[0], groups[1:]
    by_depth = [g[k] for k in range(max(len(g) for g in rest)) for g in rest if k < len(g)]
    return by_depth + first


def ensure(native: object) -> Optional[List[int]]:
    """Bind the calling thread's kernel team if :func:`requested` and not yet bound for this team size; returns each
    team thread's CPU (-1: the caller) when bound, else None."""
    if not requested():
        return None
    key = (threading.get_ident(), torch.get_num_threads())
    bound = _bound.get(key)
    if bound is None:
        with _lock:
            bound = _bound.get(key)
            if bound is None:
                bound = _bound[key] = list(native.pin_team(kernel_cpus()))  # type: ignore[attr-defined]
    return bound


def status() -> str:
    """One line for the report: whether the kernel's threads are bound, and where."""
    try:
        on = requested()
    except ValueError as exc:
        return str(exc)
    if not on:
        return f"left to the OS ({ENV}=1 binds them, one per physical core)"
    mine = _bound.get((threading.get_ident(), torch.get_num_threads()))
    if mine:
        return f"bound ({ENV}=1): team threads on CPUs {mine[1:]}, the calling thread left to the OS"
    cpus = kernel_cpus()[: torch.get_num_threads() - 1]
    return f"bound at the first native update ({ENV}=1): team threads to CPUs {cpus}, the calling thread left to the OS"

"""Where the CPU kernel's threads run: with ``ZERO_OFFLOAD_PIN_THREADS=1`` in the environment, the threads of the
intra-op team that runs the native kernel (torch's, ``torch.get_num_threads()`` of them) are bound one to a CPU,
one per physical core first, away from the first core of the process's share (kept for the thread that calls the
kernel, the one that drives the GPU, which stays where the OS puts it). Unbound, the OS may move a kernel thread
mid-pass, stack two on the SMT siblings of one core, or on the core the driving thread needs to launch the GPU's
work (DeepSpeed binds its CPU-Adam threads to cores and reports 15% from it).

The share is the process's whole affinity mask when it has the node to itself. With several ranks on a node
(``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, as torchrun and accelerate set them) it is this local rank's contiguous
run of whole cores, within one package where the count allows, unless a launcher already gave the rank CPUs of its
own (kept as they are): :mod:`zero_offload.node_cpus` has the rule. A malformed ``LOCAL_*`` value is a
``ValueError`` naming it, at construction, as a bad ``ZERO_OFFLOAD_PIN_THREADS`` is; neither is read with pinning
off.

The team's size is not changed here: it is torch's, process-wide, set by the user or the launcher (torchrun sets
``OMP_NUM_THREADS=1`` for each of several ranks unless it is set, which leaves the kernel the calling thread alone
and nothing to bind). A team with more threads than its share has CPUs is still bound within the share, several
threads to a CPU, and said once with the numbers and the ``torch.set_num_threads`` call that gives one thread per
core; ``python -m zero_offload.report`` shows the share.

Off by default until a GPU lease measures it (``benchmarks/gpu_suite.py`` runs the host step with it on and off).
Binding is done once per calling thread and team size, the first time that thread runs a native update, by the team
threads themselves (:func:`ensure`). It binds only the team's helper threads, never the caller: torch reuses the same
team for the intra-op work the calling thread starts, so torch's own CPU ops from that thread run on those CPUs too.
For every OpenMP team of the process instead, start it with ``OMP_PROC_BIND=close OMP_PLACES=cores``.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload import node_cpus
from zero_offload.host_memory import env_flag
from zero_offload.node_cpus import CoreOf, Share

__all__ = ["ENV", "check", "ensure", "kernel_cpus", "requested", "share", "status"]

ENV = "ZERO_OFFLOAD_PIN_THREADS"

logger = logging.getLogger("zero_offload")

_lock = threading.Lock()
_bound: Dict[Tuple[int, int], List[int]] = {}  # (calling thread, team size) -> each team thread's CPU


def requested() -> bool:
    """``ZERO_OFFLOAD_PIN_THREADS`` as a boolean (:func:`~zero_offload.host_memory.env_flag`; unset: off); a typo
    is a ``ValueError`` naming it, at construction and at the first native call."""
    return env_flag(ENV, False, "bind the CPU kernel's threads, one per physical core",
                    "leave them where the OS puts them")


def check() -> None:
    """Read what binding will read (at construction): a bad ``ZERO_OFFLOAD_PIN_THREADS``, and with it on, a bad
    ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, is a ``ValueError`` naming it."""
    if requested():
        node_cpus.local_ranks()


def _machine() -> Tuple[List[int], List[int], CoreOf]:
    """This process's affinity mask, the CPUs the node's ranks share, and the topology (sysfs)."""
    return sorted(os.sched_getaffinity(0)), node_cpus.node_set(), node_cpus.core_of


def share(allowed: Optional[Sequence[int]] = None, core_of: Optional[CoreOf] = None,
          local: Optional[Tuple[int, int]] = None, shared: Optional[Sequence[int]] = None) -> Share:
    """The CPUs this process binds its kernel team within (:func:`zero_offload.node_cpus.share`).

    Args:
        allowed (List[int], optional): the logical CPUs this process may run on. Default: its affinity mask.
        core_of (callable, optional): a CPU's (package, core). Default: read from sysfs.
        local (Tuple[int, int], optional): (local rank, local ranks). Default: ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``.
        shared (List[int], optional): the CPUs the node's ranks share. Default: this process's cpuset cgroup's (the
            CPUs online where it does not say) when ``allowed`` is the mask read here, else ``allowed``.
    """
    allowed, core_of, shared = _inputs(allowed, core_of, shared)
    return node_cpus.share(allowed, core_of, local, shared)


def _inputs(allowed: Optional[Sequence[int]], core_of: Optional[CoreOf], shared: Optional[Sequence[int]]
            ) -> Tuple[Sequence[int], CoreOf, Optional[Sequence[int]]]:
    """:func:`share`'s arguments with their defaults filled in."""
    if allowed is None:
        allowed, node, sysfs = _machine()
        return allowed, core_of or sysfs, node if shared is None else shared
    return allowed, core_of or node_cpus.core_of, shared


def _team_order(mine: Share, core_of: CoreOf) -> List[int]:
    groups = node_cpus.whole_cores(mine.cpus, core_of)
    if len(groups) < 2:
        return list(mine.cpus)
    first, rest = groups[0], groups[1:]
    by_depth = [g[k] for k in range(max(len(g) for g in rest)) for g in rest if k < len(g)]
    return by_depth + first


def kernel_cpus(allowed: Optional[Sequence[int]] = None, core_of: Optional[CoreOf] = None,
                local: Optional[Tuple[int, int]] = None, shared: Optional[Sequence[int]] = None) -> List[int]:
    """The CPUs the kernel's team threads 1, 2, ... are bound to, in that order, all within this process's
    :func:`share`: one logical CPU of each of its physical cores but the first, then those cores' SMT siblings, then
    the first core's CPUs (left to the calling thread while the team fits elsewhere).

    Args: as :func:`share`'s.
    """
    allowed, core_of, shared = _inputs(allowed, core_of, shared)
    return _team_order(node_cpus.share(allowed, core_of, local, shared), core_of)


def _too_small(mine: Share, team: int, core_of: CoreOf) -> Optional[str]:
    """What to say where the team has more threads than its share has CPUs; None where it fits."""
    if team <= len(mine.cpus):
        return None
    cores = len(node_cpus.whole_cores(mine.cpus, core_of))
    return (f"zero_offload: the CPU kernel's team has {team} threads (torch.get_num_threads()) but {mine.describe()} "
            f"has {len(mine.cpus)} CPU(s) on {cores} core(s): its threads are bound within them, several to a CPU; "
            f"torch.set_num_threads({cores}) gives one thread per core ({ENV}=1)")


def ensure(native: object) -> Optional[List[int]]:
    """Bind the calling thread's kernel team if :func:`requested` and not yet bound for this team size, within this
    process's :func:`share` (said once where the team has more threads than the share has CPUs); returns each team
    thread's CPU (-1: the caller) when bound, else None."""
    if not requested():
        return None
    team = torch.get_num_threads()
    key = (threading.get_ident(), team)
    bound = _bound.get(key)
    if bound is None:
        with _lock:
            bound = _bound.get(key)
            if bound is None:
                allowed, core_of, node = _inputs(None, None, None)
                mine = node_cpus.share(allowed, core_of, None, node)
                message = _too_small(mine, team, core_of)
                if message:
                    node_cpus.say_once(message)
                bound = _bound[key] = list(native.pin_team(_team_order(mine, core_of)))  # type: ignore[attr-defined]
                if mine.ranks > 1:
                    logger.info("zero_offload: the CPU kernel's team of %d bound within %s", team, mine.describe())
    return bound


def status() -> str:
    """One line for the report: whether the kernel's threads are bound, and where."""
    try:
        on = requested()
        mine = share() if on else None
    except ValueError as exc:
        return str(exc)
    if mine is None:
        return f"left to the OS ({ENV}=1 binds them, one per physical core)"
    within = f"within {mine.describe()}"
    bound = _bound.get((threading.get_ident(), torch.get_num_threads()))
    if bound:
        return f"bound ({ENV}=1) {within}: team threads on CPUs {bound[1:]}, the calling thread left to the OS"
    cpus = kernel_cpus()[: torch.get_num_threads() - 1]
    return (f"bound at the first native update ({ENV}=1) {within}: team threads to CPUs {cpus}, the calling thread "
            "left to the OS")

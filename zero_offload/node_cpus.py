"""Which CPUs of the node are this process's to bind the CPU kernel's threads to (:mod:`zero_offload.affinity` binds
them): its whole affinity mask when it has the node to itself, a contiguous share of the node's physical cores when
several ranks run on it.

Under torchrun (or accelerate, or DeepSpeed's launcher) every local rank usually starts with the same mask, the
whole node's. Each one binding its team from its mask as if it were alone would put every rank's threads on the
same first cores and leave the rest idle. So when ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` say that ``L`` ranks
share the node (DeepSpeed's launcher sets ``LOCAL_SIZE`` instead: read where ``LOCAL_WORLD_SIZE`` is unset), local
rank ``r`` takes share ``r`` of ``L`` contiguous runs of whole cores, their sizes at most one core apart. A run
stays within one package (socket) where the count allows it (the ranks spread over the packages in proportion to
their cores, e.g. 8 ranks on 2 x 8 cores: 4 per package, 2 cores each); otherwise the cores are split evenly in
package order and a run may straddle two packages. With more ranks than cores, each rank gets one core, and the
ranks spread evenly over them (said once: they share cores).

A launcher that already split the node is respected: a mask narrower than the CPUs the process's cgroup may use
(its cpuset; the CPUs online where the cgroup does not say) and no larger than one rank's share of them (in whole
cores, rounded up) is one a launcher gave this rank alone (torchrun ``--numa-binding=exclusive``, ``srun
--cpu-bind=cores``, ``numactl``/``taskset`` per rank, a script's own ``os.sched_setaffinity``): it is kept whole.
A narrowed mask larger than that cannot be one of ``L`` disjoint shares (``numactl`` around torchrun, one NUMA
node's CPUs given to several ranks): it is taken as shared by all ``L`` ranks and split like the whole node, which
keeps ranks off each other's cores (where ranks share a mask or have disjoint ones) at the cost of idle cores
where fewer than ``L`` ranks share it: give each rank its own CPUs to use them all.

Other launchers' variables (``SLURM_LOCALID``, ``OMPI_COMM_WORLD_LOCAL_RANK``) are not read: srun and mpirun bind
each task to its own CPUs by default, and a per-node task count there takes parsing (``SLURM_TASKS_PER_NODE`` is
``2(x3),1``); export ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` from them to have the node split here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

__all__ = ["RANK_ENV", "SIZE_ENV", "DEEPSPEED_SIZE_ENV", "Share", "local_ranks", "node_set", "core_of", "say_once",
           "whole_cores", "split", "share"]

logger = logging.getLogger("zero_offload")

RANK_ENV, SIZE_ENV, DEEPSPEED_SIZE_ENV = "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"
CoreOf = Callable[[int], Tuple[int, int]]

_said: Set[str] = set()


def say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.warning("%s", message)


@dataclasses.dataclass(frozen=True)
class Share:
    """The CPUs this process binds its kernel team within.

    Args:
        cpus (List[int]): the logical CPUs, whole cores, in package-major core order (the first core first).
        rank (int): this process's local rank (0 when alone).
        ranks (int): the local ranks sharing the node (1 when alone).
        how (str): ``"alone"`` (the whole mask), ``"split"`` (share ``rank`` of ``ranks`` of the mask) or
            ``"kept"`` (a mask a launcher narrowed for this rank, kept whole).
    """

    cpus: List[int]
    rank: int = 0
    ranks: int = 1
    how: str = "alone"

    def describe(self) -> str:
        where = f"(CPUs {_ranges(self.cpus)})"
        if self.how == "split":
            return f"local rank {self.rank} of {self.ranks}'s share of the node {where}"
        if self.how == "kept":
            return f"local rank {self.rank} of {self.ranks}'s mask as its launcher set it {where}"
        return f"this process's affinity mask {where}"


def _int_env(name: str) -> Optional[int]:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return None
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"Invalid {name}={text!r}: expected a whole number (the launcher's local rank or local "
                         f"rank count), read to split this node's cores among its ranks (ZERO_OFFLOAD_PIN_THREADS=1)"
                         ) from None


def local_ranks() -> Optional[Tuple[int, int]]:
    """(local rank, local ranks) from ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (else ``LOCAL_SIZE``, DeepSpeed's
    launcher's); None where they are unset or empty. A value that is not a whole number, a count under 1 or a rank
    outside ``[0, count)`` is a ``ValueError`` naming the variable. Only one of them set: said once, and None (the
    process is taken to have the node to itself)."""
    rank = _int_env(RANK_ENV)
    size_name = SIZE_ENV if os.environ.get(SIZE_ENV, "").strip() else DEEPSPEED_SIZE_ENV
    size = _int_env(size_name)
    if size is not None and size < 1:
        raise ValueError(f"Invalid {size_name}={os.environ[size_name]!r}: the number of ranks on this node is at "
                         "least 1")
    if rank is None or size is None:
        if rank is not None or size is not None:
            have, missing = (RANK_ENV, SIZE_ENV) if rank is not None else (size_name, RANK_ENV)
            say_once(f"zero_offload: {have} is set but {missing} is not: the CPU kernel's threads are bound as if "
                      "this process had the node to itself (ZERO_OFFLOAD_PIN_THREADS=1); set both to split the "
                      "node's cores among its ranks")
        return None
    if not 0 <= rank < size:
        raise ValueError(f"Invalid {RANK_ENV}={os.environ[RANK_ENV]!r}: with {size_name}={size} a local rank is in "
                         f"[0, {size})")
    return rank, size


def _parse_list(text: str) -> List[int]:
    """A kernel CPU list ("0-3,8-11") as CPUs; a malformed one is a ``ValueError``."""
    out: List[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _ranges(cpus: Sequence[int]) -> str:
    """CPUs as a kernel CPU list ("0-3,8-11")."""
    parts: List[str] = []
    run: List[int] = []
    for cpu in sorted(cpus):
        if run and cpu != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(cpu)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts) or "none"


def _read_cpus(path: Path) -> Optional[List[int]]:
    try:
        cpus = _parse_list(path.read_text())
    except (OSError, ValueError):
        return None
    return cpus or None


def _cgroup_cpus(proc: Path = Path("/proc/self/cgroup"), mount: Path = Path("/sys/fs/cgroup")) -> Optional[List[int]]:
    """The CPUs of this process's cpuset cgroup (v1's ``cpuset`` hierarchy, else v2's, the closest cgroup up its
    path that has the file); None where none says."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    tries: List[Tuple[Path, str, str]] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "cpuset" in controllers.split(","):
            tries.insert(0, (mount / "cpuset", path, "cpuset.effective_cpus"))
        elif hierarchy == "0" and not controllers:
            tries += [(mount, path, "cpuset.cpus.effective"), (mount / "unified", path, "cpuset.cpus.effective")]
    for root, path, name in tries:
        here = root / path.lstrip("/")
        while True:
            cpus = _read_cpus(here / name)
            if cpus is not None:
                return cpus
            if here == root or root not in here.parents:
                break
            here = here.parent
    return None


def node_set() -> List[int]:
    """The CPUs the node's ranks share: this process's cpuset cgroup's, else the CPUs online, else all."""
    return (_cgroup_cpus() or _read_cpus(Path("/sys/devices/system/cpu/online"))
            or list(range(os.cpu_count() or 1)))


def core_of(cpu: int) -> Tuple[int, int]:
    """(package, core) of a logical CPU, from sysfs; a CPU of its own where sysfs does not say."""
    topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text())
    except (OSError, ValueError):
        return -1, cpu


def whole_cores(cpus: Sequence[int], core_of: CoreOf = core_of) -> List[List[int]]:
    """The physical cores of ``cpus``, each as its logical CPUs (ascending), in package-major order (a package's
    cores by their first CPU)."""
    cores: Dict[Tuple[int, int], List[int]] = {}
    for cpu in sorted(set(cpus)):
        cores.setdefault(core_of(cpu), []).append(cpu)
    return [cpus for _, cpus in sorted(cores.items(), key=lambda kv: (kv[0][0], kv[1][0]))]


def _even(items: List[List[int]], n: int) -> List[List[List[int]]]:
    return [items[i * len(items) // n:(i + 1) * len(items) // n] for i in range(n)]


def split(cores: List[List[int]], n: int, core_of: CoreOf = core_of) -> List[List[List[int]]]:
    """``n`` contiguous runs of ``cores`` (package-major, as :func:`whole_cores` gives them), their sizes at most
    one core apart, none crossing a package where that holds; with fewer cores than ``n``, one core each, spread
    evenly (several runs on a core)."""
    if len(cores) < n:
        return [[cores[r * len(cores) // n]] for r in range(n)]
    packages: List[List[List[int]]] = []
    for core in cores:
        if packages and core_of(packages[-1][0][0])[0] == core_of(core[0])[0]:
            packages[-1].append(core)
        else:
            packages.append([core])
    # Ranks per package in proportion to its cores (largest remainder; a tie goes to the earlier package).
    quotas = [len(p) * n / len(cores) for p in packages]
    counts = [int(q) for q in quotas]
    for i in sorted(range(len(packages)), key=lambda i: (counts[i] - quotas[i], i))[: n - sum(counts)]:
        counts[i] += 1
    runs = [run for p, k in zip(packages, counts) if k for run in _even(p, k)]
    lo, hi = len(cores) // n, -(-len(cores) // n)
    if sum(map(len, runs)) == len(cores) and all(lo <= len(r) <= hi for r in runs):
        return runs
    return _even(cores, n)


def share(allowed: Sequence[int], core_of: CoreOf = core_of, local: Optional[Tuple[int, int]] = None,
          shared: Optional[Sequence[int]] = None) -> Share:
    """This process's share of the node (see the module's docstring for the rule).

    Args:
        allowed (Sequence[int]): the logical CPUs this process may run on (its affinity mask).
        core_of (callable): a CPU's (package, core). Default: read from sysfs.
        local (Tuple[int, int], optional): (local rank, local ranks). Default: :func:`local_ranks`.
        shared (Sequence[int], optional): the CPUs the node's ranks share. Default: ``allowed`` (a mask no launcher
            narrowed).
    """
    cpus = sorted(set(allowed))
    rank, ranks = local if local is not None else (local_ranks() or (0, 1))
    if ranks <= 1:
        return Share([c for core in whole_cores(cpus, core_of) for c in core])
    node = set(cpus if shared is None else shared)
    cores = whole_cores(cpus, core_of)
    if set(cpus) < node and len(cores) <= -(-len(whole_cores(sorted(node), core_of)) // ranks):
        return Share([c for core in cores for c in core], rank, ranks, "kept")
    if len(cores) < ranks:
        say_once(f"zero_offload: {ranks} local ranks share {len(cores)} physical core(s) ({_ranges(cpus)}): the "
                  "CPU kernel's threads of several ranks are bound to one core (ZERO_OFFLOAD_PIN_THREADS=1)")
    return Share([c for core in split(cores, ranks, core_of)[rank] for c in core], rank, ranks, "split")

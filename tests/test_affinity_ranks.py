"""ZERO_OFFLOAD_PIN_THREADS with several ranks on a node: each local rank binds its kernel team within its own
contiguous share of whole cores (disjoint, covering the node, within a package where the count allows, the share's
first core kept for the driving thread), a launcher's own split is kept, a team larger than its share is said once,
and malformed LOCAL_* values are refused naming the variable. Synthetic topologies, checked against the arithmetic
of the machine they describe; one real binding, read back from /proc."""

import ast
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero_offload import OffloadOptimizer, affinity

from test_affinity import _CHILD, _cpus  # (the child binds its team, checks the update, prints each thread's CPUs)

ROOT = Path(__file__).resolve().parents[1]


def _machine(packages, cores, smt, interleaved=False):
    """{cpu: (package, core)} numbered as Linux numbers x86 CPUs: every core's first thread before any sibling;
    packages' cores in blocks, or interleaved (package p's core c is CPU c * packages + p)."""
    out = {}
    for t in range(smt):
        for p in range(packages):
            for c in range(cores):
                first = c * packages + p if interleaved else p * cores + c
                out[t * packages * cores + first] = (p, c)
    return out


def _topology(machine):
    return lambda cpu: machine[cpu]


def _rank_cpus(monkeypatch, machine, ranks, allowed=None):
    """Each local rank's kernel_cpus (all of its share's CPUs, in binding order), LOCAL_RANK/LOCAL_WORLD_SIZE set as
    torchrun sets them, every rank with the same mask (the whole machine unless ``allowed``)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    out = []
    for r in range(ranks):
        monkeypatch.setenv("LOCAL_RANK", str(r))
        out.append(affinity.kernel_cpus(sorted(allowed or machine), _topology(machine)))
    return out


def _assert_partition(machine, cpu_lists, cpus=None):
    """Disjoint, covering ``cpus`` (default: the machine), of whole cores, the core counts at most one apart."""
    cpus = set(machine if cpus is None else cpus)
    shares = [set(c) for c in cpu_lists]
    assert all(len(c) == len(s) for c, s in zip(cpu_lists, shares)), "a CPU listed twice"
    assert sum(map(len, shares)) == len(set().union(*shares)), f"shares overlap: {cpu_lists}"
    assert set().union(*shares) == cpus
    for s in shares:
        assert s == {c for c in cpus if machine[c] in {machine[x] for x in s}}, f"a core split between shares: {s}"
    counts = [len({machine[c] for c in s}) for s in shares]
    assert max(counts) - min(counts) <= 1, counts


def _first_core_last(machine, cpus):
    """One CPU of each other core first, and the share's first core (lowest package, then lowest CPU), the driving
    thread's, at the end of the list."""
    first = machine[min(cpus, key=lambda c: (machine[c][0], c))]
    n_first, n_cores = sum(machine[c] == first for c in cpus), len({machine[c] for c in cpus})
    lead = [machine[c] for c in cpus[: n_cores - 1]]
    return all(machine[c] == first for c in cpus[-n_first:]) and first not in lead and len(set(lead)) == len(lead)


@pytest.mark.parametrize("interleaved", [False, True], ids=["blocks", "interleaved"])
def test_eight_ranks_on_two_packages_take_two_whole_cores_each_within_one_package(monkeypatch, interleaved):
    machine = _machine(2, 8, 2, interleaved)
    lists = _rank_cpus(monkeypatch, machine, 8)
    _assert_partition(machine, lists)
    for r, cpus in enumerate(lists):
        # Ranks 0-3 on package 0, 4-7 on package 1, in core order: rank r has its package's cores 2(r % 4), +1.
        assert sorted({machine[c] for c in cpus}) == [(r // 4, 2 * (r % 4)), (r // 4, 2 * (r % 4) + 1)]
        assert _first_core_last(machine, cpus), cpus
        # One thread per core first: the second core's two CPUs, then the first core's (the driving thread's).
        assert [machine[c] for c in cpus] == [(r // 4, 2 * (r % 4) + 1)] * 2 + [(r // 4, 2 * (r % 4))] * 2
    if not interleaved:
        assert lists[3] == [7, 23, 6, 22]


def test_three_ranks_on_four_cores(monkeypatch):
    machine = _machine(1, 4, 1)
    lists = _rank_cpus(monkeypatch, machine, 3)
    _assert_partition(machine, lists)
    assert sorted(map(len, lists)) == [1, 1, 2]
    for cpus in lists:
        assert cpus[-1] == min(cpus)  # the share's first core last: kept for the driving thread


@pytest.mark.parametrize("ranks, sizes, within_a_package", [
    (3, [5, 5, 6], False),  # 16 cores in 3: balanced, so one share straddles the packages
    (5, [3, 3, 3, 3, 4], False),
    (6, [2, 3, 3, 2, 3, 3], True),  # 3 ranks a package: 2, 3, 3 cores each, none straddling
    (4, [4, 4, 4, 4], True),
    (2, [8, 8], True),
])
def test_an_uneven_division_is_balanced_and_within_a_package_where_it_can_be(monkeypatch, ranks, sizes,
                                                                             within_a_package):
    machine = _machine(2, 8, 2)
    lists = _rank_cpus(monkeypatch, machine, ranks)
    _assert_partition(machine, lists)
    assert [len({machine[c] for c in cpus}) for cpus in lists] == sizes
    packages = [len({machine[c][0] for c in cpus}) for cpus in lists]
    assert all(n == 1 for n in packages) == within_a_package, packages
    for cpus in lists:
        assert _first_core_last(machine, cpus), cpus


def test_more_ranks_than_cores_share_cores_evenly_and_say_so(monkeypatch, caplog):
    from zero_offload import node_cpus
    monkeypatch.setattr(node_cpus, "_said", set())
    machine = _machine(1, 2, 2)  # CPUs 0, 1 and their siblings 2, 3
    with caplog.at_level(logging.WARNING, logger="zero_offload"):
        lists = _rank_cpus(monkeypatch, machine, 4)
    assert [sorted(c) for c in lists] == [[0, 2], [0, 2], [1, 3], [1, 3]]
    said = [r.getMessage() for r in caplog.records if "share 2 physical core" in r.getMessage()]
    assert len(said) == 1 and "4 local ranks" in said[0], caplog.text


def test_a_mask_a_launcher_gave_this_rank_is_kept_whole():
    machine = _machine(2, 8, 2)
    topo = _topology(machine)
    # torchrun --numa-binding=exclusive / srun --cpu-bind: rank 3 of 8 was given cores 6 and 7 of package 0.
    assert affinity.kernel_cpus([6, 7, 22, 23], topo, local=(3, 8), shared=list(machine)) == [7, 23, 6, 22]
    # A launcher's uneven split (16 cores in 3): the 6-core share of rank 0 is one rank's share, kept.
    flat = _machine(1, 16, 1)
    assert sorted(affinity.kernel_cpus(range(6), _topology(flat), local=(0, 3), shared=list(flat))) == list(range(6))


def test_a_mask_too_large_for_one_rank_is_split_among_the_ranks(monkeypatch):
    # numactl --cpunodebind=0 around torchrun: all 4 ranks have package 0 (16 of the node's 32 CPUs), which cannot
    # be one of 4 disjoint shares, so they split it.
    machine = _machine(2, 8, 2)
    package0 = [c for c in machine if machine[c][0] == 0]
    lists = [affinity.kernel_cpus(package0, _topology(machine), local=(r, 4), shared=list(machine))
             for r in range(4)]
    _assert_partition(machine, lists, package0)
    assert [len(c) for c in lists] == [4, 4, 4, 4]


def test_one_rank_or_no_local_ranks_binds_the_whole_mask_as_before(monkeypatch):
    machine = _machine(2, 2, 2)
    expected = [1, 2, 3, 5, 6, 7, 0, 4]
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert affinity.kernel_cpus(list(machine), _topology(machine)) == expected
    assert affinity.kernel_cpus(list(machine), _topology(machine), local=(0, 1), shared=range(64)) == expected


def test_deepspeeds_local_size_is_read_where_local_world_size_is_unset(monkeypatch):
    machine = _machine(1, 4, 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert affinity.kernel_cpus(list(machine), _topology(machine)) == [2]


def test_a_local_rank_without_a_count_is_said_and_binds_the_whole_mask(monkeypatch, caplog):
    from zero_offload import node_cpus
    monkeypatch.setattr(node_cpus, "_said", set())
    machine = _machine(1, 4, 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with caplog.at_level(logging.WARNING, logger="zero_offload"):
        assert affinity.kernel_cpus(list(machine), _topology(machine)) == [1, 2, 3, 0]
    assert "LOCAL_RANK is set but LOCAL_WORLD_SIZE is not" in caplog.text


@pytest.mark.parametrize("env, named", [
    ({"LOCAL_RANK": "one", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_RANK='one'"),
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8x"}, "LOCAL_WORLD_SIZE='8x'"),
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0'"),
    ({"LOCAL_RANK": "8", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_RANK='8'"),
    ({"LOCAL_RANK": "-1", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_RANK='-1'"),
    ({"LOCAL_RANK": "1", "LOCAL_SIZE": "1"}, "LOCAL_RANK='1'"),
])
def test_a_malformed_local_value_is_refused_naming_it_only_when_pinning(monkeypatch, env, named):
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    p = torch.nn.Parameter(torch.ones(7))
    monkeypatch.setenv(affinity.ENV, "0")
    OffloadOptimizer([p], lr=1e-3)  # not read with pinning off: the launcher's business
    monkeypatch.setenv(affinity.ENV, "1")
    with pytest.raises(ValueError, match=f"Invalid {named}"):
        affinity.check()
    with pytest.raises(ValueError, match=f"Invalid {named}"):
        OffloadOptimizer([p], lr=1e-3)
    assert named in affinity.status()


def test_a_team_larger_than_its_share_is_bound_within_it_and_said_once(monkeypatch, caplog):
    from zero_offload import node_cpus
    machine = _machine(2, 8, 2)
    monkeypatch.setattr(affinity, "_machine", lambda: (sorted(machine), sorted(machine), _topology(machine)))
    monkeypatch.setattr(affinity, "_bound", {})
    monkeypatch.setattr(node_cpus, "_said", set())
    monkeypatch.setenv(affinity.ENV, "1")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    given = []

    class Native:
        def pin_team(self, cpus):
            given.append(list(cpus))
            return [-1] + [cpus[(t - 1) % len(cpus)] for t in range(1, torch.get_num_threads())]

    threads = torch.get_num_threads()
    try:
        with caplog.at_level(logging.WARNING, logger="zero_offload"):
            torch.set_num_threads(4)  # fits rank 3's 4 CPUs: nothing said
            assert affinity.ensure(Native()) == [-1, 7, 23, 6]
            assert "CPU kernel's team" not in caplog.text
            torch.set_num_threads(6)
            assert affinity.ensure(Native()) == [-1, 7, 23, 6, 22, 7]
            monkeypatch.setattr(affinity, "_bound", {})
            affinity.ensure(Native())
    finally:
        torch.set_num_threads(threads)
    assert given == [[7, 23, 6, 22]] * 3  # rank 3's share, never another rank's CPUs
    said = [r.getMessage() for r in caplog.records if "CPU kernel's team" in r.getMessage()]
    assert len(said) == 1, said
    assert "6 threads" in said[0] and "4 CPU(s) on 2 core(s)" in said[0] and "torch.set_num_threads(2)" in said[0]
    assert "local rank 3 of 8" in said[0]


def _online():
    try:
        return _cpus(Path("/sys/devices/system/cpu/online").read_text())
    except OSError:
        return set()


def _physical_cores(cpus):
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text(), (topo / "core_id").read_text()))
        except OSError:
            cores.add(cpu)
    return len(cores)


@pytest.mark.skipif(not sys.platform.startswith("linux") or _physical_cores(os.sched_getaffinity(0)) < 2
                    or set(os.sched_getaffinity(0)) != _online(),
                    reason="needs Linux and this process's mask to be the whole machine, of two cores or more")
def test_two_local_ranks_bind_their_helper_threads_to_different_cpus():
    env = {**os.environ, affinity.ENV: "1", "PYTHONPATH": str(ROOT), "LOCAL_WORLD_SIZE": "2"}
    env.pop("LOCAL_SIZE", None)
    helpers = []
    for rank in (0, 1):
        out = subprocess.run([sys.executable, "-c", _CHILD], env={**env, "LOCAL_RANK": str(rank)},
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        if out.stdout.startswith("SKIP"):
            pytest.skip(out.stdout.strip())
        lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
        assert _cpus(lines["MAIN"]) == os.sched_getaffinity(0)  # the calling thread is left as it was
        single = [_cpus(t) for t in ast.literal_eval(lines["TASKS"]) if len(_cpus(t)) == 1]
        assert len(single) == 1, lines["TASKS"]  # the team's second thread, bound
        helpers.append(single[0])
    # Unsplit, both ranks bound their helper to the same CPU (the machine's second core).
    assert helpers[0] != helpers[1], helpers


def test_the_shared_cpus_are_the_cgroups_closest_cpuset(tmp_path):
    from zero_offload import node_cpus
    proc = tmp_path / "cgroup"
    mount = tmp_path / "fs"
    # cgroup v2: the process's own cgroup has no cpuset file (the controller is not enabled there): its parent's.
    (mount / "job" / "step").mkdir(parents=True)
    (mount / "job" / "cpuset.cpus.effective").write_text("0-3,8-11\n")
    (mount / "cpuset.cpus.effective").write_text("0-15\n")
    proc.write_text("0::/job/step\n")
    assert node_cpus._cgroup_cpus(proc, mount) == [0, 1, 2, 3, 8, 9, 10, 11]
    # v1 (or hybrid): the cpuset hierarchy's, before v2's.
    (mount / "cpuset" / "slurm").mkdir(parents=True)
    (mount / "cpuset" / "slurm" / "cpuset.effective_cpus").write_text("4-5")
    proc.write_text("4:memory:/x\n3:cpuset:/slurm\n0::/job/step\n")
    assert node_cpus._cgroup_cpus(proc, mount) == [4, 5]
    # Nothing says (no cpuset anywhere up the path): None, and the CPUs online decide.
    proc.write_text("0::/elsewhere\n")
    assert node_cpus._cgroup_cpus(proc, tmp_path / "none") is None

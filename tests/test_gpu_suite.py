"""The GPU runbook's plumbing, on the CPU: its plan names what train_step.py can run and fits the time a lent
machine gives; a tiny run writes a report whose table comes from what train_step.py measured."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "benchmarks" / "gpu_suite.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_suite  # noqa: E402
import train_step  # noqa: E402


def test_plan_matches_train_step_and_fits_one_lease():
    known = [c.key for c in train_step.CONTENDERS]
    # A renamed contender would silently drop a row from the GPU matrix.
    assert set(gpu_suite.MATRIX) <= set(known)
    assert set(gpu_suite.CAPPED_MATRIX) <= set(known)
    assert set(gpu_suite.TINY_MATRIX) <= set(known)
    stages = gpu_suite.plan(False, known)
    # A lease: 15 minutes of device time with the start (1-2 min), at most 10 a command.
    by_command = {c: sum(s.timeout_s for s in stages if s.command == c) for c in ("1", "2")}
    assert by_command["1"] <= 8 * 60 and by_command["2"] <= 4 * 60, by_command
    assert set(by_command) == {s.command for s in stages}
    steps = {s.name: s for s in stages}
    assert [s.name for s in stages if s.command == "1"] == ["build", "machine", "steps-capped", "steps-capped-clip",
                                                            "steps", "threads-unpinned", "threads-pinned"]
    assert steps["steps"].argv[steps["steps"].argv.index("--preset") + 1] == "1.3b"
    only = steps["steps"].argv[steps["steps"].argv.index("--only") + 1].split(",")
    assert {"adamw", "ours", "ours-parked", "ours-auto", "ours-gpuauto", "ours-delayed"} <= set(only)
    # Issue 52's rows: AdamW and the all-host placement uncapped, then parked, 'auto' and torchao capped at the
    # all-host peak plus 1 GiB, without and with clipping.
    for name in ("steps-capped", "steps-capped-clip"):
        argv = steps[name].argv
        assert argv[argv.index("--only") + 1].split(",") == ["adamw", "ours-host", "ours-parked", "ours-auto",
                                                            "torchao"]
        assert argv[argv.index("--cap-after") + 1] == "ours-host+1"
    assert steps["steps-capped-clip"].argv[-2:] == ["--clip", "1.0"]
    assert steps["find-max-cap12"].argv[steps["find-max-cap12"].argv.index("--gpu-cap-gib") + 1] == "12"
    # Issue 52's lease rows: ours under FSDP2's CPUOffloadPolicy at world 1 in find-max (a contender train_step.py
    # has); the FSDP2 stage at world 1, with placement='auto' beside fused AdamW on the GPU; the all-host row twice,
    # the kernel's threads unpinned then pinned, the runs alike but for the child's environment.
    find_max = steps["find-max-cap12"].argv
    assert "ours-fsdp2-offload" in find_max[find_max.index("--only") + 1].split(",")
    assert find_max[find_max.index("--only") + 1].split(",")[0] == "adamw"
    fsdp = steps["fsdp2"].argv
    assert fsdp[fsdp.index("--world") + 1] == "1"
    import fsdp2_step

    assert fsdp2_step.GPU_ROWS["ours-auto"][0] == "gpu" and "gpu-adamw-fused" in fsdp2_step.GPU_ROWS
    unpinned, pinned = steps["threads-unpinned"], steps["threads-pinned"]
    assert unpinned.argv == pinned.argv and unpinned.argv[unpinned.argv.index("--only") + 1] == "ours-host"
    assert (unpinned.env, pinned.env) == ({"ZERO_OFFLOAD_PIN_THREADS": "0"}, {"ZERO_OFFLOAD_PIN_THREADS": "1"})
    assert "-m" in steps["cuda-tests"].argv and "cuda" in steps["cuda-tests"].argv
    rows = gpu_suite.plan(False, known, ["adamw", "ours"])
    assert {s.name: s for s in rows}["steps"].argv[-1] == "adamw,ours"


def test_a_stage_runs_with_its_environment(tmp_path, monkeypatch):
    """A stage's ``env`` reaches its child, beside this process's environment (which it overrides)."""
    monkeypatch.setenv("ZERO_OFFLOAD_PIN_THREADS", "0")
    monkeypatch.setenv("GPU_SUITE_KEPT", "yes")
    show = "import os; print(os.environ['ZERO_OFFLOAD_PIN_THREADS'], os.environ['GPU_SUITE_KEPT'])"
    stage = gpu_suite.Stage("probe", "env", [sys.executable, "-c", show], 60, needs_gpu=False,
                            env={"ZERO_OFFLOAD_PIN_THREADS": "1"})
    rec = gpu_suite.run_stage(stage, tmp_path, cuda=False)
    assert rec["status"] == "ok" and rec["tail"].split() == ["1", "yes"] and rec["env"] == stage.env
    proc = subprocess.run([sys.executable, str(SUITE), "--dry-run"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert "ZERO_OFFLOAD_PIN_THREADS=1 " + sys.executable in proc.stdout


def test_dry_run_shows_the_two_commands_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SUITE), "--dry-run", "--out", str(out)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "command 1: python benchmarks/gpu_suite.py --command 1" in proc.stdout
    assert "command 2: python benchmarks/gpu_suite.py --command 2" in proc.stdout
    assert "of its 8)" in proc.stdout and "of its 4)" in proc.stdout
    assert not out.exists()


def test_the_archive_holds_every_file_of_the_run(tmp_path):
    """A lent machine hands back at most 8 files of $OUT; a command writes a log and JSON per stage and the report:
    ``--archive`` puts the whole folder in one file, the same files as the folder holds."""
    import tarfile

    out, archive = tmp_path / "suite", tmp_path / "OUT" / "suite-1.tar.gz"
    proc = subprocess.run([sys.executable, str(SUITE), "--tiny", "--command", "1", "--stages", "build,machine",
                           "--out", str(out), "--archive", str(archive)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = sorted(str(p.relative_to(tmp_path)) for p in out.rglob("*") if p.is_file())
    assert {"suite/REPORT.md", "suite/build.stage.json", "suite/machine.log"} <= set(written)
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        assert sorted(members) == written
        assert tar.extractfile(members["suite/REPORT.md"]).read() == (out / "REPORT.md").read_bytes()
    assert [p.name for p in archive.parent.iterdir()] == [archive.name]  # (no part file left)


def test_unknown_stage_is_refused():
    proc = subprocess.run([sys.executable, str(SUITE), "--dry-run", "--stages", "steps,nope"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "unknown stage(s) nope" in proc.stderr


def test_tiny_run_reports_what_train_step_measured(tmp_path):
    out = tmp_path / "out"
    for command, stages in (("1", "machine,steps"), ("2", "pinned")):  # (both commands' folders, one report)
        proc = subprocess.run([sys.executable, str(SUITE), "--tiny", "--command", command, "--out", str(out),
                               "--stages", stages], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = json.loads((out / "steps.stage.json").read_text())
    assert steps["status"] == "ok", steps.get("tail")
    rows = steps["result"]["rows"]
    assert set(rows) == {"adamw-ref", "ours"}
    # Same seed and batches, AdamW's arithmetic: the sanity loss agrees (as train_step prints it, 4 decimals).
    assert rows["ours"]["loss"] == pytest.approx(rows["adamw-ref"]["loss"], abs=1e-4)
    report = (out / "REPORT.md").read_text()
    ratio = rows["ours"]["step_s"] / rows["adamw-ref"]["step_s"]
    assert f"| ours | ok | {rows['ours']['step_s'] * 1e3:.0f} | {ratio:.2f} |" in report
    assert "| adamw-ref | ok |" in report and "| 1.00 |" in report
    if not json.loads((out / "pinned.stage.json").read_text()).get("result"):
        assert "| pinned | skipped (no CUDA GPU on this machine) |" in report
    # --report-only rebuilds the same report from the stage files (how folders of several runs are merged).
    before = report
    (out / "REPORT.md").unlink()
    subprocess.run([sys.executable, str(SUITE), "--report-only", "--out", str(out)], check=True,
                   capture_output=True, timeout=120, cwd=ROOT)
    assert (out / "REPORT.md").read_text() == before


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_the_huge_pinned_probe_maps_private_huge_page_memory_no_fork_inherits():
    """The probe's candidate for pinned buffers on huge pages (its page-locking needs a GPU): exact size, on a
    2 MiB boundary, advised as huge pages and not inherited by a fork (VmFlags "hg" and "dc")."""
    import mmap

    import torch

    from zero_offload.host_memory import huge_page_bytes

    if not hasattr(mmap, "MADV_DONTFORK") or huge_page_bytes() is None:
        pytest.skip("needs madvise(MADV_DONTFORK) and transparent huge pages")
    t, memory = gpu_suite.huge_private_map((4 << 20) + 3)
    assert t.dtype == torch.float32 and t.numel() == (4 << 20) + 3 and t.data_ptr() % huge_page_bytes() == 0
    flags = gpu_suite.smaps_field(t.data_ptr(), "VmFlags")
    assert {"hg", "dc"} <= set(flags.split()), flags


def test_cuda_tests_run_the_unproven_gpu_paths_first_and_every_test_file():
    argv = {s.name: s for s in gpu_suite.plan(False, [c.key for c in train_step.CONTENDERS])}["cuda-tests"].argv
    files = [a for a in argv if a.startswith("tests/")]
    every = sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py"))
    # Each file once (pytest would collect a repeated one twice), none forgotten, the first ones existing.
    assert sorted(files) == every and len(set(files)) == len(files)
    assert files[:len(gpu_suite.CUDA_TESTS_FIRST)] == [f"tests/{n}" for n in gpu_suite.CUDA_TESTS_FIRST]
    # Verbose: a run the limit cuts short names each test that ran, not only its dots.
    assert "-v" in argv and "-q" not in argv

"""The GPU runbook, planned for one lease of a lent machine: 15 minutes of device time per session, its start (1-2
minutes) included, at most 10 minutes a command. Two commands, each a list of stages:

    command 1 (under 8 min): the kernel's build, the machine, the 1.3B step where AdamW does not fit (AdamW and
              the all-host placement on the whole GPU, then the GPU capped at that placement's peak plus 1 GiB for
              every bucket parked, placement='auto' and torchao; without clipping, then with), the step on the
              whole GPU (AdamW, ours on the host, parked, 'auto' (the default), gpu_fraction='auto', delayed; ours' rows
              with their own timeline), then the all-host row at 350M twice, the CPU kernel's threads unpinned and
              pinned (``ZERO_OFFLOAD_PIN_THREADS=0`` and ``=1`` in the child's environment);
    command 2 (under 4 min, on the same warm machine: the build is cached): the rest (``pytest -m cuda``
              bounded, the pinned-memory probe and the latency of the device-room check, the FSDP2 rows at world 1:
              fused AdamW on the GPU, CPUOffloadPolicy, ours with ``placement='auto'``; accelerate's FSDP2 plugin
              end to end with ours against AdamW (examples/accelerate_fsdp2.py); and the largest model on a
              12 GiB GPU: AdamW, ours with ``release_grads``, ours under FSDP2's CPUOffloadPolicy at world 1,
              torchao). Every step row reports its peak GPU memory. DeepSpeed's step row (measured on the first
              leases, docs/benchmarks.md) runs on request: ``--rows adamw,deepspeed --stages steps``.

Each stage is a subprocess with its own time limit; a stage that fails or runs out of time is recorded and the
suite goes on. Every stage writes ``<out>/<stage>.json`` and its log as it ends (the step stages also after each
row), and the report (``<out>/REPORT.md``) is rewritten from all the JSON files present after each stage, so a
run cut short keeps what it measured, and both commands' folders merge into one report (``--report-only`` over a
folder holding both; or give both commands the same ``--out``).

    python benchmarks/gpu_suite.py --dry-run                          # the lease plan: commands, stages, limits
    python benchmarks/gpu_suite.py --command 1 --out /tmp/suite --archive $OUT/suite-1.tar.gz   # first command
    python benchmarks/gpu_suite.py --command 2 --out /tmp/suite --archive $OUT/suite-2.tar.gz   # same machine
    python benchmarks/gpu_suite.py --command 1 --rows adamw,ours,ours-gpuauto --stages build,steps --out o
    python benchmarks/gpu_suite.py --report-only --out merged         # after copying both folders into merged/
    python benchmarks/gpu_suite.py --tiny --command 1 --out /tmp/t    # the plumbing on a CPU, tiny model, seconds

A lent machine hands back at most 8 files of ``$OUT`` (16 MiB each), and a command writes some 30 (a log and JSON
per stage, traces): so ``--out`` is a folder outside ``$OUT`` and ``--archive`` a file in it, the whole folder as one
gzipped tar, rewritten after each stage (a command cut short keeps what it measured); the second command's, over
the same folder on the warm machine, holds both commands' stages and the merged report.

Rows of the step matrix missing from a stage's results are named in the report, not dropped. Without a GPU the
GPU-only stages are reported as skipped, with that reason. Carried wheels: torchao (3 MB) makes its row run;
DeepSpeed has no binary wheel on PyPI: ``pip wheel --no-deps deepspeed==X`` here (``DS_BUILD_OPS=0``, pure
Python; its CPU Adam is compiled on first use there) gives one to carry.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
TRAIN_STEP = str(ROOT / "benchmarks" / "train_step.py")
FSDP2_STEP = str(ROOT / "benchmarks" / "fsdp2_step.py")
GIB = 1 << 30

# A lease, in seconds: at most 10 minutes a command; the plan keeps command 1 under 8 minutes and command 2 under
# 4, so that both fit 15 minutes of device time with the machine's start.
COMMAND_LIMIT_S = {"1": 8 * 60, "2": 4 * 60}
# The step matrix on the whole GPU: the anchor, ours, its homes, then ours' other modes last: a stage cut short by
# its limit loses the last rows. torchao's row is the capped stages' (the other
# offloader is reported as not installed when its package is missing); DeepSpeed's runs on request (--rows).
MATRIX = ("adamw", "ours", "ours-parked", "ours-auto", "ours-gpuauto", "ours-delayed")
# The homes at a GPU where AdamW does not fit: AdamW uncapped, the all-host placement uncapped (its peak sets the
# cap: plus 1 GiB), then capped: every bucket parked, the cost model's placement, torchao (issue 52's rows).
CAPPED_MATRIX = ("adamw", "ours-host", "ours-parked", "ours-auto", "torchao")
TINY_MATRIX = ("adamw-ref", "ours")
# Timed steps per row, after the warm-up: 5 capped rows, 5 with clipping, then 6 on the whole GPU fit command 1 at
# ~18 s a row (the first lease: 130 s for 7 rows; the H200 lease: 123 s for the first 6, each 12-28 s).
STEPS, WARMUP = 5, 2


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    what: str
    argv: List[str]
    timeout_s: int
    needs_gpu: bool = True
    command: str = "1"  # which command of the lease runs it
    timeline: bool = False  # train_step.py records ours' own timeline: per row, its spans by kind, and a trace
    env: Optional[Dict[str, str]] = None  # set in the child's environment (beside this process's)


def _step_argv(tiny: bool, keys: List[str], extra: List[str], preset: str = "1.3b", steps: int = STEPS,
               warmup: int = WARMUP) -> List[str]:
    if tiny:
        return [sys.executable, TRAIN_STEP, "--cpu", "--preset", "tiny", "--layers", "1", "--steps", "2",
                "--warmup", "1", "--only", ",".join(TINY_MATRIX)] + extra
    return [sys.executable, TRAIN_STEP, "--preset", preset, "--batch", "16", "--seq", "1024", "--steps", str(steps),
            "--warmup", str(warmup), "--only", ",".join(keys)] + extra


# The test files whose GPU paths no lease has run yet (their `cuda` tests run first, as the stage's limit cuts
# `pytest -m cuda` short: about 80 s of tests in 30 s); the other files follow in pytest's own order.
CUDA_TESTS_FIRST = ("test_adamw_device_views.py", "test_placement_sharded.py", "test_placement.py",
                    "test_park_factored.py", "test_park_class.py", "test_fsdp2_streams.py", "test_fsdp2.py",
                    "test_acceptance_tp.py", "test_adamw_dropin_hostile.py", "test_distributed.py")


def cuda_test_files() -> List[str]:
    """The test files in the order the cuda-tests stage runs them: :data:`CUDA_TESTS_FIRST`, then the rest."""
    rest = sorted(p.name for p in (ROOT / "tests").glob("test_*.py") if p.name not in CUDA_TESTS_FIRST)
    return [f"tests/{name}" for name in (*CUDA_TESTS_FIRST, *rest)]


def plan(tiny: bool, known: List[str], rows: Optional[List[str]] = None) -> List[Stage]:
    """The stages of both commands, in order. ``known``: the contender keys train_step.py has (rows it lacks are
    left out of its command line and reported as not built); ``rows``: the step matrix (default ``MATRIX``)."""
    keys = [k for k in (rows or MATRIX) if k in known]
    capped = [k for k in CAPPED_MATRIX if k in known]
    model = "tiny GPT on the CPU (plumbing only)" if tiny else "1.3B GPT, batch 16, seq 1024"
    cap = ["--cap-after", "ours-host+1"]
    py = sys.executable
    # The CPU kernel's threads unpinned, then pinned: the all-host row at 350M (a 70 ms kernel; 3 steps, in the
    # limit with the process's start), the two runs alike but for the child's environment.
    threads = _step_argv(tiny, ["ours-host"], [], preset="350m", steps=3, warmup=1)
    return [
        # The build first: the machine report loads the kernel (the first run's report compiled it, and ran
        # out of its limit).
        Stage("build", "the kernel built (or found cached) in this environment",
              [py, "-c", "from zero_offload import _build; m = _build.load_native(); "
                         "print(_build.status()); raise SystemExit(0 if m is not None else 1)"], 90,
              needs_gpu=False),
        Stage("machine", "the machine: GPU, host CPU and RAM, torch, what the package detects",
              [py, "-m", "zero_offload.report"], 20, needs_gpu=False),
        # The homes where AdamW does not fit (issue 52): AdamW and the all-host placement uncapped, then the GPU
        # capped at that placement's peak plus 1 GiB for every bucket parked, the cost model's placement and
        # torchao; without clipping, then with.
        Stage("steps-capped", f"whole training step, {model}, no clipping, the GPU capped after ours-host at its "
                              "peak + 1 GiB (AdamW's row uncapped; ours' timeline)",
              _step_argv(tiny, capped, cap), 110, needs_gpu=not tiny, timeline=True),
        Stage("steps-capped-clip", "the same with clip_grad_norm 1.0",
              _step_argv(tiny, capped, cap + ["--clip", "1.0"]), 105, needs_gpu=not tiny),
        Stage("steps", f"whole training step, {model}, no clipping, the whole GPU (ours' timeline)",
              _step_argv(tiny, keys, []), 125, needs_gpu=not tiny, timeline=True),
        Stage("threads-unpinned", "the all-host row (350M), the CPU kernel's threads not pinned "
                                  "(ZERO_OFFLOAD_PIN_THREADS=0)",
              threads, 15, needs_gpu=not tiny, env={"ZERO_OFFLOAD_PIN_THREADS": "0"}),
        Stage("threads-pinned", "the same, the kernel's threads pinned to cores (ZERO_OFFLOAD_PIN_THREADS=1)",
              threads, 15, needs_gpu=not tiny, env={"ZERO_OFFLOAD_PIN_THREADS": "1"}),
        Stage("cuda-tests", "pytest -m cuda (bounded: what ran by the limit is named in its log; the files of paths "
                            "not yet run on a GPU first)",
              [py, "-m", "pytest", "-v", "-m", "cuda", "-p", "no:cacheprovider", "-rfE", *cuda_test_files()], 30,
              command="2"),
        Stage("pinned", "pinned-memory probe: is_pinned() and copy return time for cudaHostRegister'ed buffers "
                        "(the three CUDA tests that failed on torch 2.11); the device-room check's latency; "
                        "pinned buffers on huge pages against ours (copy rates, the kernel's time)",
              [py, str(Path(__file__).resolve()), "--probe-pinned"], 35, command="2"),
        Stage("fsdp2", "FSDP2 (fully_shard) at world 1: fused AdamW on the GPU, CPUOffloadPolicy with torch's "
                       "AdamW and with ours, ours with the shards on the GPU, and with placement='auto' "
                       "(peak GPU memory per row)",
              [py, FSDP2_STEP, "--world", "1", "--gpu-width", "4096", "--gpu-layers", "8", "--steps", "5",
               "--warmup", "2"], 35, command="2"),
        # accelerate is in the device's image: its FSDP2 plugin end to end with ours against AdamW (issue 53).
        Stage("accelerate-fsdp2", "accelerate's FSDP2 plugin end to end (prepare, accumulate, clip, a schedule) with "
                                  "ours and with AdamW, parameters and moments compared at every step",
              [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               str(ROOT / "examples" / "accelerate_fsdp2.py"), "--steps", "8"], 30, command="2"),
        Stage("find-max-cap12", "largest model on a GPU capped at 12 GiB, activation checkpointing; ours also "
                                "under FSDP2's CPUOffloadPolicy at world 1",
              [py, TRAIN_STEP, "--find-max", "--checkpoint", "--gpu-cap-gib", "12",
               "--only", "adamw,ours-release,ours-fsdp2-offload,torchao"], 110, command="2"),
    ]


# ------------------------------------------------------------------------------------------------ running --
def run_stage(stage: Stage, out: Path, cuda: bool) -> Dict[str, Any]:
    rec: Dict[str, Any] = dict(stage=stage.name, what=stage.what, argv=stage.argv, timeout_s=stage.timeout_s,
                               env=stage.env)
    if stage.needs_gpu and not cuda:
        rec.update(status="skipped", reason="no CUDA GPU on this machine")
        return rec
    argv = list(stage.argv)
    result_json = out / f"{stage.name}.result.json"
    if TRAIN_STEP in argv:
        argv += ["--json", str(result_json)]
    if stage.timeline:
        argv += ["--timeline", str(out / f"{stage.name}.timeline")]
    log = out / f"{stage.name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=stage.timeout_s,
                                  env=None if stage.env is None else {**os.environ, **stage.env})
            rec.update(status="ok" if proc.returncode == 0 else "failed", returncode=proc.returncode)
        except subprocess.TimeoutExpired:
            rec.update(status="timed out", returncode=None)
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    rec["log"] = log.name
    text = log.read_text(errors="replace")
    rec["tail"] = text[-3000:]
    if result_json.exists():
        rec["result"] = json.loads(result_json.read_text())
    if stage.name == "cuda-tests":
        rec["summary"] = _pytest_summary(text)
    return rec


def _pytest_summary(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if " passed" in ln or " failed" in ln or " skipped" in ln
             or " deselected" in ln or "no tests ran" in ln]
    return lines[-1].strip("= ") if lines else "no summary line"


# ------------------------------------------------------------------------------------------- pinned probe --
def probe_pinned() -> Dict[str, Any]:
    """What torch says about memory page-locked with cudaHostRegister (how ours pins at exact size), against
    torch's own pinned allocator: is_pinned(), and how long a large non-blocking device-to-host copy takes to
    return on the host (an asynchronous copy returns in well under a millisecond)."""
    import torch

    from zero_offload import host_memory

    n = 256 << 20  # 1 GiB of fp32
    src = torch.empty(n, device="cuda")
    theirs = torch.empty(n, pin_memory=True)
    ours = host_memory.empty_host(n, torch.float32, pin=True)
    res: Dict[str, Any] = dict(torch=torch.__version__, cuda=torch.version.cuda,
                               theirs_is_pinned=bool(theirs.is_pinned()))

    def return_ms(dst):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        returned = (time.perf_counter() - t0) * 1e3 / 5
        torch.cuda.synchronize()
        return round(returned, 3)

    res["theirs_copy_return_ms"] = return_ms(theirs)
    res["ours_registered"] = host_memory.is_registered(ours)
    res["ours_is_pinned"] = bool(ours.is_pinned())
    res["ours_copy_return_ms"] = return_ms(ours)
    res.update(probe_room())
    res.update(probe_huge_pinned())
    return res


def probe_room() -> Dict[str, Any]:
    """How long the device-room check of an upload in backward (``delayed_update``) or a parked reload takes (``device_room``: the driver's free
    memory and the caching allocator's counts, once per bucket and step, from the worker or backward's hooks),
    with the GPU idle and while it runs a long kernel: a driver call that waits for the GPU would stall the
    worker or backward."""
    import torch

    from zero_offload.transport.device import device_room

    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(8192, 8192, device=dev)

    def us(fn, busy: bool) -> float:
        torch.cuda.synchronize()
        if busy:
            for _ in range(20):  # some 0.4 s of fp32 matmuls queued ahead
                a @ a
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        took = (time.perf_counter() - t0) * 1e6 / 20
        torch.cuda.synchronize()
        return round(took, 1)

    return {f"{name}_us_{state}": us(fn, state == "busy")
            for name, fn in (("mem_get_info", lambda: torch.cuda.mem_get_info(dev)),
                             ("memory_allocated", lambda: torch.cuda.memory_allocated(dev)),
                             ("device_room", lambda: device_room(dev)))
            for state in ("idle", "busy")}


def huge_private_map(numel: int) -> Any:
    """``numel`` fp32 elements of a private anonymous map (and the map), starting on a huge page, advised
    ``MADV_HUGEPAGE`` (as ours' unpinned buffers are) and ``MADV_DONTFORK``: a fork would otherwise share, copy or
    copy-on-write page-locked private memory (ours' pinned buffers are shared maps for that reason today). Raises
    ``OSError`` where the system refuses either advice."""
    import mmap

    import torch

    from zero_offload.host_memory import HUGE_PAGE, huge_page_bytes

    huge = huge_page_bytes() or HUGE_PAGE
    span = -(-numel * 4 // mmap.PAGESIZE) * mmap.PAGESIZE
    memory = mmap.mmap(-1, span + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -torch.frombuffer(memory, dtype=torch.uint8, count=1).data_ptr() % huge
    memory.madvise(mmap.MADV_HUGEPAGE, offset, span)
    memory.madvise(mmap.MADV_DONTFORK, offset, span)
    return torch.frombuffer(memory, dtype=torch.float32, count=numel, offset=offset), memory


def smaps_field(ptr: int, key: str) -> str:
    """Field ``key`` ("AnonHugePages", "VmFlags") of the mapping of this process that holds address ``ptr``, from
    /proc/self/smaps ("" where none holds it)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and line.startswith(key + ":"):
                return line.split(":", 1)[1].strip()
    return ""


def huge_bytes(ptr: int) -> int:
    """Bytes of the mapping holding ``ptr`` that sit on huge pages."""
    field = smaps_field(ptr, "AnonHugePages")
    return int(field.split()[0]) * 1024 if field else 0


def probe_huge_pinned(numel: int = 64 << 20) -> Dict[str, Any]:
    """Whether pinned buffers should sit on huge pages too (the host step ran 0.92x the time on them unpinned,
    docs/memory.md): a :func:`huge_private_map` page-locked with cudaHostRegister against ours' pinned buffers of
    today (shared maps, 4 KiB pages): whether it registers and is on huge pages, the copy rates both ways, and the
    CPU-Adam kernel's time on four buffers of each (interleaved, best of 5). A failure is reported, not raised (the
    probe's other results stand), and whatever was page-locked is unregistered."""
    import torch

    from zero_offload import host_memory

    cudart = torch.cuda.cudart()
    registered: List[Any] = []
    res: Dict[str, Any] = {}
    try:
        for _ in range(4):
            t, memory = huge_private_map(numel)
            err = int(cudart.cudaHostRegister(t.data_ptr(), t.nbytes, 0))
            if err:
                host_memory._clear_last_cuda_error()
                res["huge_pinned_register_error"] = err
                return res
            registered.append((t, memory))
        _time_huge_pinned(numel, [t.normal_() for t, _ in registered], res)
    except Exception as exc:  # noqa: BLE001 (reported with the probe's results)
        res["huge_pinned_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for t, _ in registered:
            cudart.cudaHostUnregister(t.data_ptr())
    return res


def _time_huge_pinned(numel: int, huge: List[Any], res: Dict[str, Any]) -> None:
    import torch

    from zero_offload import functional, host_memory

    plain = [host_memory.empty_host(numel, torch.float32, pin=True).normal_() for _ in range(4)]
    res["huge_pinned_bytes_on_huge_pages"] = sum(huge_bytes(t.data_ptr()) for t in huge)
    dev = torch.empty(numel, device="cuda")

    def best(fn) -> float:
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return min(times)

    for name, bufs in (("plain", plain), ("huge", huge)):
        res[f"{name}_pinned_h2d_gbs"] = round(numel * 4 / best(lambda: dev.copy_(bufs[0], non_blocking=True)) / 1e9, 1)
        res[f"{name}_pinned_d2h_gbs"] = round(numel * 4 / best(lambda: bufs[0].copy_(dev, non_blocking=True)) / 1e9, 1)
    for name, (p, g, m, v) in (("plain", plain), ("huge", huge)) * 2:  # (interleaved: the second round counts)
        m.zero_()
        v.zero_()
        res[f"{name}_pinned_adam_ms"] = round(best(lambda: functional.cpu_adam_(p, g, m, v, step=1, lr=1e-4)) * 1e3, 2)


# --------------------------------------------------------------------------------------------------- report --
def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _steps_table(rec: Dict[str, Any]) -> List[str]:
    res = rec.get("result") or {}
    rows = res.get("rows") or {}
    anchor = rows.get("adamw") or rows.get("adamw-ref") or {}
    base = anchor.get("step_s") if anchor.get("status") == "ok" else None
    lines = ["| contender | status | step ms | x AdamW | fwd | bwd | opt | peak GiB | rest GiB | loss |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, r in rows.items():
        ok = r.get("status") == "ok"
        step = r.get("step_s") if ok else None
        ratio = step / base if step and base else None
        ms = [_fmt(r.get(k) * 1e3 if ok and r.get(k) is not None else None, ".0f")
              for k in ("step_s", "fwd_s", "bwd_s", "opt_s")]
        gib = [_fmt(r[k] / GIB if ok and r.get(k) is not None else None, ".2f") for k in ("peak_bytes", "rest_bytes")]
        status = r.get("status", "?") if ok else f"{r.get('status')}: {str(r.get('error', ''))[:80]}"
        lines.append(f"| {key} | {status} | {ms[0]} | {_fmt(ratio, '.2f')} | {ms[1]} | {ms[2]} | {ms[3]} | "
                     f"{gib[0]} | {gib[1]} | {_fmt(r.get('loss') if ok else None, '.4f')} |")
    argv = rec.get("argv") or []
    asked = argv[argv.index("--only") + 1].split(",") if "--only" in argv else []
    missing = [k for k in asked if k not in rows and res.get("mode") == "gpu"]
    if missing:
        lines.append(f"\nNot in this run (not applicable, or the stage ended first): {', '.join(missing)}.")
    return lines


def _find_max_table(rec: Dict[str, Any]) -> List[str]:
    found = (rec.get("result") or {}).get("find_max") or {}
    anchor = found.get("adamw", {}).get("params")
    lines = ["| contender | layers | params | x AdamW | next size up |", "|---|---:|---:|---:|---|"]
    for key, f in found.items():
        ratio = f["params"] / anchor if anchor else None
        lines.append(f"| {key} | {f['layers']} | {f['params'] / 1e9:.2f}B | {_fmt(ratio, '.2f')} | {f['bound']} |")
    return lines


def write_report(out: Path) -> Path:
    recs = {}
    for path in sorted(out.glob("*.stage.json")):
        rec = json.loads(path.read_text())
        recs[rec["stage"]] = rec
    order = [s.name for s in plan(False, list(MATRIX))]
    lines = ["# GPU runbook report", ""]
    machine = recs.get("machine", {}).get("host") or {}
    if machine:
        lines += [f"Machine: {machine.get('gpu', 'no CUDA GPU')}; host: {machine.get('cpu')}, "
                  f"{machine.get('cores')} cores, {machine.get('ram_gib')} GiB RAM; torch {machine.get('torch')} "
                  f"(CUDA {machine.get('cuda')}); python {machine.get('python')}.", ""]
    lines += ["| stage | status | seconds | what |", "|---|---|---:|---|"]
    for name in sorted(recs, key=lambda n: order.index(n) if n in order else len(order)):
        r = recs[name]
        status = r["status"] + (f" ({r['reason']})" if r.get("reason") else "")
        if r.get("summary"):
            status += f": {r['summary']}"
        lines.append(f"| {name} | {status} | {_fmt(r.get('seconds'), '.0f')} | {r['what']} |")
    for name in ("pinned",):
        if recs.get(name, {}).get("result"):
            lines += ["", "## Pinned memory", "", "```", json.dumps(recs[name]["result"], indent=1), "```"]
    for name in ("steps-capped", "steps-capped-clip", "steps", "threads-unpinned", "threads-pinned"):
        if recs.get(name, {}).get("result"):
            lines += ["", f"## {recs[name]['what']}", ""] + _steps_table(recs[name])
    for name in ("find-max-int8", "find-max-cap12"):
        if recs.get(name, {}).get("result"):
            lines += ["", f"## {recs[name]['what']}", ""] + _find_max_table(recs[name])
    if recs.get("fsdp2", {}).get("status") == "ok":  # its own table, as the script prints it
        table = [ln for ln in recs["fsdp2"].get("tail", "").splitlines() if ln.startswith(("medians", "  "))]
        lines += ["", f"## {recs['fsdp2']['what']}", "", "```", *table, "```"]
    bad = [r for r in recs.values() if r["status"] in ("failed", "timed out")]
    for r in bad:
        lines += ["", f"## {r['stage']}: {r['status']} (last lines of {r.get('log')})", "", "```",
                  r.get("tail", "")[-1500:].rstrip(), "```"]
    report = out / "REPORT.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def bundle(out: Path, archive: Path) -> Path:
    """The folder ``out`` as one gzipped tar at ``archive`` (its members under ``out``'s name), replaced whole: a
    command stopped while it writes leaves the last one."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    part = archive.with_name(archive.name + ".part")
    with tarfile.open(part, "w:gz") as tar:
        tar.add(out, arcname=out.name)
    os.replace(part, archive)
    return archive


def host_facts() -> Dict[str, Any]:
    import torch
    facts: Dict[str, Any] = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                                 cores=os.cpu_count(), cpu=platform.processor() or platform.machine())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
        facts["ram_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1)
    except (OSError, ValueError):
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts["gpu"] = f"{props.name} ({props.total_memory / GIB:.1f} GiB)"
    return facts


def known_contenders() -> List[str]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import train_step  # noqa: E402 (a sibling script)
    return [c.key for c in train_step.CONTENDERS]


def print_plan(stages: List[Stage]) -> None:
    """Each command of the lease with its stages, their limits, and the command's total against its budget."""
    for command, budget in COMMAND_LIMIT_S.items():
        mine = [s for s in stages if s.command == command]
        if not mine:
            continue
        total = sum(s.timeout_s for s in mine)
        print(f"command {command}: python benchmarks/gpu_suite.py --command {command} --out /tmp/suite --archive "
              f"$OUT/suite-{command}.tar.gz (limit {total / 60:.1f} min of its {budget / 60:.0f})")
        for s in mine:
            print(f"  [{s.name}] {s.what} (limit {s.timeout_s} s{', GPU only' if s.needs_gpu else ''})\n      "
                  + " ".join([f"{k}={v}" for k, v in (s.env or {}).items()] + s.argv))
    print(f"total limit: {sum(s.timeout_s for s in stages) / 60:.1f} min")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_suite_out", help="folder for logs, JSON and REPORT.md")
    ap.add_argument("--command", choices=sorted(COMMAND_LIMIT_S), default=None,
                    help="run one command of the lease plan (default: both, one after the other)")
    ap.add_argument("--stages", default=None, help="comma-separated subset of the stages, in the plan's order")
    ap.add_argument("--rows", default=None, help=f"the step matrix's rows (default {','.join(MATRIX)})")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (commands and limits) and run nothing")
    ap.add_argument("--tiny", action="store_true", help="tiny CPU model for the step stages: tests the plumbing")
    ap.add_argument("--report-only", action="store_true", help="rewrite REPORT.md from the JSON files in --out")
    ap.add_argument("--archive", default=None, metavar="FILE",
                    help="after each stage, write the --out folder as one gzipped tar to FILE (a lent machine hands "
                         "back at most 8 files of $OUT)")
    ap.add_argument("--probe-pinned", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe_pinned:
        sys.path.insert(0, str(ROOT))  # (run as a script: the package beside benchmarks/, installed or not)
        print(json.dumps(probe_pinned(), indent=1))
        return 0
    out = Path(args.out)
    if args.report_only:
        print(write_report(out).read_text())
        return 0
    known = known_contenders()
    rows = [k.strip() for k in args.rows.split(",") if k.strip()] if args.rows else None
    if rows and set(rows) - set(known):
        ap.error(f"unknown row(s) {', '.join(sorted(set(rows) - set(known)))}; train_step.py has {', '.join(known)}")
    stages = plan(args.tiny, known, rows)
    if args.command:
        stages = [s for s in stages if s.command == args.command]
    if args.stages:
        wanted = [s.strip() for s in args.stages.split(",") if s.strip()]
        unknown = sorted(set(wanted) - {s.name for s in stages})
        if unknown:
            ap.error(f"unknown stage(s) {', '.join(unknown)}; the stages are {', '.join(s.name for s in stages)}")
        stages = [s for s in stages if s.name in wanted]
    if args.dry_run:
        print_plan(stages)
        return 0
    import torch
    cuda = torch.cuda.is_available()
    out.mkdir(parents=True, exist_ok=True)
    for s in stages:
        print(f"== {s.name}: {s.what}", flush=True)
        rec = run_stage(s, out, cuda)
        if s.name == "machine":
            rec["host"] = host_facts()
        if s.name == "pinned" and rec["status"] == "ok":
            rec["result"] = json.loads(rec["tail"][rec["tail"].index("{"):])
        (out / f"{s.name}.stage.json").write_text(json.dumps(rec, indent=1, default=str))
        print(f"   {rec['status']}" + (f" ({rec['reason']})" if rec.get("reason") else "")
              + (f" in {rec['seconds']} s" if "seconds" in rec else ""), flush=True)
        write_report(out)
        if args.archive:
            bundle(out, Path(args.archive))
    print(f"report: {write_report(out)}")
    if args.archive:
        print(f"archive: {bundle(out, Path(args.archive))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host memory per rank for the optimizer state of a sharded OffloadOptimizer, at N = 1, 2, 3 ranks on CPU (gloo,
spawned processes): bytes per parameter from the optimizer's own buffer accounting and from the process's
resident-set growth while it is built, against the 12/N the sharding promises.

    python benchmarks/sharded_memory.py [--numel 50_000_000] [--dtype bf16]

The model is a list of bf16 parameters (default), so the fp32 masters are real buffers (with fp32 CPU parameters
the master would be the parameter itself). RSS growth also contains the buffers that are not optimizer state: the
host gradient shard (2/N B/param), the full flat gradient buffer the reduce-scatter reads (2 B/param) and the full
flat parameter buffer, whose growth cancels once the parameters' old storage is freed; "expected" is the sum of
every buffer minus that freed storage. "excess" (RSS growth minus expected) is the same at every N: it is not
optimizer state but the replaced parameter storage that the C allocator keeps instead of returning to the OS; the
differences of RSS growth between N follow the state's 12/N exactly.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zero_offload import OffloadOptimizer  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(rank, world, port, numel, dtype, queue):
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=5))
    # Uneven sizes, so shards straddle parameters.
    sizes = [numel // 4 + 1, numel // 2 - 7, numel - (numel // 4 + 1) - (numel // 2 - 7)]
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]
    before = rss_bytes()
    opt = OffloadOptimizer(params, process_group=dist.group.WORLD if world > 1 else None)
    for b in opt.host_buffers():  # touch every page: RSS counts only memory written
        for t in b.values():
            t.zero_()
    grown = rss_bytes() - before
    est = opt.estimate_host_memory()
    counted = sum(t.numel() * t.element_size() for name, b in
                  ((n, t) for bufs in opt.host_buffers() for n, t in bufs.items())
                  for t in [b] if name in ("master", "exp_avg", "exp_avg_sq"))
    queue.put((rank, dict(state=est.state_bytes, counted=counted, total=est.total_bytes,
                          freed=est.replaces_param_bytes, rss=grown, buffers=dict(est.buffers))))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def measure(world, numel, dtype):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, world, port, numel, dtype, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=50_000_000, help="parameters of the model (default: 50_000_000)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                    help="the parameters' dtype (default: bf16, so the fp32 masters are buffers of their own)")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"{args.numel:,} {args.dtype} parameters in 3 tensors")
    print(f"{'N':>2} {'rank':>4} | {'state B/param':>13} {'(buffers)':>9} {'12/N':>6} {'ratio':>6} | "
          f"{'RSS growth B/param':>18} {'expected':>8} {'excess':>6}")
    for world in (1, 2, 3):
        for rank, r in sorted(measure(world, args.numel, dtype).items()):
            state = r["state"] / args.numel
            counted = r["counted"] / args.numel
            rss = r["rss"] / args.numel
            expected = (r["total"] - r["freed"]) / args.numel
            print(f"{world:>2} {rank:>4} | {state:>13.3f} {counted:>9.3f} {12 / world:>6.2f} "
                  f"{state / (12 / world):>6.3f} | {rss:>18.3f} {expected:>8.3f} {rss - expected:>6.3f}")


if __name__ == "__main__":
    main()

"""Step time of a sharded OffloadOptimizer on CPU (gloo, 2 spawned ranks): gradients reduce-scattered at
``step()`` against reduce-scattered from the backward hooks while backward goes on, with ``torch.optim.AdamW``
under DDP (the usual data-parallel baseline, full state on every rank) measured in the same run.

    python benchmarks/sharded_step.py [--width 1024] [--layers 8] [--steps 12] [--threads 1]

The model is a stack of ``width x width`` fp32 linear layers (one bucket each with the default ``--bucket``), so
backward produces buckets one after another, as a transformer's blocks do. Each rank trains on its own batch;
reported: median time of forward + backward + clip + step (first two steps dropped), and that time relative to
the first variant. Timings on a busy or shared machine drift; compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zero_offload import OffloadOptimizer  # noqa: E402

VARIANTS = {
    "OffloadOptimizer, reduce-scatter at step()": dict(stream_grads=False),
    "OffloadOptimizer, reduce-scatter in backward": dict(stream_grads=True, release_grads=True),
    "torch AdamW(fused) under DDP": None,
}


def worker(rank, world, port, args, queue):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=5))
    results = {}
    for name, kw in VARIANTS.items():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU())
                                for _ in range(args.layers)])
        if kw is None:
            net = nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        else:
            net = model
            opt = OffloadOptimizer(model.parameters(), lr=1e-4, bucket_numel=args.bucket,
                                   process_group=dist.group.WORLD, **kw)
        x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
        times = []
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            net(x).square().mean().backward()
            if kw is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        results[name] = statistics.median(times[2:])
        del opt, net, model
    queue.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1024, help="width of each square linear layer (default: 1024)")
    ap.add_argument("--layers", type=int, default=8, help="linear layers (default: 8)")
    ap.add_argument("--batch", type=int, default=256, help="rows per rank and step (default: 256)")
    ap.add_argument("--steps", type=int, default=12, help="steps per variant; the first two are not timed (default: 12)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1: 2 ranks, 2 cores)")
    ap.add_argument("--bucket", type=int, default=1 << 20, help="bucket_numel (default 2**20: a layer a bucket)")
    args = ap.parse_args()
    world = 2
    numel = args.layers * (args.width * args.width + args.width)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"world {world} (gloo), {args.threads} thread(s) per rank; {numel / 1e6:.1f}M fp32 parameters in "
          f"{args.layers} layers, batch {args.batch} per rank")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=1800) for _ in range(world))
    for p in procs:
        p.join()
    # The slower rank sets the pace of a synchronous step.
    step = {name: max(out[r][name] for r in out) for name in VARIANTS}
    first = next(iter(step.values()))
    print(f"| variant | step (ms) | vs first |\n|---|---:|---:|")
    for name, t in step.items():
        print(f"| {name} | {1e3 * t:.1f} | {t / first:.2f}x |")


if __name__ == "__main__":
    main()

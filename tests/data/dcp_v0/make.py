"""How tests/data/dcp_v0 was written: a sharded DCP checkpoint from the ShardedTensor-based sharded_state_dict()
of zero_offload at commit f2d1552 (2 ranks, gloo), and the full state dict of the same run (``full.pt``), which
tests/test_distributed.py::test_a_checkpoint_of_the_shardedtensor_format_still_loads compares it with.

    PYTHONPATH=<checkout at f2d1552> python tests/data/dcp_v0/make.py tests/data/dcp_v0
"""
import os, sys, socket
import torch, torch.nn as nn, torch.distributed as dist, torch.multiprocessing as mp

OUT = sys.argv[1]


def model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    extra = nn.Parameter(torch.randn(17).to(torch.bfloat16))
    return m, extra


def worker(rank, world, port):
    import zero_offload
    import torch.distributed.checkpoint as dcp
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    m, extra = model()
    opt = zero_offload.OffloadOptimizer([{"params": m.parameters()}, {"params": [extra], "lr": 0.02}], lr=0.01,
                                        amsgrad=True, bucket_numel=64, process_group=dist.group.WORLD)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for p in list(m.parameters()) + [extra]:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=os.path.join(OUT, "dcp"))
    full = opt.state_dict()
    if rank == 0:
        torch.save(full, os.path.join(OUT, "full.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(worker, args=(2, port), nprocs=2)

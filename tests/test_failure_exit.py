"""A process whose collective failed exits promptly, with its own exit status (issue 16).

World 2 over gloo, each rank a process of its own, so that its exit status and stderr are its own: forked by a
server (this file run with ``--serve``, see :func:`serve`; one for the module) that imported torch, ``torch._dynamo``
and the package once, and ending as a script does, through the interpreter's own shutdown (started as a new
``python`` each, a rank spent most of its 10 s run importing them). Rank 1 misbehaves at the moment it should start
the collective under test, on the second step: it stalls there (a hung peer) or it is killed there with SIGKILL
once rank 0 has given up and is exiting. Rank 0's wait times out after ``TIMEOUT`` seconds; the user's handler
checks that the optimizer refuses further collectives and still gives its shard of the state, destroys the group
and calls ``sys.exit(EXIT)``. Rank 0 must then end with that status, without ``terminate called`` on its stderr,
while rank 1 is still stalled: before the fix it waited for the peer at interpreter shutdown (the gloo group's
destructor joined a worker thread stuck in the abandoned collective) and then died in ``std::terminate`` (a
thread blocked in ``Work.wait()`` woken during shutdown).

The collectives: the gradient-norm all-reduce at ``step()``, the reduce-scatter started in backward
(``stream_grads=True``), the all-gather of the updated parameters at ``step()``, and ``state_dict()``'s gathers.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed

TIMEOUT = 3.0  # the optimizer's, for the step that fails; rank 1 stalls far longer
STALL = 120.0
EXIT = 3
ROOT = Path(__file__).resolve().parent.parent
COLLECTIVES = {
    # name: (the rank-1 collective that stalls, stream_grads)
    "norm_all_reduce": (lambda what, where: what == "all_reduce" and "norm" in where, False),
    "streamed_reduce_scatter": (lambda what, where: what == "reduce_scatter", True),
    "param_all_gather": (lambda what, where: what == "all_gather" and where.startswith("parameters"), False),
    "state_dict_gather": (lambda what, where: what == "all_gather" and where.startswith("state"), False),
}


def main(rank: int, port: int, collective: str) -> None:
    """One rank (run as ``python tests/test_failure_exit.py RANK PORT COLLECTIVE``)."""
    import torch.distributed as dist

    from zero_offload import OffloadOptimizer
    from zero_offload.distributed import Comm

    torch.set_num_threads(1)
    # The group's own timeout is long, as by default: only the optimizer's may end rank 0's wait.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=STALL))
    stalls, stream = COLLECTIVES[collective]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 17), torch.nn.Linear(17, 1))
    opt = OffloadOptimizer(model.parameters(), bucket_numel=300, process_group=dist.group.WORLD, timeout=STALL,
                           stream_grads=stream)
    armed = False
    if rank == 1:
        start = Comm.start

        def stalling_start(self, what, where, *args, **kwargs):
            if armed and stalls(what, where):
                print("stalling", flush=True)
                time.sleep(STALL)
            return start(self, what, where, *args, **kwargs)

        Comm.start = stalling_start

    def train_step(step: int) -> None:
        opt.zero_grad()
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().mean().backward()
        opt.step()

    train_step(0)  # every collective works once
    # The short timeout only from here, after a barrier: on a loaded machine the ranks' start-up can differ by
    # more than TIMEOUT, and only the stall may make a collective fail.
    dist.barrier()
    opt._transport.comm.timeout = datetime.timedelta(seconds=TIMEOUT)
    armed = True
    try:
        train_step(1)
        opt.state_dict()
    except RuntimeError as exc:
        assert rank == 0, exc
        print(f"error: {exc}", flush=True)
    else:
        raise AssertionError("rank 0: no collective failed")
    for call in (opt.state_dict, opt.step):  # refused at once, no collective started
        try:
            call()
        except RuntimeError as exc:
            assert "refused: an earlier collective failed" in str(exc), exc
        else:
            raise AssertionError(f"{call.__name__}() ran after a collective failed")
    sd = opt.sharded_state_dict()  # this rank's shard, built without a collective
    steps = sorted({float(entry["step"]) for entry in sd["state"].values()})
    print(f"sharded_state_dict: {len(sd['state'])} entries, steps {steps}", flush=True)
    dist.destroy_process_group()
    print("exiting", flush=True)
    sys.exit(EXIT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(outdir: str) -> Optional[Tuple[int, int, str]]:
    """Run after run as the test asks, one line on stdin each (``COLLECTIVE PEER NAME``), the two ranks forked from
    this process. In the server: watches the run (:func:`_watch`), writes ``outdir/NAME.json`` (rank 0's exit status
    or None, whether rank 1 was still alive), answers ``NAME`` on stdout; returns None at the end of stdin. In a
    forked rank: returns ``main``'s arguments (rank 0's stdout and stderr in ``outdir/NAME.out`` and ``.err``, rank
    1's on /dev/null) for the caller to run ``main`` at the top level of the script, so that the rank ends as a
    script does. No ``try``/``with`` here: a rank returns through these frames."""
    from test_distributed import import_dynamo
    from zero_offload import _build

    _build.load_native()  # (once, before the forks)
    import_dynamo()  # (what the optimizer's construction imports)
    for line in sys.stdin:
        collective, peer, name = line.split()
        port, pids = _free_port(), []
        out = os.path.join(outdir, f"{name}.out")
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, 0)
                for fd, suffix in ((1, "out"), (2, "err")):
                    path = os.path.join(outdir, f"{name}.{suffix}")
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if rank == 0 else null, fd)
                return rank, port, collective
            pids.append(pid)
        Path(outdir, f"{name}.json").write_text(json.dumps(_watch(pids, peer, Path(out))))
        print(name, flush=True)
    return None


def _watch(pids: List[int], peer: str, out: Path) -> Tuple[Optional[int], bool]:
    """Wait for rank 0 (at most ``STALL / 2`` seconds: longer, it waits for its peer); with ``peer="kill"``, SIGKILL
    rank 1 once rank 0 is exiting. Returns rank 0's exit status (None if it had not ended) and whether rank 1 was
    still alive (stalled) when rank 0 had ended; kills what still runs."""
    codes: Dict[int, int] = {}

    def ended(pid: int) -> bool:
        if pid not in codes:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        return pid in codes

    deadline = time.monotonic() + STALL / 2
    while not ended(pids[0]) and time.monotonic() < deadline:
        if peer == "kill" and not ended(pids[1]) and out.exists() and "exiting" in out.read_text():
            time.sleep(0.5)  # well into rank 0's interpreter shutdown
            os.kill(pids[1], signal.SIGKILL)
        time.sleep(0.1)
    result = codes.get(pids[0]), not ended(pids[1])
    for pid in pids:
        if not ended(pid):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return result


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The module's fork server (:func:`serve`) and its folder."""
    outdir = tmp_path_factory.mktemp("failure-exit")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(outdir)], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        yield proc, outdir
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run_ranks(server, collective: str, peer: str):
    """Run both ranks (see :func:`_watch`). Returns rank 0's exit status (None if it had not ended within
    ``STALL / 2`` seconds), stdout and stderr, and whether rank 1 was still alive when rank 0 had ended."""
    proc, outdir = server
    name = f"{collective}-{peer}"
    proc.stdin.write(f"{collective} {peer} {name}\n")
    proc.stdin.flush()
    answer = proc.stdout.readline().strip()  # (the server bounds each run: STALL / 2)
    assert answer == name, f"the fork server answered {answer!r} (exit status {proc.poll()})"
    rc, peer_alive = json.loads((outdir / f"{name}.json").read_text())
    return rc, (outdir / f"{name}.out").read_text(), (outdir / f"{name}.err").read_text(), peer_alive


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("peer", ["stall", "kill"])
@pytest.mark.parametrize("collective", list(COLLECTIVES))
def test_rank_exits_with_its_status_after_a_collective_fails(collective, peer, server):
    rc, out, err, peer_alive = _run_ranks(server, collective, peer)
    assert rc is not None, f"rank 0 had not exited after {STALL / 2} s: it waits for its peer\n{out}\n{err}"
    assert "terminate called" not in err, err
    assert rc == EXIT, f"exit status {rc}\nstdout:\n{out}\nstderr:\n{err}"
    assert "error: zero_offload: rank 0 of 2" in out and "not completed within" in out, out
    assert "sharded_state_dict: 4 entries" in out, out
    if peer == "stall":
        assert peer_alive, "rank 0 ended only after its peer had come back"


if __name__ == "__main__":
    if sys.argv[1] == "--serve":  # python tests/test_failure_exit.py --serve OUTDIR
        job = serve(sys.argv[2])
        if job is not None:  # a forked rank
            main(*job)
    else:  # one rank by hand: python tests/test_failure_exit.py RANK PORT COLLECTIVE
        main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

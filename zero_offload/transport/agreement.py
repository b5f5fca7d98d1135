"""Where ranks part ways, caught before gloo meets collectives of different sizes (which aborts the process): the
gradient statistics' all-reduce of a sharded step carries, per rank, where the rank is and a digest of the
settings it steps with, and each point where ranks can part (a backward's reduce-scatters, step()'s, state_dict())
begins with an all-reduce of the same size (:meth:`Agreement.check`); every rank raises the same error, naming
what differs."""

from __future__ import annotations

import contextlib
import hashlib
import struct
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from zero_offload.distributed import Comm, _dist

__all__ = ["ABANDONED", "Agreement", "BACKWARD", "CLIPPED_STEP", "FAILED", "PER_PARAMETER", "STATE_DICT", "STATS",
           "STEP_REDUCE", "differing", "digest", "digest_bytes", "meeting_on_failure"]

# The settings' entry (FSDP2) that carries a digest of each parameter's group's hyperparameters (see
# zero_offload.topology.members): named per parameter where it differs, not as a value.
PER_PARAMETER = "the hyperparameters of each parameter's param group, in FSDP's order"

# Where a rank is when it runs a collective of the statistics' size.
BACKWARD, STEP_REDUCE, STATS, CLIPPED_STEP, STATE_DICT, FAILED, ABANDONED = 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0


def _describe(phase: float, backwards: int) -> str:
    after = f"after {backwards} streamed backward{'s' if backwards != 1 else ''}"
    return {BACKWARD: f"in backward {backwards + 1} of this step, reduce-scattering its gradients",
            STEP_REDUCE: f"at step(), reduce-scattering the gradients backward did not send ({after})",
            STATS: f"at step() or clip_grad_norm_(), combining the gradient statistics ({after})",
            CLIPPED_STEP: f"at step() after clip_grad_norm_() ({after})",
            STATE_DICT: "in state_dict(), about to gather the state",
            FAILED: "raised at step() before its first collective (its own error says why: an invalid "
                    "hyperparameter there?)",
            ABANDONED: f"in zero_grad(), abandoning a backward that raised on this rank ({after})"}.get(
                phase, f"lost (phase {phase})")


@contextlib.contextmanager
def meeting_on_failure(met: Callable[[], int], meet: Callable[[], object]) -> Iterator[None]:
    """Around what a rank does at ``step()`` before it meets the other ranks: if it raises (a hyperparameter
    invalid on this rank, a refused gradient), it still meets them once (``meet``: marked as failed), so that they
    raise too, naming it, rather than wait for it until the process group times out; then its own error goes on.
    ``met`` counts the rank's meetings: one made inside the block (a redone ``clip_grad_norm_`` that raised: the
    others raised with it) leaves none to make. ``step()`` opens a new block after such a redo, so a failure after
    it meets the others' next one."""
    before = met()
    try:
        yield
    except Exception:
        if met() == before:
            meet()
        raise


def digest(settings: Sequence[Tuple[str, float]]) -> float:
    """A 48-bit digest of the settings' values, exact as a float64 (it travels in a float64 all-reduce)."""
    values = [float(v) for _, v in settings]
    return digest_bytes(struct.pack(f"<{len(values)}d", *values))


def digest_bytes(raw: bytes) -> float:
    """A 48-bit digest of ``raw``, exact as a float64."""
    return float(int.from_bytes(hashlib.blake2b(raw, digest_size=6).digest(), "little"))


def differing(settings: Sequence[Tuple[str, float]], rows: Sequence[Sequence[float]],
              ranks: Optional[Sequence[int]] = None) -> str:
    """The ``settings`` whose values differ between the ranks' ``rows`` (each rank's values, in their order; the
    rank of each row in ``ranks``, default its position), each with every rank's value, at most four named; empty
    where none does (their digests may still differ: 0.0 and -0.0 are equal values in other bits, and give the
    same update)."""
    ranks = range(len(rows)) if ranks is None else ranks
    diffs = [f"{name}: " + ", ".join(f"{row[j]!r} on rank {r}" for r, row in zip(ranks, rows))
             for j, (name, _) in enumerate(settings) if len({row[j] for row in rows}) > 1]
    return f"{'; '.join(diffs[:4])}{'; ...' if len(diffs) > 4 else ''}"


class Agreement:
    """The agreement checks of one sharded optimizer.

    Args:
        comm (Comm): the group's collectives.
        stats_numel (Callable[[], int]): the length of the statistics' all-reduce (the same on every rank).

    Attributes:
        backwards (int): how many streamed backwards this step has had on this rank (whose reduce-scatters have
            begun; counted by the transport, back to 0 when the step ends).
    """

    def __init__(self, comm: Comm, stats_numel: Callable[[], int]):
        self.comm, self._stats_numel = comm, stats_numel
        self.backwards = 0

    def tail(self, phase: float, settings: Sequence[Tuple[str, float]]) -> List[float]:
        """What the statistics' all-reduce ends with: per rank, a digest of ``settings``, then where the rank is
        (``phase``, and how many streamed backwards this step has had); zeros in the other ranks' places, so the
        sum holds every rank's."""
        world, rank = self.comm.world, self.comm.rank
        tail = [0.0] * (3 * world)
        tail[rank] = digest(settings)
        tail[world + 2 * rank], tail[world + 2 * rank + 1] = phase, float(self.backwards)
        return tail

    def check(self, phase: float, settings: Sequence[Tuple[str, float]], what: str, where: str,
              state: bool = False) -> None:
        """An all-reduce the size of the gradient statistics', carrying only :meth:`tail`: collectives of different
        sizes meeting each other abort gloo in C++ (``EnforceNotMet``, exit -6), so the points where ranks can part
        ways begin with this, which meets the same on the other ranks or the statistics' all-reduce; each rank
        raises if they are not at the same point."""
        vals = [0.0] * (self._stats_numel() - 3 * self.comm.world) + self.tail(phase, settings)
        tail = self.comm.all_reduce_host(vals, _dist().ReduceOp.SUM, f"the check before the {what} of {where}")
        tail = tail[len(tail) - 3 * self.comm.world :]
        self.check_phases(tail, what, where)
        self.check_settings(tail, settings, where, state)

    def failing(self) -> contextlib.AbstractContextManager:
        """:func:`meeting_on_failure` before the step's first collective: a failed rank meets the others' next
        one (of the statistics' size)."""
        return meeting_on_failure(lambda: self.comm.started, self._meet_failed)

    def _meet_failed(self) -> None:
        with contextlib.suppress(RuntimeError):  # (the others raise there; this rank's own error is the one)
            self.check(FAILED, (), "all_reduce", "the step")

    def check_phases(self, tail: List[float], what: str, where: str) -> None:
        world = self.comm.world
        at = [(tail[world + 2 * r], int(tail[world + 2 * r + 1])) for r in range(world)]
        if len(set(at)) == 1:
            return
        ranks = "; ".join(f"rank {r} is {_describe(*a)}" for r, a in enumerate(at))
        raise RuntimeError(
            f"zero_offload: rank {self.comm.rank} of {world}: {what} of {where} refused: the ranks are at different "
            f"collectives: {ranks}. Every rank must run each backward outside no_sync() the same number of times "
            "between steps, and call step(), clip_grad_norm_() and state_dict() together. Nothing was sent or "
            "updated; the ranks are still in step (call zero_grad() on every rank to go on)."
        )

    def check_settings(self, tail: List[float], settings: Sequence[Tuple[str, float]], where: str,
                       state: bool = False) -> None:
        """Raise on every rank, naming what differs and where, unless every rank's digest is the same (the values
        are exchanged only then: every rank sees the same digests, so every rank takes the same path)."""
        world, rank = self.comm.world, self.comm.rank
        if len(set(tail[:world])) == 1:
            return
        n = len(settings)
        mine = [0.0] * (world * n)
        mine[rank * n : (rank + 1) * n] = [float(v) for _, v in settings]
        every = self.comm.all_reduce_host(mine, _dist().ReduceOp.SUM, "the values that differ, to name them")
        listed = differing(settings, [every[r * n : (r + 1) * n] for r in range(world)])
        if not listed:
            return
        if state:
            raise RuntimeError(
                f"zero_offload: rank {rank} of {world}: the ranks hold different state buffers ({where}): {listed}. "
                "Their state cannot be gathered (a state dict with amsgrad loaded on some ranks only?); every rank "
                "must load the same one. Nothing was gathered."
            )
        raise RuntimeError(
            f"zero_offload: rank {rank} of {world}: the ranks step with different hyperparameters ({where}): "
            f"{listed}. Each rank's shard would be updated with its own and the all-gather would hide it: every "
            "rank must use the same (an LR scheduler stepped on one rank only?). Nothing was updated."
        )

    def check_clipping(self, clipping_ranks: int, clipping: bool) -> None:
        """``clip_grad_norm_`` gathers the gradients itself, so a rank that clips meets the others' ``step()`` in
        the statistics' all-reduce: every rank clips, or none does, or each raises here with nothing updated."""
        if 0 < clipping_ranks < self.comm.world:
            raise RuntimeError(
                f"zero_offload: rank {self.comm.rank} of {self.comm.world}: clip_grad_norm_ was called on "
                f"{clipping_ranks} of {self.comm.world} ranks for this step (this rank: "
                f"{'clip_grad_norm_' if clipping else 'step'}). Every rank must call it, or none. Nothing was updated."
            )

"""The transport of an optimizer over FSDP2's sharded parameters (:class:`FSDPTransport`, see
:mod:`zero_offload.fsdp2`): each bucket holds the local shards of one FSDP unit's parameters, and FSDP does every
collective (all-gather, reduce-scatter). What is left to this transport:

* the gradients: each ``p.grad`` is a DTensor; its local shard is what the bucket's route reads (the owners'
  gradients are handed to the local shards before anything reads them, and released with them);
* the measurements: a norm or an inf/nan anywhere is a fact of the whole mesh, so the gradient statistics the step
  decides on are exchanged over the whole mesh (:meth:`~zero_offload.topology.mesh.Mesh.exchange`: every rank's
  small row gathered over the whole mesh once a step, replicas and tensor-parallel peers included; on a CPU mesh on
  a gloo group of its own that no FSDP collective can pair with, so a peer elsewhere, not running this optimizer, is
  named after the mesh's timeout; it also carries every rank's hyperparameters: ranks that differ raise on every
  rank): every rank decides alike; the norm is the sum of every rank's counted pieces (a piece replicated over some
  mesh dimensions, HSDP's replicas or a tensor-parallel ``Replicate()``, is counted by one of the ranks holding it:
  :attr:`~zero_offload.topology.mesh.Mesh.counted`); and which parameters have a gradient: ranks that differ (a
  ``.grad`` set to None on some ranks only) raise on every rank, naming the first such parameter, where AdamW would
  step each rank's shards of it or not, silently;
* edits after a gradient was streamed: a ``foreach`` op on DTensor gradients bumps no version counter (neither the
  DTensor's nor its local tensor's; ``torch.nn.utils.clip_grad_norm_`` scales them with ``_foreach_mul_``), so the
  version check that finds such an edit on plain tensors sees nothing here. Each streamed gradient's norm is kept
  at its copy and compared bit for bit at every ``step()`` (:mod:`~zero_offload.transport.edits`): one that
  differs is read again. (An edit that keeps every gradient's norm, a sign flip or a permutation through a
  ``foreach`` op, is not seen.)

Routes: on a GPU, :class:`~zero_offload.transport.device.OffloadRoute` itself (gradients down from FSDP's hooks, in
the reduce-scatter stream's context, the updated shard up into ``p.to_local()``), or, for a bucket stepped on its GPU
(``placement`` ``"resident"`` or ``"parked"``), the routes of one GPU,
:class:`~zero_offload.transport.device.DeviceTierRoute` and :class:`~zero_offload.transport.parked.ParkedRoute`: the
storage FSDP keeps for each shard is moved into its slot on the GPU (:func:`zero_offload.fsdp2.bind_shard`: an fp32
shard is its own master, a bf16/fp16 one the staging slot the fused update writes), the local gradients are read
where FSDP left them, the state updated on the GPU (a parked bucket's moments brought up from FSDP's hooks, once its
unit's reduce-scatter made its gradients final), and FSDP's next all-gather reads what the update wrote: nothing is
copied after it. Where FSDP keeps a shard in a way that cannot be taken over, :class:`FSDPDeviceRoute` and
:class:`FSDPParkedRoute`: a separate master, the new values copied into ``p.to_local()`` on the GPU. On the host (a
CPU mesh, or ``CPUOffloadPolicy``), :class:`~zero_offload.transport.host.HostRoute`: the storage FSDP keeps for each shard is
moved into its slot (:func:`zero_offload.fsdp2.bind_shard`), gradients are read where FSDP left them, and the kernel
writes the shard itself: no second host copy of the parameters, no copy after the update. Where FSDP keeps a host
shard in a way that cannot be taken over (:func:`zero_offload.fsdp2.takeover`), :class:`FSDPHostRoute`: a separate
master, the update copied into the shard.

The local shards' ``.grad`` (set from their DTensor's at ``step()``) are let go with the step, so no gradient
outlives it (``zero_grad()`` clears the DTensors' own).
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, List, NamedTuple, Optional, Sequence, Tuple

import torch

from zero_offload.buckets import FlatBucket
from zero_offload.lane import Intake, Lane, Plans, SqNorm
from zero_offload.transport.agreement import PER_PARAMETER, differing, digest, digest_bytes, meeting_on_failure
from zero_offload.transport.base import Gathered, Route, Transport
from zero_offload.transport.device import DeviceTierRoute, OffloadRoute
from zero_offload.transport.host import HostRoute
from zero_offload.transport.measure import Norm, every, first_nonfinite, name_held, sq_norm_by_dtype
from zero_offload.transport.parked import ParkedRoute

if TYPE_CHECKING:  # (annotations only)
    from zero_offload.topology.mesh import Mesh

__all__ = ["FSDPDeviceRoute", "FSDPHostRoute", "FSDPParkedRoute", "FSDPTransport", "Row"]

# Where a rank is when it meets the others (a slot of every exchange's row).
STEP, CLIP, AFTER_CLIP = 1.0, 2.0, 3.0
_WHERE = {STEP: "at step()", CLIP: "in clip_grad_norm_()", AFTER_CLIP: "at step() after clip_grad_norm_()"}


class Row(NamedTuple):
    """One rank's part of the step's exchange over the mesh (:meth:`FSDPTransport._meet`)."""

    sq: float  # its shards' sum of squares (where clipping asked for it)
    bad: float  # 1.0: a gradient of its shards holds an inf/nan
    phase: float  # where it is: STEP, CLIP or AFTER_CLIP
    alive: float  # 0.0: it raised before the exchange
    settings: float  # a digest of the settings it steps with
    present: float  # a digest of which parameters have a gradient
    rank: int  # its global rank

    @staticmethod
    def of(values: Sequence[float]) -> "Row":
        return Row(*values[:-1], int(values[-1]))


class _IntoShards:
    """Local shards in FSDP's storage (not taken over): the update's results (:meth:`new_values`) copied into them,
    after the update (on the compute stream for a GPU stepped there)."""

    @staticmethod
    def new_values(bucket: FlatBucket) -> List[torch.Tensor]:
        """Per parameter, where the update left its new value: the master's slots, or the staging copy's."""
        return bucket.home.results()

    def upload(self, lane: Lane, indices: Sequence[int], srcs: Optional[Sequence[torch.Tensor]]) -> None:
        bucket = lane.bucket
        srcs = self.new_values(bucket) if srcs is None else srcs
        with torch.no_grad():
            torch._foreach_copy_([bucket.params[i] for i in indices], [srcs[i] for i in indices])


class FSDPHostRoute(_IntoShards, HostRoute):
    """Local shards on the host whose storage is FSDP's: gradients read in place; the update (a separate master)
    copied into the shard."""

    upload_reads = True

    def bind(self, lane: Lane) -> None:
        """Nothing is bound: the masters are taken from the shards at their first update."""

    @staticmethod
    def new_values(bucket: FlatBucket) -> List[torch.Tensor]:
        return bucket.upload_views  # (a low-precision bucket's kernel may write them into its gradient buffer)


class FSDPDeviceRoute(_IntoShards, DeviceTierRoute):
    """Local shards on a GPU, their state resident there (``placement="resident"``, ``gpu_fraction``)."""


class FSDPParkedRoute(_IntoShards, ParkedRoute):
    """Local shards on a GPU, their state parked on the host and brought up from FSDP's hooks."""


class FSDPTransport(Transport):
    """The transport of FSDP2's local shards (see the module docstring).

    Args:
        topology (Mesh): the mesh the parameters are on (its collectives carry the step's exchange).
        release (bool): as for :class:`~zero_offload.transport.base.Transport`.
    """

    unversioned_edits = True  # (foreach ops on DTensor gradients: see the module docstring)

    def __init__(self, topology: "Mesh", *, release: bool):
        super().__init__(release=release)
        self.topology = topology
        self.overflowed = False  # whether the step's exchange met a rank marked bad (see measure)

    def route_for(self, bucket: FlatBucket) -> Route:
        if bucket.on_cpu:  # (resident: the shards' storage taken over, the kernel writes what FSDP's all-gather reads)
            return self.route(HostRoute if bucket.resident else FSDPHostRoute)
        # A GPU home that took the shards' storage over is stepped as on one GPU (the fused update writes what
        # FSDP's all-gather reads); one that could not copies each update into the shards.
        routes = (({"resident": DeviceTierRoute, "parked": ParkedRoute} if bucket.masters.takeovers is not None
                   else {"resident": FSDPDeviceRoute, "parked": FSDPParkedRoute}))
        return self.route(routes.get(bucket.home.kind, OffloadRoute))

    @staticmethod
    def _take_grads(lane: Lane) -> None:
        """Hand the owners' gradients (DTensors) to the local shards the route reads. A gradient whose local part
        is not shaped like the local shard (a DTensor gradient built by hand) is refused, naming the parameter with
        its whole shape (torch's own error would name the shard's alone)."""
        bucket = lane.bucket
        for i, (p, owner) in enumerate(zip(bucket.params, bucket.owners)):
            g = owner.grad
            local = None if g is None else g.to_local()
            if local is not None and local.shape != p.shape:
                raise RuntimeError(
                    f"OffloadOptimizer: {bucket.shaped_label(i)} has a gradient whose part on this rank has shape "
                    f"{tuple(local.shape)} (a DTensor gradient of shape {tuple(g.shape)}, placed "
                    f"{tuple(g.placements)}); nothing was updated")
            p.grad = local

    def send_grads(self, lane: Lane) -> None:
        self._take_grads(lane)
        super().send_grads(lane)
        if self.release and not lane.route.reads_in_place:  # (a parked bucket's are read at step(), where they are)
            for owner in lane.bucket.owners:
                owner.grad = None

    def collect(self, lane: Lane) -> List[Optional[torch.Tensor]]:
        bucket = lane.bucket
        bucket.home.check_in_place()  # (before the gradients are handed to shards that may have moved)
        self._take_grads(lane)
        return bucket.grads.collect()

    def reset(self) -> None:
        super().reset()
        for lane in self.lanes:
            for p in lane.bucket.params:
                p.grad = None

    def gather(self, plans: Plans, check: bool = False, clipping: bool = False,
               settings: Sequence[Tuple[str, float]] = ()) -> Gathered:
        """The local gather, then the statistics of the whole mesh: its sum of squares and whether any rank's
        shard holds an inf/nan, with every rank's ``settings`` (the step's hyperparameters and ``nonfinite``
        policy) and which of its parameters have a gradient, in one small all-gather (:meth:`_meet`): a rank that
        steps with other settings than the others, or other parameters (a ``.grad`` set to None on some ranks
        only: each rank would step the shards it has gradients for, as AdamW does, and FSDP's all-gather would join
        a parameter updated on some ranks only), makes every rank raise, naming them, before anything is
        updated."""
        phase = CLIP if clipping else STEP
        with self._failing(phase):
            plans, bad = super().gather(plans, check=check)[:2]
            sq, local_bad = self._local_sq(plans) if clipping else (0.0, bad)
        present = bytes(bytearray(has for intake in every(plans) for has in intake.present))
        rows = self._meet(phase, settings, sq, local_bad, digest_bytes(present))
        # (A rank marked bad skips the step with every rank: its GradScaler's overflow, see measure, gives no
        # presence; an inf/nan the intake found refuses or skips the step.)
        self.overflowed = any(row.bad > 0 for row in rows)
        if not self.overflowed and len({row.present for row in rows}) > 1:
            self._refuse_presence(plans, present, rows)
        sq = sum(row.sq for row in rows)  # (each piece counted by one rank: see _local_sq)
        self.stats = SqNorm(sq, any(row.bad > 0 for row in rows) or not math.isfinite(sq))
        return Gathered(plans, check and self.stats.nonfinite)

    def agree(self, settings: Sequence[Tuple[str, float]]) -> None:
        """``step()`` after ``clip_grad_norm_`` (which gathered the statistics): the settings alone."""
        self.overflowed = any(row.bad > 0 for row in self._meet(AFTER_CLIP, settings))

    def measure(self, plans: Plans, settings: Sequence[Tuple[str, float]], check: bool,
                clip: Optional[Any] = None, overflow: bool = False) -> Gathered:
        """As the transport's, and a GradScaler's verdict made the mesh's: torch's own check of DTensor gradients
        (``_amp_foreach_non_finite_check_and_unscale_``) takes the max of ``found_inf`` over the dimension the
        shards are cut along only, so under HSDP a replica whose gradients hold an inf/nan (one edited after
        FSDP's all-reduce) finds one where the others do not. A rank that found one meets the others' exchange
        anyway, marked ``bad`` (the others find no inf of their own there: their scaler checked, the intake did
        not), and every rank skips: the others are told so by ``overflow``."""
        if overflow:
            self._meet(AFTER_CLIP if clip is not None else STEP, settings, bad=True)
            return Gathered(plans, False, True)
        self.overflowed = False
        gathered = super().measure(plans, settings, check, clip)
        return gathered._replace(overflow=self.overflowed)

    def together(self, skipped: bool = False) -> contextlib.AbstractContextManager:
        # (A rank whose GradScaler found an inf/nan, ``skipped``, meets the others too: see measure.)
        return self._failing(STEP)

    def _failing(self, phase: float) -> contextlib.AbstractContextManager:
        """:func:`~zero_offload.transport.agreement.meeting_on_failure` before the exchange of ``phase``."""
        return meeting_on_failure(lambda: self.topology.exchanges, lambda: self._meet(phase, (), failed=True))

    def _meet(self, phase: float, settings: Sequence[Tuple[str, float]], sq: float = 0.0, bad: bool = False,
              present: float = 0.0, failed: bool = False) -> List[Row]:
        """Every rank's :class:`Row` (its ``present`` checked by the caller), one all-gather of the same size at
        every point where ranks meet, so that ranks at different points, or failed, or with other settings are told
        apart. Every rank sees the same rows and so raises alike (a ``failed`` rank returns: its own error
        follows); the values of differing settings are exchanged only then, to name them."""
        rows = [Row.of(values) for values in self.topology.exchange(
            [sq, float(bad), phase, 0.0 if failed else 1.0, 0.0 if failed else digest(settings), present])]
        down = [row for row in rows if row.alive == 0.0]
        phases = [row.phase for row in rows]
        if failed or (not down and len(set(phases)) == 1 and len({row.settings for row in rows}) == 1):
            return rows  # (every step: nothing more to look up)
        where = self.topology.where(rows)
        if down:
            raise RuntimeError(
                f"{where}: " + "; ".join(f"rank {row.rank} raised {_WHERE.get(row.phase, row.phase)}" for row in down)
                + " before the ranks compared their gradient statistics (its own error says why: an invalid "
                "hyperparameter there?). Nothing was updated on any rank; the ranks are still in step.")
        if len(set(phases)) > 1:
            raise RuntimeError(
                f"{where}: the ranks are at different points: "
                + "; ".join(f"rank {row.rank} {_WHERE.get(row.phase, row.phase)}" for row in rows)
                + ". Every rank must call clip_grad_norm_() (or not) and step() together. Nothing was updated.")
        if len({row.settings for row in rows}) > 1:
            self._name_settings(settings, where)
        return rows

    def _name_settings(self, settings: Sequence[Tuple[str, float]], where: str) -> None:
        """The ranks' settings differ (their digests did): exchange them and raise, naming those that differ; where
        only the per-parameter digest differs, or the ranks have different numbers of settings (of param groups),
        the first parameter whose group's hyperparameters differ is named
        (:meth:`~zero_offload.topology.members.Members.name_difference`)."""
        rows = self._exchange_listed([float(v) for _, v in settings], where, None)
        if rows is not None:
            per = [j for j, (name, _) in enumerate(settings) if name == PER_PARAMETER]
            rows = [[0.0 if j in per else x for j, x in enumerate(row)] for row in rows]  # (named below instead)
            listed = differing(settings, rows, [_rank(row) for row in rows])
            if listed:
                raise RuntimeError(
                    f"{where}: the ranks step with different hyperparameters or options: {listed}. Each rank would "
                    "update its shards with its own, and FSDP's all-gather would join them: every rank must use the "
                    "same (an LR scheduler stepped on one rank only?). Nothing was updated.")
        if any(name == PER_PARAMETER for name, _ in settings):
            self.topology.members.name_difference(lambda values, what: self._exchange_listed(values, where, what),
                                                  where)
        if rows is None:
            self._exchange_listed([float(v) for _, v in settings], where, "settings (a param group added on some "
                                  "ranks only?)")

    def _refuse_presence(self, plans: Plans, present: bytes, rows: List[Row]) -> None:
        """The ranks' gradients are on different parameters (their digests in ``rows`` differed): exchange which,
        and raise on every rank naming the first parameter that has a gradient on some ranks only."""
        where = self.topology.where(rows)
        rows = self._exchange_listed([float(has) for has in present], where, "parameters (another model?)")
        k = next(k for k in range(len(present)) if len({row[k] for row in rows}) > 1)  # (the digests differed)
        bucket, i = [(intake.bucket, i) for intake in every(plans) for i in range(len(intake.present))][k]
        having = [_rank(row) for row in rows if row[k]]
        lacking = [_rank(row) for row in rows if not row[k]]
        raise RuntimeError(
            f"{where}: the ranks have gradients for different parameters: {bucket.label(i)} of shape "
            f"{tuple(bucket.owners[i].shape)} has one on rank(s) {having} and none on rank(s) {lacking} (its "
            ".grad set to None on some ranks only?). Each rank would update only the shards it has gradients for, "
            "and FSDP's all-gather would join a parameter updated on some ranks only: every rank must step the same "
            "parameters. Nothing was updated.")

    def _exchange_listed(self, values: List[float], where: str, what: Optional[str]) -> Optional[List[List[float]]]:
        """:meth:`Mesh.exchange` of lists whose lengths may differ between the ranks (the values of what their
        digests found different): the lengths first, and a ``RuntimeError`` on every rank naming ``what`` where
        they differ (``what`` None: None is returned then)."""
        lengths = [int(row[0]) for row in self.topology.exchange([float(len(values))])]
        if len(set(lengths)) > 1:
            if what is None:
                return None
            raise RuntimeError(f"{where}: the ranks step with different numbers of {what} ({lengths}, by rank). "
                               "Nothing was updated.")
        return self.topology.exchange(values)

    def describe_nonfinite(self, plans: Plans, names: Sequence[Optional[Sequence[str]]]) -> str:
        """As the transport's, but every rank names the same parameter, with its whole shape and the rank whose shard
        holds the inf/nan (:func:`~zero_offload.transport.measure.name_held`; a collective: every rank refuses the
        step alike)."""
        found = first_nonfinite(plans)
        rows = self.topology.exchange([-1.0, -1.0] if found is None else [float(found.group), float(found.index)])
        return name_held([(int(row[0]), int(row[1]), _rank(row)) for row in rows if row[0] >= 0], plans, names)

    def _local_sq(self, plans: Plans) -> Tuple[float, bool]:
        """This rank's part of the total squared 2-norm, and whether one of its gradients is inf/nan: the pieces it
        counts (:attr:`~zero_offload.topology.mesh.Mesh.counted`: a piece replicated over some mesh dimensions is
        counted by one of the ranks holding it), so that the sum over the mesh counts each element once. A bucket
        whose parameters are all counted here is measured as any (its norm streamed from the GPU where it was); the
        others are read on the host, parameter by parameter, the uncounted ones checked for inf/nan only."""
        if self.topology.counts_all:
            norm, bad = super().total_norm(plans, 2.0)
            return norm * norm, bad
        whole, split = [], []
        for intake in every(plans):
            (split if not all(self._counted(intake)) else whole).append(intake)
        norm, bad = super().total_norm([whole], 2.0)
        sq = norm * norm
        if split:
            self.wait_all([split])
            counted, other = self._views(split)
            s, b = sq_norm_by_dtype(counted)
            sq, bad = sq + s, bad or b or sq_norm_by_dtype(other).nonfinite
        return sq, bad

    def _counted(self, intake: Intake) -> List[bool]:
        """Whether this rank counts each parameter of ``intake``'s bucket in the total norm."""
        counted = self.topology.counted[intake.bucket.group]
        return [counted[j] for j in intake.bucket.layout.indices]

    def _views(self, intakes: Sequence[Intake]) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """The gathered gradients of ``intakes`` this rank counts in the total norm, and the others (non-empty,
        present ones only)."""
        counted: List[torch.Tensor] = []
        other: List[torch.Tensor] = []
        for intake in intakes:
            grads = intake.bucket.grads
            if intake.in_place is None and not grads.allocated:
                continue  # (no gradient this step: see Intake.host_grads)
            views = grads.grad_views if intake.in_place is None else intake.in_place
            for has, mine, g in zip(intake.present, self._counted(intake), views):
                if has and g is not None and g.numel():
                    (counted if mine else other).append(g)
        return counted, other

    def total_norm(self, plans: Plans, norm_type: float) -> Norm:
        """``clip_grad_norm_``'s total norm over the mesh: the 2-norm from the last :meth:`gather`, other norms
        with one more all-reduce (an empty shard adds nothing: torch's own clip fails there for the inf-norm; a
        p-norm's sum takes the pieces this rank counts, as :meth:`_local_sq`)."""
        if norm_type == 2.0:
            return Norm(math.sqrt(self.stats.sq), self.stats.nonfinite)
        self.wait_all(plans)
        counted, other = self._views(every(plans))
        if norm_type == math.inf:
            local = max((float(t.abs().max()) for t in counted + other), default=0.0)
            value = self.topology.reduce([local], torch.distributed.ReduceOp.MAX)[0]
        else:
            local = sum(float(torch.linalg.vector_norm(t.double(), norm_type)) ** norm_type for t in counted)
            value = self.topology.reduce([local], torch.distributed.ReduceOp.SUM)[0] ** (1.0 / norm_type)
        return Norm(value, self.stats.nonfinite or not math.isfinite(value))


def _rank(row: Sequence[float]) -> int:
    """The global rank an exchanged row came from (see :meth:`~zero_offload.topology.mesh.Mesh.exchange`)."""
    return int(row[-1])

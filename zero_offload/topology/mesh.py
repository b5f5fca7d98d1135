"""The topology of FSDP2's sharded parameters (:class:`Mesh`): each parameter a ``DTensor`` on one device mesh,
``Shard(0)`` on a 1-D mesh (FSDP) or ``(Replicate(), Shard(0))`` on a 2-D mesh (HSDP: the shards replicated over
the first dimension, every replica updating its shard alike). What the mesh means is said here and nowhere else:
which placements are taken, this rank's part of a parameter (its local shard) and of a loaded value, the mesh's
collectives the step makes (an exchange of every rank's small row over the whole mesh, and a reduction over the
dimension the shards are cut along, which counts each element once), and the total norm as a ``DTensor``
replicated over the mesh. FSDP2's own records (which parameters it manages, the storage it keeps for a shard) are
:mod:`zero_offload.fsdp2`'s; the step's protocol over these collectives is the FSDP2 transport's
(:mod:`zero_offload.transport.fsdp2`).

``torch.distributed`` is imported only once a ``DTensor`` parameter is given: ``import zero_offload`` stays cheap.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload import fsdp2
from zero_offload import distributed
from zero_offload.distributed import _LET_GO_SECONDS, _Held, _keep_forever
from zero_offload.options import Options, agreed_settings, check_params
from zero_offload.topology.members import Members
from zero_offload.topology.base import Placement, Topology, _with_margin

if TYPE_CHECKING:  # (annotations only)
    from zero_offload.transport.base import Transport

__all__ = ["Mesh"]

_OTHER_PLACEMENTS = ("Tensor parallelism and other placements are not supported: shard the model with fully_shard "
                     "alone (or keep torch.optim.AdamW for it)")


class Mesh(Topology):
    """FSDP2's parameters on one device mesh (see the module docstring).

    Args:
        managed (dict, optional): FSDP2's registry as the constructor read it (:func:`zero_offload.fsdp2.take`);
            None: read when a group is placed.

    Attributes:
        mesh (DeviceMesh): the parameters' mesh, and ``shard_dim`` the dimension their shards are cut along (1
            under HSDP, whose dimension 0 replicates); set by the first group placed.
    """

    alone = False

    def __init__(self, managed: Optional[Dict[int, Tuple[int, Any, int]]] = None):
        self.managed = managed
        self.mesh: Any = None
        self.shard_dim = 0
        self.exchanges = 0  # exchanges with the other ranks so far (see FSDPTransport._failing)
        self.members = Members()

    def options(self, options: Options) -> Options:
        # FSDP runs the hooks after each unit's reduce-scatter: the gradients are final there.
        return dataclasses.replace(options, outside_world=1)

    def transport(self, options: Options) -> "Transport":
        from zero_offload.transport.fsdp2 import FSDPTransport

        return _with_margin(FSDPTransport(self, release=options.release_grads), options)

    def place(self, tensors: Sequence[torch.Tensor], index: int, layout: Tuple[Tuple[str, Any], ...]) -> Placement:
        """Each rank's buckets hold its local shards, cut at FSDP's units (FSDP does every collective)."""
        check_params(tensors, fsdp=True)
        placed = self.plan(tensors)
        managed = fsdp2.registry() if self.managed is None else self.managed
        self.members.add(index, tensors, [managed[id(p)][2] for p in tensors], dict(layout))
        return placed

    def settings(self, hypers: Sequence[Any], nonfinite: str,
                 clip: Optional[Tuple[float, float]] = None) -> List[Tuple[str, float]]:
        """As every topology's, and what else changes the arithmetic of a parameter's update on a rank: the
        options that do (``state_dtype``) and, per parameter in FSDP's order, its group's hyperparameters (a
        parameter in another param group on some ranks: each group's alike, the parameter's update not);
        :meth:`Members.name_difference` names what differs."""
        return [*agreed_settings(hypers, nonfinite, clip), *self.members.settings(hypers)]

    def plan(self, params: Sequence[torch.Tensor]) -> Placement:
        """Check that ``params`` are FSDP2's, all on this topology's mesh and cut alike; their local shards, each
        one's FSDP unit and :func:`~zero_offload.fsdp2.takeover`. Raises ``TypeError`` naming what cannot be taken
        (a plain parameter among them, another placement, a DTensor FSDP does not manage)."""
        plain = [p for p in params if not fsdp2.is_dtensor(p)]
        if plain:
            mixed = "a param group mixes" if len(plain) < len(params) else "the param groups mix"
            raise TypeError(
                f"OffloadOptimizer: {mixed} FSDP2's sharded parameters (DTensors) with plain ones (shape "
                f"{tuple(plain[0].shape)}): every parameter of the model must be sharded with fully_shard (wrap the "
                "root module too: fully_shard(model)), or none")
        managed = fsdp2.registry() if self.managed is None else self.managed
        units, mesh, shard_dim = [], self.mesh, self.shard_dim
        for p in params:
            dim = self._shard_dim(p, managed)
            if mesh is None:
                mesh, shard_dim = p.device_mesh, dim
            elif mesh != p.device_mesh or shard_dim != dim:
                raise TypeError("OffloadOptimizer: the FSDP2 parameters are on different device meshes (or cut along "
                                "different dimensions); build one optimizer per mesh")
            units.append(managed[id(p)][0])
        self.mesh, self.shard_dim = mesh, shard_dim  # (only once every parameter was taken)
        return Placement(data=[fsdp2.local_shard(p) for p in params], units=units,
                         takeovers=[fsdp2.takeover(p, managed[id(p)][1]) for p in params])

    @staticmethod
    def _shard_dim(p: torch.Tensor, managed: Dict[int, Tuple[int, Any, int]]) -> int:
        """The mesh dimension ``p``'s shards are cut along, for a placement this topology takes (else the error)."""
        from torch.distributed.tensor import Replicate, Shard

        placements, ndim = tuple(p.placements), p.device_mesh.ndim
        if ndim == 1 and placements == (Shard(0),):
            shard_dim = 0
        elif ndim == 2 and placements == (Replicate(), Shard(0)):
            shard_dim = 1
        elif id(p) in managed and (ndim == 1 or placements[0] == Replicate()):  # (shard_placement_fn)
            raise _placement_error(p, "FSDP2 shards it along another dimension (shard_placement_fn)",
                                   "Shard it along dimension 0 (shard_placement_fn returning None for it), or keep "
                                   "torch.optim.AdamW for this model")
        else:
            raise _placement_error(p, "not a placement FSDP2 gives")
        if id(p) not in managed:
            raise _placement_error(p, "FSDP2 does not manage it (tensor parallelism gives the same placements)")
        return shard_dim

    def built(self) -> None:
        self.managed = None  # (FSDP2's registry: every FSDP model of the process, collected or not)

    def adopt_switched(self, opt: Any) -> None:
        """Over FSDP2's parameters already: nothing to adopt."""

    # -- what a rank holds -----------------------------------------------------------------------------------------
    def norm_value(self, norm: torch.Tensor, param_groups: Sequence[Dict[str, Any]]) -> torch.Tensor:
        """``norm`` (the same on every rank) as a DTensor replicated over the mesh, on the device of the first
        parameter: what ``torch.nn.utils.clip_grad_norm_`` returns for FSDP2's gradients, so ``.full_tensor()``,
        ``.to_local()`` and ``.item()`` read the total norm either way."""
        from torch.distributed.tensor import DTensor, Replicate

        owner = next(p for g in param_groups for p in g["params"] if fsdp2.is_dtensor(p))
        mesh = owner.device_mesh
        return DTensor.from_local(norm.to(owner.device), mesh, [Replicate()] * mesh.ndim, run_check=False)

    def local_value(self, value: Any, owner: torch.Tensor) -> Any:
        """A loaded state value for the parameter ``owner``, as its local shard: a DTensor's own (placed like the
        parameter), or, for a plain tensor of the parameter's full shape (a checkpoint of an unsharded model), the
        rows this rank holds (FSDP2 cuts dimension 0 as ``torch.chunk`` does). Anything else is returned as it is
        (and refused by the caller's checks). A DTensor whose local shard is not this rank's shape (one that another
        rank saved with ``torch.save``, or a rank at another world size) is refused, and so is one that holds other
        rows of the parameter than this rank's although its shape is the same: a DTensor unpickled from another
        rank's ``torch.save`` keeps the mesh shape and the mesh coordinate of the rank that saved it."""
        if fsdp2.is_dtensor(value):
            if tuple(value.placements) != tuple(owner.placements) or value.shape != owner.shape:
                raise ValueError(f"a state DTensor placed {tuple(value.placements)} with shape {tuple(value.shape)} "
                                 f"for a parameter placed {tuple(owner.placements)} with shape {tuple(owner.shape)}")
            saved, here = value.device_mesh, owner.device_mesh
            if tuple(saved.shape) != tuple(here.shape):
                raise ValueError(f"the state DTensor was saved on a mesh of shape {tuple(saved.shape)}, the parameter "
                                 f"is on one of shape {tuple(here.shape)}: a state dict saved at another world size "
                                 f"and loaded with torch.load? {_USE_DCP}")
            theirs, ours, cut = saved.get_coordinate(), here.get_coordinate(), here.ndim - 1
            if theirs is not None and ours is not None and theirs[cut] != ours[cut]:
                raise ValueError(
                    f"this rank's shard of the state DTensor holds rows {_rows(owner, theirs)} of the parameter "
                    f"(saved at mesh coordinate {tuple(theirs)}), this rank holds rows {_rows(owner, ours)} (mesh "
                    f"coordinate {tuple(ours)}): a state dict saved by another rank and loaded with torch.load? "
                    f"{_USE_DCP}")
            local, mine = value.to_local(), owner.to_local()
            if local.shape != mine.shape:
                raise ValueError(
                    f"this rank's shard of the state DTensor has shape {tuple(local.shape)}, its shard of the "
                    f"parameter {tuple(mine.shape)}: a state dict saved by another rank (or at another world size) and "
                    f"loaded with torch.load? {_USE_DCP}")
            return local
        if isinstance(value, torch.Tensor) and value.dim() and value.shape == owner.shape:
            mesh = owner.device_mesh
            shard_dim = mesh.ndim - 1
            rank, world = mesh.get_local_rank(shard_dim), mesh.size(shard_dim)
            chunks = torch.chunk(value, world, dim=0)
            if rank < len(chunks):
                return chunks[rank]
            return value.narrow(0, 0, 0)
        return value

    def check_flat_checkpoint(self, method: str) -> None:
        raise TypeError(
            f"opt.{method}() is the flat checkpoint format of a process_group's (or one process's) buckets; under "
            "FSDP2 the optimizer's state_dict() is already sharded, as DTensors placed like the parameters: save it "
            "with torch.distributed.checkpoint, dcp.save(get_optimizer_state_dict(model, opt)), and load it with "
            "dcp.load then set_optimizer_state_dict(model, opt, ...) (see docs/multi-gpu.md)")

    # -- the mesh's collectives ------------------------------------------------------------------------------------
    @property
    def group(self) -> Any:
        """The process group of the dimension the shards are cut along: a sum over it counts each element once."""
        return self.mesh.get_group(mesh_dim=self.shard_dim)

    @property
    def replicas(self) -> Optional[Any]:
        """Under HSDP, the process group of this rank's replicas (mesh dimension 0); else None."""
        return self.mesh.get_group(mesh_dim=0) if self.mesh.ndim == 2 else None

    def exchange(self, values: List[float]) -> List[List[float]]:
        """Every rank's ``values`` (of one length on every rank) and its global rank (the last of each row), over
        the whole mesh, replica by replica, each replica's rows in shard order (:meth:`replica`): one all-gather of
        host tensors over a gloo group of the mesh's ranks that carries nothing else (:func:`exchange_group`).

        Not over the mesh's own groups: there, a rank that is elsewhere (one running ``torch.optim.AdamW`` by a
        config typo, already in the next forward's all-gather) would pair this all-gather with FSDP's collective,
        and gloo aborts the process whose buffer is the smaller (``terminate called ... gloo::EnforceNotMet``), or
        both go on with each other's bytes. On its own group the exchange meets only other optimizers' exchanges,
        and waits for them at most the mesh's timeout, then raises naming why (the rank that is elsewhere is not
        touched: its next collective waits for this rank, and times out, with a Python exception).

        On a GPU mesh (NCCL, which checks no sizes: no abort, but no error either) the exchange stays on the mesh's
        own groups, on the device: one all-gather over the dimension the shards are cut along and under HSDP one
        more over the replicas (a gloo group there would put a TCP ring on every step, unmeasured on GPUs); so it
        does on a torch without ``Tensor._use_count`` (2.3), which cannot hold the host tensors safely (see
        :class:`zero_offload.distributed._Held`)."""
        dist = torch.distributed
        self.exchanges += 1
        if self.mesh.device_type != "cpu" or distributed._use_count is None:
            return self._exchange_on_device(values)
        ranks = tuple(int(r) for r in self.mesh.mesh.flatten().tolist())  # (global ranks, replica by replica)
        mine = torch.tensor([*values, float(dist.get_rank())], dtype=torch.float64)
        rows = mine.new_empty(len(ranks) * mine.numel())
        timeout = _timeout(self.group, self.mesh.device_type)
        # (Held until gloo's worker has let go of them, or kept for good: see zero_offload.distributed._Held.)
        held = _Held([rows, mine])
        try:
            group = exchange_group(ranks, timeout)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            held.work = gather(rows, mine, group=group, async_op=True)
            held.work.wait(timeout)
        except RuntimeError as exc:
            _GROUPS.pop(ranks, None)  # (a group whose collective failed is not used again)
            if held.work is not None:
                _keep_forever(held)
            raise RuntimeError(
                f"zero_offload: rank {dist.get_rank()} ({len(ranks)} ranks in the FSDP2 mesh): the step's exchange "
                f"with the other ranks of the mesh failed or did not complete within {timeout}: a peer is not at "
                "this exchange. It may not be running OffloadOptimizer (torch.optim.AdamW on one host, a config "
                "typo?), or it is in another collective (a forward's all-gather, a checkpoint), or it died. Nothing "
                f"was updated on this rank. ({type(exc).__name__}: {exc})") from exc
        if not held.let_go(_LET_GO_SECONDS):
            _keep_forever(held)
        order = {r: i for i, r in enumerate(ranks)}
        return sorted(rows.view(-1, len(values) + 1).tolist(), key=lambda row: order[int(row[-1])])

    def _exchange_on_device(self, values: List[float]) -> List[List[float]]:
        """:meth:`exchange` over the mesh's own groups, on its device (NCCL moves device tensors only)."""
        dist = torch.distributed
        mine = torch.tensor([*values, float(dist.get_rank())], dtype=torch.float64, device=self.mesh.device_type)
        for group in [self.group] + ([self.replicas] if self.replicas is not None else []):
            rows = mine.new_empty(dist.get_world_size(group) * mine.numel())
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(rows, mine, group=group)
            mine = rows
        return mine.view(-1, len(values) + 1).tolist()

    def replica(self, rows: Sequence[Any]) -> List[Any]:
        """Of an :meth:`exchange`'s rows, those of this rank's replica (all of them without HSDP): the ranks whose
        shards make each parameter once."""
        replicas = self.replicas
        if replicas is None:
            return list(rows)
        n = torch.distributed.get_world_size(self.group)
        at = torch.distributed.get_rank(replicas) * n
        return list(rows[at : at + n])

    def reduce(self, values: List[float], op: Any) -> List[float]:
        """A small all-reduce over the dimension the shards are cut along (on the mesh's device)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.mesh.device_type)
        torch.distributed.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def fewest(self, count: int, what: str) -> int:
        return int(min(row[0] for row in self.exchange([float(count)])))

    def where(self, rows: Sequence[Any]) -> str:
        """How a refusal names this rank (``rows``: an exchange's, one per rank of the mesh)."""
        return f"zero_offload: rank {torch.distributed.get_rank()} ({len(rows)} ranks in the FSDP2 mesh)"


_USE_DCP = ("Save and load FSDP2 state with torch.distributed.checkpoint (dcp.save/dcp.load of "
            "get_optimizer_state_dict/set_optimizer_state_dict), which gives each rank its own shard")


def _rows(owner: torch.Tensor, coordinate: Sequence[int]) -> str:
    """The rows ``a:b`` of ``owner`` that the rank at mesh ``coordinate`` holds (FSDP2 cuts dimension 0 as
    ``torch.chunk`` does, over the mesh's last dimension)."""
    mesh = owner.device_mesh
    n, parts = owner.shape[0], mesh.size(mesh.ndim - 1)
    chunk = -(-n // parts)
    start = min(coordinate[-1] * chunk, n)
    return f"{start}:{min(start + chunk, n)}"


# The exchange's gloo group of each set of ranks (global, in mesh order), with the default group it was made in:
# made once per process group at the first step of an optimizer over those ranks (every rank makes it at the same
# point: its first step) and shared by the optimizers over them; one whose collective failed is dropped (see
# Mesh.exchange), one of an earlier default group (destroyed, and initialised again) is made anew.
_GROUPS: Dict[Tuple[int, ...], Tuple[Any, Any]] = {}


def exchange_group(ranks: Tuple[int, ...], timeout: Any) -> Any:
    """The gloo group of :meth:`Mesh.exchange` over ``ranks`` (made by the ranks alone, not the whole world:
    ``use_local_synchronization``); host tensors on any backend (the exchange's values are host floats)."""
    world = torch.distributed.group.WORLD
    made, group = _GROUPS.get(ranks, (None, None))
    if made is not world:
        group = torch.distributed.new_group(list(ranks), timeout=timeout, backend="gloo",
                                            use_local_synchronization=True)
        _GROUPS[ranks] = (world, group)
    return group


def _timeout(group: Any, device_type: str) -> Any:
    """The mesh's own timeout (its process group's), torch's default where it cannot be read."""
    try:
        return group._get_backend(torch.device(device_type)).options._timeout
    except Exception:  # noqa: BLE001 (a backend without options: the default)
        return torch.distributed.default_pg_timeout


def _placement_error(p: torch.Tensor, what: str, advice: str = _OTHER_PLACEMENTS) -> TypeError:
    return TypeError(
        f"OffloadOptimizer takes FSDP2's sharded parameters (Shard(0) on a 1-D mesh, or (Replicate(), Shard(0)) on a "
        f"2-D mesh for HSDP), but a parameter of shape {tuple(p.shape)} is a DTensor with placements "
        f"{tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh: {what}. {advice}")

"""The topology of FSDP2's sharded parameters (:class:`Mesh`): each parameter a ``DTensor`` on a device mesh of any
shape FSDP2 and tensor parallelism make: ``Shard(0)`` on a 1-D mesh (FSDP), ``(Replicate(), Shard(0))`` on a 2-D
mesh (HSDP), ``(Shard(0) or _StridedShard(0), Shard(k) or Replicate())`` on a 2-D (dp, tp) mesh (FSDP + TP:
``parallelize_module`` then ``fully_shard``), and HSDP + TP on a 3-D one; some parameters may be on a sub-mesh of
the others' (a module left out of tensor parallelism: on the data-parallel dimensions alone). The update is
elementwise, so each rank steps the local tensor it holds whatever the placements; what the mesh means is said
here and nowhere else:

* which parameters are taken: those FSDP2 manages (FSDP's own registry, as placements alone cannot tell a
  tensor-parallel parameter FSDP2 never saw), sharded by FSDP along dimension 0, with placements ``Shard``,
  ``_StridedShard`` or ``Replicate`` on each mesh dimension;
* which rank counts a piece in the total norm: a piece replicated over some mesh dimensions (HSDP's replicas, a
  tensor-parallel ``Replicate()``: a LayerNorm's weight under ``SequenceParallel``) is held alike by several ranks,
  and only the one at coordinate 0 along each of those dimensions counts it (:attr:`Mesh.counted`; a dimension a
  parameter's sub-mesh leaves out replicates it too), so that a sum over every rank counts each element once;
* this rank's part of a loaded value (the box of the full tensor its placements give it);
* the mesh's collectives the step makes: an exchange of every rank's small row over the whole mesh (one all-gather
  per mesh dimension) and a reduction over the whole mesh (one all-reduce per dimension);
* the total norm as a ``DTensor`` replicated over the mesh.

FSDP2's own records (which parameters it manages, the storage it keeps for a shard) are :mod:`zero_offload.fsdp2`'s;
the step's protocol over these collectives is the FSDP2 transport's (:mod:`zero_offload.transport.fsdp2`).

``torch.distributed`` is imported only once a ``DTensor`` parameter is given: ``import zero_offload`` stays cheap.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload import distributed, fsdp2
from zero_offload.distributed import _LET_GO_SECONDS, _Held, _keep_forever
from zero_offload.holders import refuse_taken
from zero_offload.options import Options, agreed_settings, check_params
from zero_offload.topology.base import Placement, Topology, _with_margin
from zero_offload.topology.members import Members

if TYPE_CHECKING:  # (annotations only)
    from zero_offload.transport.base import Transport

__all__ = ["Mesh"]

_TAKEN = ("FSDP2's sharded parameters (fully_shard, alone or over parallelize_module's tensor-parallel ones: Shard, "
          "_StridedShard or Replicate on each mesh dimension, FSDP's own along dimension 0)")


class Mesh(Topology):
    """FSDP2's parameters on one device mesh (see the module docstring).

    Args:
        managed (dict, optional): FSDP2's registry as the constructor read it (:func:`zero_offload.fsdp2.take`);
            None: read when a group is placed.

    Attributes:
        mesh (DeviceMesh): the parameters' mesh, the widest where some are on a sub-mesh of it (a module left out
            of tensor parallelism has its parameters on the data-parallel dimensions alone); set by the groups
            placed.
        counted (dict): per param group (by index), per parameter: whether this rank counts its local piece in
            the total norm (it holds a piece no rank before it along a ``Replicate()`` dimension counts); and
            ``counts_all`` whether it counts every one.
    """

    alone = False

    def __init__(self, managed: Optional[Dict[int, Tuple[int, Any, int]]] = None):
        self.managed = managed
        self.mesh: Any = None
        self.counted: Dict[int, List[bool]] = {}
        self._placed: Dict[int, List[Tuple[Any, Tuple[Any, ...]]]] = {}  # per group: each parameter's mesh, placements
        self.counts_all = True  # (no parameter's piece is another rank's to count: the step measures as without)
        self.exchanges = 0  # exchanges with the other ranks so far (see FSDPTransport._failing)
        self.members = Members()

    def options(self, options: Options) -> Options:
        # FSDP runs the hooks after each unit's reduce-scatter: the gradients are final there.
        return dataclasses.replace(options, outside_world=1)

    def transport(self, options: Options) -> "Transport":
        from zero_offload.transport.fsdp2 import FSDPTransport

        return _with_margin(FSDPTransport(self, release=options.release_grads), options)

    def place(self, tensors: Sequence[torch.Tensor], index: int, layout: Tuple[Tuple[str, Any], ...]) -> Placement:
        """Each rank's buckets hold its local tensors, cut at FSDP's units (FSDP does every collective)."""
        check_params(tensors, fsdp=True)
        refuse_taken(tensors, index)
        placed = self.plan(tensors)
        self._placed[index] = [(p.device_mesh, tuple(p.placements)) for p in tensors]
        # (all groups again: a group on a wider mesh than the earlier ones' widens what they are counted over)
        self.counted = {gi: [self._counts(*where) for where in group] for gi, group in self._placed.items()}
        self.counts_all = all(all(counted) for counted in self.counted.values())
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
        """Check that ``params`` are FSDP2's, on this topology's mesh or one of its sub-meshes; their local tensors,
        each one's FSDP unit and :func:`~zero_offload.fsdp2.takeover`. Raises ``TypeError`` naming what cannot be
        taken (a plain parameter among them, a DTensor FSDP does not manage or shards along another dimension, a
        mesh that is not one of the others' sub-meshes, nor they of it)."""
        plain = [p for p in params if not fsdp2.is_dtensor(p)]
        if plain:
            mixed = "a param group mixes" if len(plain) < len(params) else "the param groups mix"
            raise TypeError(
                f"OffloadOptimizer: {mixed} FSDP2's sharded parameters (DTensors) with plain ones (shape "
                f"{tuple(plain[0].shape)}): every parameter of the model must be sharded with fully_shard (wrap the "
                "root module too: fully_shard(model)), or none")
        managed = fsdp2.registry() if self.managed is None else self.managed
        units, mesh = [], self.mesh
        sharded = bool(self._placed) or any(id(p) in managed for p in params)  # (FSDP2's, some of those given)
        for p in params:
            _check_placements(p, managed, sharded)
            mesh = _spanning(mesh, p)
            units.append(managed[id(p)][0])
        self.mesh = mesh  # (only once every parameter was taken)
        return Placement(data=[fsdp2.local_shard(p) for p in params], units=units,
                         takeovers=[fsdp2.takeover(p, managed[id(p)][1]) for p in params])

    def _counts(self, mesh: Any, placements: Tuple[Any, ...]) -> bool:
        """Whether this rank counts the local piece of a parameter on ``mesh`` placed ``placements`` in the total
        norm: it is at coordinate 0 along every dimension of this topology's mesh that replicates the parameter
        (its ``Replicate()`` dimensions, and those its sub-mesh leaves out: the other ranks there hold the same
        piece)."""
        if mesh == self.mesh:
            return all(mesh.get_local_rank(d) == 0 for d, pl in enumerate(placements) if pl.is_replicate())
        names = mesh.mesh_dim_names
        return all(self.mesh.get_local_rank(name) == 0 for name in self.mesh.mesh_dim_names
                   if name not in names or placements[names.index(name)].is_replicate())

    def built(self) -> None:
        self.managed = None  # (FSDP2's registry: every FSDP model of the process, collected or not)

    def adopt_switched(self, opt: Any) -> None:
        """Over FSDP2's parameters already: nothing to adopt."""

    # -- what a rank holds -----------------------------------------------------------------------------------------
    def norm_value(self, norm: torch.Tensor, param_groups: Sequence[Dict[str, Any]]) -> torch.Tensor:
        """``norm`` (the same on every rank) as a DTensor replicated over the (widest) mesh, on the device of the first
        parameter: what ``torch.nn.utils.clip_grad_norm_`` returns for FSDP2's gradients, so ``.full_tensor()``,
        ``.to_local()`` and ``.item()`` read the total norm either way."""
        from torch.distributed.tensor import DTensor, Replicate

        owner = next(p for g in param_groups for p in g["params"] if fsdp2.is_dtensor(p))
        mesh = self.mesh
        return DTensor.from_local(norm.to(owner.device), mesh, [Replicate()] * mesh.ndim, run_check=False)

    def local_value(self, value: Any, owner: torch.Tensor) -> Any:
        """A loaded state value for the parameter ``owner``, as its local tensor: a DTensor's own (placed like the
        parameter), or, for a plain tensor of the parameter's full shape (a checkpoint of an unsharded model), the
        piece this rank holds under the parameter's placements. Anything else is returned as it is (and refused by
        the caller's checks). A DTensor that another rank saved with ``torch.save`` (or a rank at another mesh
        shape) is refused: a DTensor unpickled from another rank keeps the shape of the mesh it was saved on and the
        mesh coordinate of the rank that saved it, so that a piece of this rank's shape but other rows is told apart
        too."""
        if fsdp2.is_dtensor(value):
            if tuple(value.placements) != tuple(owner.placements) or value.shape != owner.shape:
                raise ValueError(f"a state DTensor placed {tuple(value.placements)} with shape {tuple(value.shape)} "
                                 f"for a parameter placed {tuple(owner.placements)} with shape {tuple(owner.shape)}")
            saved, here = value.device_mesh, owner.device_mesh
            if tuple(saved.shape) != tuple(here.shape):
                raise ValueError(f"the state DTensor was saved on a mesh of shape {tuple(saved.shape)}, the parameter "
                                 f"is on one of shape {tuple(here.shape)}: a state dict saved at another world size "
                                 f"and loaded with torch.load? {_USE_DCP}")
            theirs, ours = saved.get_coordinate(), here.get_coordinate()
            if theirs is not None and ours is not None and _box(owner, saved) != _box(owner, here):
                raise ValueError(
                    f"this rank's shard of the state DTensor holds {_describe(_box(owner, saved))} of the parameter "
                    f"(saved at mesh coordinate {tuple(theirs)}), this rank holds {_describe(_box(owner, here))} "
                    f"(mesh coordinate {tuple(ours)}): a state dict saved by another rank and loaded with "
                    f"torch.load? {_USE_DCP}")
            local, mine = value.to_local(), owner.to_local()
            if local.shape != mine.shape:
                raise ValueError(
                    f"this rank's shard of the state DTensor has shape {tuple(local.shape)}, its shard of the "
                    f"parameter {tuple(mine.shape)}: a state dict saved by another rank (or at another world size) and "
                    f"loaded with torch.load? {_USE_DCP}")
            return local
        if isinstance(value, torch.Tensor) and value.dim() and value.shape == owner.shape:
            return _piece(value, owner)
        return value

    def check_flat_checkpoint(self, method: str) -> None:
        raise TypeError(
            f"opt.{method}() is the flat checkpoint format of a process_group's (or one process's) buckets; under "
            "FSDP2 the optimizer's state_dict() is already sharded, as DTensors placed like the parameters: save it "
            "with torch.distributed.checkpoint, dcp.save(get_optimizer_state_dict(model, opt)), and load it with "
            "dcp.load then set_optimizer_state_dict(model, opt, ...) (see docs/multi-gpu.md)")

    # -- the mesh's collectives ------------------------------------------------------------------------------------
    def exchange(self, values: List[float]) -> List[List[float]]:
        """Every rank's ``values`` (of one length on every rank) and its global rank (the last of each row), over
        the whole mesh, in the mesh's order (row-major over its coordinates): one all-gather of host tensors over
        a gloo group of the mesh's ranks that carries nothing else (:func:`exchange_group`).

        Not over the mesh's own groups: there, a rank that is elsewhere (one running ``torch.optim.AdamW`` by a
        config typo, already in the next forward's all-gather) would pair this all-gather with FSDP's collective,
        and gloo aborts the process whose buffer is the smaller (``terminate called ... gloo::EnforceNotMet``), or
        both go on with each other's bytes. On its own group the exchange meets only other optimizers' exchanges,
        and waits for them at most the mesh's timeout, then raises naming why (the rank that is elsewhere is not
        touched: its next collective waits for this rank, and times out, with a Python exception).

        On a GPU mesh (NCCL, which checks no sizes: no abort, but no error either) the exchange stays on the mesh's
        own groups, on the device: one all-gather per mesh dimension, the last first, each of the rows gathered so
        far (a gloo group there would put a TCP ring on every step, unmeasured on GPUs); so it
        does on a torch without ``Tensor._use_count`` (2.3), which cannot hold the host tensors safely (see
        :class:`zero_offload.distributed._Held`)."""
        dist = torch.distributed
        self.exchanges += 1
        if self.mesh.device_type != "cpu" or distributed._use_count is None:
            return self._exchange_on_device(values)
        ranks = tuple(int(r) for r in self.mesh.mesh.flatten().tolist())  # (global ranks, row-major)
        mine = torch.tensor([*values, float(dist.get_rank())], dtype=torch.float64)
        rows = mine.new_empty(len(ranks) * mine.numel())
        timeout = _timeout(self.mesh.get_group(mesh_dim=0), self.mesh.device_type)
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
        for d in reversed(range(self.mesh.ndim)):
            group = self.mesh.get_group(mesh_dim=d)
            rows = mine.new_empty(dist.get_world_size(group) * mine.numel())
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(rows, mine, group=group)
            mine = rows
        return mine.view(-1, len(values) + 1).tolist()

    def reduce(self, values: List[float], op: Any) -> List[float]:
        """A small all-reduce over the whole mesh (one per mesh dimension, on the mesh's device): each rank gives
        what it counts (:attr:`counted`), so a sum counts each element once."""
        t = torch.tensor(values, dtype=torch.float64, device=self.mesh.device_type)
        for d in range(self.mesh.ndim):
            torch.distributed.all_reduce(t, op=op, group=self.mesh.get_group(mesh_dim=d))
        return t.tolist()

    def fewest(self, count: int, what: str) -> int:
        return int(min(row[0] for row in self.exchange([float(count)])))

    def same_homes(self, homes: List[str]) -> List[str]:
        """Of every rank's choice for each bucket index, the one that needs the least GPU memory: host, then parked,
        then resident (two exchanges over the mesh: the ranks' bucket counts, which uneven shards may make differ,
        then their choices). Nothing collective depends on a bucket's home (FSDP does every collective; the step's
        exchange has the same row whatever the homes), but a piece held by several ranks (HSDP's replicas, a
        tensor-parallel ``Replicate()``) must be stepped with the same arithmetic on each of them: the CPU kernel
        and torch's fused one agree only within float rounding, and replicas stepped by each would drift apart.
        The least demanding choice fits wherever a more demanding one was chosen: a parked bucket holds, while it is
        stepped, the memory a resident one would hold always; a host one none."""
        order = ("host", "parked", "resident")
        counts = [int(row[0]) for row in self.exchange([float(len(homes))])]
        most = max(counts)
        if not most:
            return homes
        rows = self.exchange([float(order.index(h)) for h in homes] + [float(len(order))] * (most - len(homes)))
        return [order[int(min(row[i] for row in rows))] for i in range(len(homes))]

    def where(self, rows: Sequence[Any]) -> str:
        """How a refusal names this rank (``rows``: an exchange's, one per rank of the mesh)."""
        return f"zero_offload: rank {torch.distributed.get_rank()} ({len(rows)} ranks in the FSDP2 mesh)"


_USE_DCP = ("Save and load FSDP2 state with torch.distributed.checkpoint (dcp.save/dcp.load of "
            "get_optimizer_state_dict/set_optimizer_state_dict), which gives each rank its own shard")


def _box(owner: torch.Tensor, mesh: Any) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """The local shape and global offset of the piece of ``owner`` that the rank at ``mesh``'s coordinate holds
    under ``owner``'s placements (``mesh``: a state DTensor's, whose coordinate is the rank's that saved it).
    Private: ``compute_local_shape_and_global_offset`` (what DCP plans a DTensor's chunks with)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(owner.shape, mesh, owner.placements)
    return tuple(shape), tuple(offset)


def _describe(box: Tuple[Tuple[int, ...], Tuple[int, ...]]) -> str:
    shape, offset = box
    return "[" + ", ".join(f"{o}:{o + n}" for n, o in zip(shape, offset)) + "]"


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


def _spanning(mesh: Any, p: torch.Tensor) -> Any:
    """Of ``mesh`` (None: none yet) and ``p``'s, the one the other is a sub-mesh of (named dimensions of the same
    root mesh: ``mesh["dp"]`` of ``mesh``), else the ``TypeError``."""
    other = p.device_mesh
    if mesh is None or mesh == other:
        return other
    wide, narrow = (mesh, other) if mesh.ndim >= other.ndim else (other, mesh)
    names, within = narrow.mesh_dim_names, wide.mesh_dim_names
    if names and within and set(names) <= set(within) and wide[tuple(names)] == narrow:
        return wide
    raise TypeError(
        f"OffloadOptimizer: the FSDP2 parameters are on different device meshes ({_named(mesh)} and "
        f"{_named(other)}, for a parameter of shape {tuple(p.shape)} placed {tuple(p.placements)}), neither a "
        "sub-mesh of the other: the total norm and the ranks' agreement are taken over one mesh. Slice every "
        "mesh from one (init_device_mesh with named dimensions, mesh['dp'] for fully_shard and mesh['tp'] for "
        "parallelize_module), or build one optimizer per mesh")


def _check_placements(p: torch.Tensor, managed: Dict[int, Tuple[int, Any]], sharded: bool = False) -> None:
    """Raise ``TypeError`` naming why ``p`` cannot be taken: FSDP2 does not manage it (tensor parallelism alone;
    ``sharded``: it manages others of the parameters given, so this one's module was left out of ``fully_shard``),
    shards it along another dimension than 0 (``shard_placement_fn``), or a placement is neither a shard nor a
    replica (``Partial``)."""
    from torch.distributed.tensor import Replicate, Shard

    record = managed.get(id(p))
    if record is None:
        if sharded:
            raise _placement_error(p, "FSDP2 does not manage it, though it manages other parameters given: its module "
                                   "is in no fully_shard unit (tensor parallelism alone made it)", "Apply fully_shard "
                                   "to every module holding parameters, the root last (fully_shard(model) after the "
                                   "blocks, as torchtitan does: its embeddings, final norm and output projection are "
                                   "there), or leave it out of the optimizer")
        raise _placement_error(p, "FSDP2 does not manage it (tensor parallelism without fully_shard gives such "
                               "placements)", "Shard the model with fully_shard too (over the data-parallel mesh "
                               "dimension, after parallelize_module), or keep torch.optim.AdamW for it")
    fsdp_placement = getattr(record[1], "fsdp_placement", None)  # (FSDPParam's: its own dimension-0 shard)
    if fsdp_placement is not None and fsdp_placement != Shard(0):
        raise _placement_error(p, f"FSDP2 shards it along another dimension ({fsdp_placement}, shard_placement_fn)",
                               "Shard it along dimension 0 (shard_placement_fn returning None for it), or keep "
                               "torch.optim.AdamW for this model")
    strided = _strided_shard()
    odd = [pl for pl in p.placements
           if not isinstance(pl, (Shard, Replicate) + ((strided,) if strided is not None else ()))]
    if odd:
        raise _placement_error(p, f"{odd[0]} is neither a shard nor a replica")


def _strided_shard() -> Any:
    """``_StridedShard`` (private: FSDP2's placement over a tensor-parallel ``Shard`` of the same dimension), or
    None in a torch without it."""
    from torch.distributed.tensor import placement_types

    return getattr(placement_types, "_StridedShard", None)


def _piece(value: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """The box of ``value`` (a full tensor of ``owner``'s shape) that this rank's local tensor of ``owner`` holds
    (:func:`_box`: ``_StridedShard`` included, there being no public way to ask where a rank's piece sits)."""
    shape, offset = _box(owner, owner.device_mesh)
    for dim, (start, size) in enumerate(zip(offset, shape)):
        value = value.narrow(dim, min(start, value.size(dim)), size)
    return value


def _named(mesh: Any) -> str:
    names = getattr(mesh, "mesh_dim_names", None)
    return f"{tuple(mesh.shape)}" + (f" {names}" if names else "")


def _placement_error(p: torch.Tensor, what: str, advice: str = "Keep torch.optim.AdamW for this model") -> TypeError:
    return TypeError(
        f"OffloadOptimizer takes {_TAKEN}, but a parameter of shape {tuple(p.shape)} is a DTensor with placements "
        f"{tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh {_named(p.device_mesh)}: {what}. {advice}")

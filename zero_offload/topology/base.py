"""A topology: where the optimizer's parameters live across ranks, as one object that answers what the step asks of
it, so that the optimizer never branches on the kind: this rank's part of a param group's parameters (and the
checks a group passes to be laid out), whether the ranks must agree on a step's settings, the total norm as the
caller of ``clip_grad_norm_`` receives it, a loaded value's part for this rank, the state dict's layout, and the
transport whose collectives the step makes. :class:`Local` is one process's (no collective); the others are
:class:`~zero_offload.topology.group.Group` (``process_group`` sharding) and
:class:`~zero_offload.topology.mesh.Mesh` (FSDP2's DTensor parameters on any mesh FSDP2 and tensor parallelism
make: 1-D, HSDP, FSDP + TP, HSDP + TP).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from zero_offload import fsdp2
from zero_offload.apart import MARK_LIMIT, live_views, refuse_self_overlap, share_elements, span
from zero_offload.buckets import Placement
from zero_offload.holders import refuse_taken
from zero_offload.options import Options, agreed_settings, check_params

if TYPE_CHECKING:  # (annotations only)
    from zero_offload.transport.base import Transport

__all__ = ["Local", "Placement", "Topology"]


class Topology:
    """Where the parameters live across ranks (see the module docstring). Here: one process, every parameter whole.

    Attributes:
        alone (bool): no other rank takes part in the step (nothing to agree on, no collective).
    """

    alone = True

    def options(self, options: Options) -> Options:
        """``options`` as this topology runs them (before they are validated)."""
        return options

    def transport(self, options: Options) -> "Transport":
        """The transport of this topology's buckets (made once, with the validated ``options``)."""
        from zero_offload.transport.local import LocalTransport

        return _with_margin(LocalTransport(release=options.release_grads), options)

    def place(self, tensors: Sequence[torch.Tensor], index: int, layout: Tuple[Tuple[str, Any], ...]) -> Placement:
        """Check the tensors of param group ``index`` (``layout``: the settings that shape its buckets, which every
        rank must share) and say how its buckets are laid out. Raises, naming what cannot be taken, before anything
        is allocated."""
        check_params(tensors)
        return Placement(live_views=self.check_apart(tensors, index))

    def check_apart(self, tensors: Sequence[torch.Tensor], index: int) -> FrozenSet[int]:
        """Refuse a parameter that shares an element with another, in param group ``index`` or an earlier one (a
        parameter made over a view of another's data): each has a slot of its own in the flat buffers, so they would
        silently stop sharing their elements (AdamW steps the shared elements once per parameter that holds them).
        Views whose memory interleaves without a common element (the column halves of one matrix) are apart. The
        same tensor twice is left to the checks that name it so. Then refuse a parameter whose gradient another
        optimizer has taken (:func:`~zero_offload.holders.refuse_taken`); first, one whose elements overlap each other
        (:func:`~zero_offload.apart.refuse_self_overlap`). Returns the ids of those of ``tensors`` that
        view a larger tensor still alive (:func:`~zero_offload.apart.live_views`), warned of where their
        buckets bind them (:func:`~zero_offload.apart.warn_live_views`)."""
        refuse_self_overlap(tensors, index)
        held = self.__dict__.setdefault("_held", {})
        earlier = {id(p) for g, group in held.items() if g < index for p in group}
        held[index] = list(tensors)  # (by index: a group that failed and is added again replaces its own entry)
        spans = sorted((s, g, j, p) for g, group in held.items() if g <= index
                       for j, p in enumerate(group) for s in [span(p)] if s is not None)
        reach: List[Any] = []  # (sorted by start) the spans of the same storage not ended before the next starts
        for b in spans:
            reach = [a for a in reach if a[0][0] == b[0][0] and b[0][1] < a[0][2]]
            for a in reach:
                if a[3] is not b[3] and index in (a[1], b[1]):
                    shared = share_elements(a[3], a[0], b[3], b[0])
                    if shared is not False:
                        _refuse_shared(a, b, shared)
            reach.append(b)
        refuse_taken([p for p in tensors if id(p) not in earlier], index)  # (one of ours twice: torch names it)
        return frozenset(live_views(tensors, [p for group in held.values() for p in group]))

    def built(self) -> None:
        """The constructor is done: what was read only for it is let go."""

    def settings(self, hypers: Sequence[Any], nonfinite: str,
                 clip: Optional[Tuple[float, float]] = None) -> List[Tuple[str, float]]:
        """What every rank must step with, as (name, value) pairs (see
        :func:`~zero_offload.options.agreed_settings`); none alone."""
        return [] if self.alone else agreed_settings(hypers, nonfinite, clip)

    def norm_value(self, norm: torch.Tensor, param_groups: Sequence[Dict[str, Any]]) -> torch.Tensor:
        """``clip_grad_norm_``'s return value for the total norm ``norm`` (the same on every rank)."""
        return norm

    def local_value(self, value: Any, owner: torch.Tensor) -> Any:
        """A loaded state value for the parameter ``owner``, as the part this rank holds (here: all of it)."""
        return value

    def check_flat_checkpoint(self, method: str) -> None:
        """Raise where ``method`` (``sharded_state_dict`` or ``load_sharded_state_dict``: the flat DCP format of
        this class's buckets) does not apply to these parameters; here it does."""

    def fewest(self, count: int, what: str) -> int:
        """The least of ``count`` over the ranks (each rank's own), for a decision every rank must take alike."""
        return count

    def least(self, values: Sequence[float], what: str) -> List[float]:
        """Each of ``values`` (this rank's own) as the least over the ranks, for a decision every rank must take
        alike from its own measures (``what`` names them in a collective's error). Here, and over an FSDP2 mesh
        (whose ranks may hold different numbers of buckets: they agree on the outcome instead, :meth:`same_homes`),
        this rank's own."""
        return list(values)

    def same_homes(self, homes: List[str]) -> List[str]:
        """Each bucket's home as every rank takes it (``homes``: this rank's choice for its GPU buckets still on the
        host, by index, from ``placement="auto"``'s measurements of its own machine): here its own (one process,
        or ranks that planned from the same measures: :meth:`least`)."""
        return homes

    def adopt_switched(self, opt: Any) -> None:
        """Lay ``opt`` out again over FSDP2's parameters where its groups' ``params`` were switched to them before
        its first step (see :func:`zero_offload.fsdp2.adopt_switched`): an optimizer not over them yet."""
        fsdp2.adopt_switched(opt)

    def state_entries(self, packed: Dict[Any, Any], groups: Sequence[Dict[str, Any]], buckets: Sequence[Any],
                      state: Dict[Any, Any], transport: "Transport") -> Dict[Any, Any]:
        """``state_dict()``'s ``"state"``, from what ``torch.optim.Optimizer.state_dict`` ``packed``: here its
        entries as plain dicts."""
        from zero_offload.checkpoint.entries import StateEntry

        return {k: dict(v) if isinstance(v, StateEntry) else v for k, v in packed.items()}


class Local(Topology):
    """One process: the parameters whole, no collective."""


def _refuse_shared(a: Any, b: Any, shared: Optional[bool]) -> None:
    """Refuse two parameters (``a``, ``b``: (span, group, index, tensor)) whose memory overlaps: they share an
    element (``shared``), or their ranges interleave too widely to be told apart."""
    (g, j, p), (h, k, q) = sorted((a[1:], b[1:]), key=lambda e: e[:2])  # (the later second)
    how = ("one is a view of the other's data" if shared else
           f"their memory ranges interleave over more than {MARK_LIMIT} bytes, too wide to tell whether they share "
           "an element")
    raise ValueError(
        f"param group {h}, parameter {k} (shape {tuple(q.shape)}) shares memory with param group {g}, "
        f"parameter {j} (shape {tuple(p.shape)}): {how}. OffloadOptimizer gives each parameter a slot of its own, so "
        "they would silently stop sharing their elements: give it its own storage (nn.Parameter(t.clone())), or "
        "optimize only the parameter it views")


def _with_margin(transport: "Transport", options: Options) -> "Transport":
    """``transport`` with the device memory its uploads during backward leave free (``gpu_margin_gib``; None: no
    such uploads, ``uploads_in_backward=False``)."""
    transport.staging_margin = int(options.gpu_margin_gib * 2**30) if options.uploads_in_backward else None
    return transport

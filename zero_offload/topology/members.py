"""What each parameter of an optimizer over FSDP2's shards steps with, as the ranks compare it at every step
(:class:`Members`). The ranks' param groups are compared group by group (``lr of param group 0``); but ranks that put
a parameter in different groups (weight decay on one rank only) have groups alike and the parameter's update not,
and FSDP's all-gather would join shards updated with different hyperparameters (under HSDP, replicas drift apart).
So the settings the ranks exchange also carry, per parameter in FSDP's order (the same on every rank: the order in
which ``fully_shard`` made the units, then each unit's parameters), a digest of its group's hyperparameters (and of
the update rule's kind), and the options that change the arithmetic (``state_dtype``: replicas stepping with bf16
moments on one rank only drift apart by 1e-4 in four steps); ranks that differ raise on every rank, naming the
first such parameter and what differs (:meth:`Members.name_difference`)."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload import fsdp2
from zero_offload.options import STATE_DTYPES
from zero_offload.transport.agreement import PER_PARAMETER, differing, digest_bytes

__all__ = ["Members"]

Exchange = Callable[[List[float], str], List[List[float]]]
# The setting's name: the code of each state dtype it may take.
_STATE_DTYPE = "state_dtype ({})".format(", ".join(f"{i}: {d}" for i, d in enumerate(STATE_DTYPES)))


def _fields(hyper: Any) -> List[Tuple[str, float]]:
    names = getattr(hyper, "user_names", {})
    return [(names.get(f.name, f.name), float(getattr(hyper, f.name))) for f in dataclasses.fields(hyper)]


def _digest(hyper: Any) -> float:
    values = [v for _, v in _fields(hyper)]
    return digest_bytes(type(hyper).__qualname__.encode() + struct.pack(f"<{len(values)}d", *values))


class Members:
    """The parameters of each param group of one optimizer over FSDP2's shards, in FSDP's order.

    Attributes:
        state_dtype (torch.dtype): the moments' storage the optimizer was built with.
        hypers (Sequence): the groups' hyperparameters of the last :meth:`settings` with any (to name what
            differs).
    """

    def __init__(self):
        self._groups: Dict[int, Tuple[List[torch.Tensor], List[int]]] = {}
        self.state_dtype = torch.float32
        self.hypers: Sequence[Any] = ()
        self._order: Optional[List[Tuple[int, int, int]]] = None  # (place in FSDP's order, group, index)
        self._cached: Tuple[Any, float] = (None, 0.0)

    def add(self, index: int, params: Sequence[torch.Tensor], places: Sequence[int], layout: Dict[str, Any]) -> None:
        """Param group ``index``'s ``params`` (DTensors), each one's place in FSDP's order (``places``: see
        :func:`zero_offload.fsdp2.registry`), and the options of ``layout`` (``Options.collective_layout``)."""
        self._groups[index] = (list(params), list(places))  # (a group added anew after a failed add replaces it)
        self.state_dtype = layout.get("state_dtype", self.state_dtype)
        self._order, self._cached = None, (None, 0.0)

    def order(self, groups: int) -> List[Tuple[int, int]]:
        """(param group, index in it) of each parameter of the first ``groups`` groups, in FSDP's order."""
        if self._order is None:
            self._order = sorted((at, g, i) for g, (_, places) in self._groups.items() for i, at in enumerate(places))
        return [(g, i) for _, g, i in self._order if g < groups]

    def settings(self, hypers: Sequence[Any]) -> List[Tuple[str, float]]:
        """The entries :meth:`~zero_offload.topology.mesh.Mesh.settings` adds: ``state_dtype`` and (where
        ``hypers``, each group's hyperparameters, are given) the per-parameter digest: computed again only when
        the hyperparameters change (an LR scheduler's step), not at every step."""
        out = [(_STATE_DTYPE, float(STATE_DTYPES.index(self.state_dtype)))]
        if hypers:
            self.hypers = hypers
            key = tuple(hypers)
            if self._cached[0] != key:
                digests = [_digest(h) for h in hypers]
                per = [digests[g] for g, _ in self.order(len(digests))]
                self._cached = (key, digest_bytes(struct.pack(f"<{len(per)}d", *per)))
            out.append((PER_PARAMETER, self._cached[1]))
        return out

    def name_difference(self, exchange: Exchange, where: str) -> None:
        """Raise on every rank, naming the first parameter (in FSDP's order) whose group's hyperparameters differ
        between the ranks and what differs, where one does (the ranks' per-parameter digests differed). ``exchange``
        gives every rank's list of floats (each row ending with its rank), or raises where their lengths differ
        (naming what, its second argument)."""
        hypers = self.hypers
        order = self.order(len(hypers))
        digests = [_digest(h) for h in hypers]
        rows = exchange([digests[g] for g, _ in order], "parameters (another model?)")
        k = next((k for k in range(len(order)) if len({row[k] for row in rows}) > 1), None)
        if k is None:
            return
        g, i = order[k]
        fields = [*_fields(hypers[g]), ("update rule", digest_bytes(type(hypers[g]).__qualname__.encode()))]
        label = self._label(self._groups[g][0][i], k)
        rows = exchange([float(g), *(v for _, v in fields)], f"hyperparameters for {label} (another update rule?)")
        ranks = [int(row[-1]) for row in rows]
        listed = differing(fields, [row[1:] for row in rows], ranks)
        groups = ", ".join(f"{int(row[0])} on rank {r}" for r, row in zip(ranks, rows))
        raise RuntimeError(
            f"{where}: the ranks step {label} with different hyperparameters: {listed} (its param group: {groups}). "
            "Each rank would update its shard of it with its own, and FSDP's all-gather would join them (replicas "
            "would drift apart): every rank must put each parameter in a param group with the same "
            "hyperparameters. Nothing was updated.")

    @staticmethod
    def _label(p: torch.Tensor, k: int) -> str:
        """A parameter as every rank names it: FSDP's name for it (set once a forward ran), else its place in
        FSDP's order; with its whole shape."""
        record = fsdp2.registry().get(id(p))
        fqn = getattr(record[1], "_param_fqn", None) if record is not None else None
        name = repr(fqn) if fqn else f"parameter {k} (in FSDP's order)"
        return f"{name} of shape {tuple(p.shape)}"

"""FSDP2's units, as the planner sees them (``python -m zero_offload --model CFG --fsdp N``): the modules a user gives
``fully_shard`` (each transformer block, then the root with what is left: embeddings, final norm, head), each
rank's shards of the parameters, the buckets the optimizer cuts them into on each rank, and the GPU memory FSDP2
itself takes beyond the shards: the units it all-gathers and the buffers it reduce-scatters from.

What the optimizer does with FSDP2's shards (:mod:`zero_offload.fsdp2`, :func:`zero_offload.buckets.plan_local`):
each rank's buckets hold its local shards, in the model's parameter order, cut where the next parameter's unit
differs from the last one's (the root unit's parameters, first and last in the model, make two runs) and where a
bucket would pass ``bucket_numel``. ``fully_shard`` cuts each parameter along its first dimension into
``ceil(rows / N)``-row chunks, rank ``r`` holding rows ``[r c, (r + 1) c)`` of them (the last ranks fewer, or none);
the optimizer takes over the storage FSDP keeps for the shard (on the host, and on a GPU as well), padded to ``c``
rows on every rank, so the slot has room for that.

Nothing here allocates: shards are meta tensors; no module is built here (the caller's model, a meta one, is read).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload.state.layout import BucketLayout, plan_buckets

__all__ = ["FsdpUnits", "RankBuckets", "UNIT_CHOICES", "gathered_bytes", "model_units", "rank_buckets",
           "rank_shards", "shard_rooms"]

# --fsdp-units: each block a unit and the root the rest (torchtitan's and most recipes' wrapping), or the root only.
UNIT_CHOICES = ("per-block", "whole")
ROOT = -1  # the root unit's key (blocks are 0, 1, ...)


@dataclasses.dataclass(frozen=True)
class FsdpUnits:
    """Which FSDP2 unit each parameter is in.

    Attributes:
        keys (Tuple[int, ...]): per parameter (in the model's order), its unit: a block's index, or ``-1`` for the
            root.
        blocks (int): units other than the root.
        block_name (str): the blocks' class name ("" without blocks).
        how (str): how the blocks were found (said in the plan).
    """

    keys: Tuple[int, ...]
    blocks: int = 0
    block_name: str = ""
    how: str = ""


@dataclasses.dataclass(frozen=True)
class RankBuckets:
    """The optimizer's buckets on ranks ``first`` to ``last`` (alike there): how many, their parameters' elements
    and their flat buffers' length (``padded_numel``, alignment and FSDP's padding rows included)."""

    first: int
    last: int
    buckets: int
    numel: int
    padded_numel: int

    @property
    def padding(self) -> int:
        """Elements of the flat buffers that hold no parameter."""
        return self.padded_numel - self.numel


def model_units(net: torch.nn.Module, how: str = "per-block") -> FsdpUnits:
    """The units of ``net`` wrapped ``how``: ``"whole"``, ``fully_shard(net)`` alone (one unit); ``"per-block"``,
    ``fully_shard`` on each block, then on ``net``. The blocks are the modules of the classes Hugging Face names in
    ``net._no_split_modules`` (the ones it keeps whole when it splits a model: its decoder layers), outermost
    first; without those, the children of the largest ``nn.ModuleList`` of one class (``model.layers``,
    ``transformer.h``); without either, the model is one unit. A parameter in a block is in its unit (tied to one
    outside it: the first block's), every other one in the root's."""
    params = list(net.parameters())
    if how not in UNIT_CHOICES:
        raise ValueError(f"Invalid fsdp units: {how!r} (one of {', '.join(UNIT_CHOICES)})")
    blocks, said = ([], "fully_shard(model) alone") if how == "whole" else _blocks(net)
    owner: Dict[int, int] = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            owner.setdefault(id(p), i)
    keys = tuple(owner.get(id(p), ROOT) for p in params)
    return FsdpUnits(keys, len(blocks), type(blocks[0]).__name__ if blocks else "", said)


def _blocks(net: torch.nn.Module) -> Tuple[List[torch.nn.Module], str]:
    """The modules a per-block wrapping gives ``fully_shard`` before the root (see :func:`model_units`)."""
    names = set(getattr(net, "_no_split_modules", None) or ())
    if names:
        found: List[Tuple[str, torch.nn.Module]] = []
        for name, module in net.named_modules():
            if type(module).__name__ in names and not any(name.startswith(f + ".") for f, _ in found):
                found.append((name, module))
        found = [(n, m) for n, m in found if any(True for _ in m.parameters())]
        if found:
            return [m for _, m in found], "the model's _no_split_modules"
    lists = [(name, m) for name, m in net.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)
             and len({type(c) for c in m}) == 1 and any(True for _ in m.parameters())]
    if not lists:
        return [], "no blocks found: no _no_split_modules, no ModuleList of one class"
    name, best = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    return list(best), f"the children of {name or 'the model'} (the largest ModuleList of one class)"


def _rows(p: torch.Tensor) -> Tuple[int, int]:
    """(rows, elements per row) of ``p`` as ``fully_shard`` cuts it (a 0-d tensor as one row of one)."""
    shape = tuple(p.shape) or (1,)
    rest = 1
    for s in shape[1:]:
        rest *= s
    return shape[0], rest


def rank_shards(params: Sequence[torch.Tensor], ranks: int, rank: int = 0) -> List[torch.Tensor]:
    """Meta stand-ins for rank ``rank``'s shards of ``params`` over ``ranks`` ranks (``fully_shard``'s
    ``Shard(0)``: ``ceil(rows / ranks)``-row chunks; a later rank may hold fewer rows, or none)."""
    out = []
    for p in params:
        shape = tuple(p.shape) or (1,)
        chunk = -(-shape[0] // ranks)
        rows = max(0, min(chunk, shape[0] - rank * chunk))
        out.append(torch.empty((rows,) + shape[1:], dtype=p.dtype, device="meta"))
    return out


def shard_rooms(params: Sequence[torch.Tensor], ranks: int) -> List[int]:
    """The elements FSDP keeps for each parameter's shard on every rank (``ceil(rows / ranks)`` rows): the slot that
    takes the storage over has room for them all."""
    return [-(-rows // ranks) * rest for rows, rest in map(_rows, params)]


def rank_buckets(params: Sequence[torch.Tensor], units: Optional[FsdpUnits], ranks: int,
                 bucket_numel: int) -> Tuple[RankBuckets, ...]:
    """Every rank's buckets (:class:`RankBuckets`, ranks that hold alike shards together), as the optimizer lays
    them out over its shards of ``params`` cut at ``units`` (None: not cut), the slots taking over FSDP's padded
    storage. Ranks hold alike shards between the ranks where some
    parameter's last rows fall, so only those are laid out."""
    starts = {0}
    for rows, _ in map(_rows, params):
        chunk = -(-rows // ranks)
        if not chunk:
            continue
        starts.update(r for r in (rows // chunk, -(-rows // chunk)) if r < ranks)
    bounds = sorted(starts) + [ranks]
    rooms = shard_rooms(params, ranks)
    out = []
    for first, end in zip(bounds, bounds[1:]):
        layouts = local_layouts(params, units, ranks, bucket_numel, first, rooms)
        out.append(RankBuckets(first, end - 1, len(layouts), sum(l.numel for l in layouts),
                               sum(l.padded_numel for l in layouts)))
    return tuple(out)


def local_layouts(params: Sequence[torch.Tensor], units: Optional[FsdpUnits], ranks: int, bucket_numel: int,
                  rank: int, rooms: Optional[Sequence[int]] = None) -> List[BucketLayout]:
    """Rank ``rank``'s bucket layouts (:func:`zero_offload.buckets.plan_local`'s, over meta stand-ins)."""
    return plan_buckets(rank_shards(params, ranks, rank), bucket_numel, cuts=None if units is None else units.keys,
                        rooms=rooms)


def gathered_bytes(params: Sequence[torch.Tensor], units: FsdpUnits, ranks: int, param_dtype: torch.dtype,
                   reduce_dtype: torch.dtype) -> Dict[str, int]:
    """GPU bytes FSDP2 itself takes on each rank beyond the shards and their gradients, by what they are, each at
    its largest (they peak at different moments of a step: their sum is an upper bound). A unit's all-gather
    output is its parameters whole, each padded to ``ranks`` times its shard (``N ceil(rows / N)`` rows):

    * ``"gathered"`` (``param_dtype``): the root unit, gathered from its forward to the end of backward (FSDP2 does
      not reshard the root after forward), and two of the largest other unit: the one running and the next one,
      whose all-gather FSDP2 issues ahead (prefetch); one with a single other unit, none without;
    * ``"unit gradients"`` (``param_dtype``): autograd's gradients of the whole parameters, the root unit's (its
      head's arrive first in backward, its reduce-scatter comes last) and the largest other unit's;
    * ``"reduce-scatter"`` (``reduce_dtype``): the input FSDP2 copies a unit's gradients into, padded as its
      all-gather, for the largest unit.
    """
    padded: Dict[int, int] = {}
    whole: Dict[int, int] = {}
    for p, key in zip(params, units.keys):
        rows, rest = _rows(p)
        padded[key] = padded.get(key, 0) + -(-rows // ranks) * ranks * rest
        whole[key] = whole.get(key, 0) + p.numel()
    others = [k for k in padded if k != ROOT]
    big = max(others, key=lambda k: padded[k], default=None)
    gathered = padded.get(ROOT, 0) + (min(2, len(others)) * padded[big] if big is not None else 0)
    grads = whole.get(ROOT, 0) + (whole[big] if big is not None else 0)
    return {"gathered": gathered * param_dtype.itemsize, "unit gradients": grads * param_dtype.itemsize,
            "reduce-scatter": max(padded.values(), default=0) * reduce_dtype.itemsize}

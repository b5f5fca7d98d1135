"""Where each parameter lives in a bucket's flat buffers: the bucket layout (aligned slots, one per parameter, at the
same offset in every buffer), its cut into per-rank shards, and the per-parameter views of a flat buffer.

Each parameter gets a slot in every flat buffer of the bucket at the same offset, a multiple of :data:`ALIGN`
elements, so the update covers a whole bucket (or a contiguous run of it) in one call whatever the number of
tensors, every slot starts on a 64-byte line for every dtype, and per-parameter state is a view of its slot,
shaped and strided like the parameter. Padding elements are zero in every buffer and see a zero gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from zero_offload.functional import Q8_BLOCK

__all__ = ["ALIGN", "BucketLayout", "ShardLayout", "align_up", "memory_order_flat", "plan_buckets", "view_like"]


# Elements. 64 elements is a whole number of 64-byte cache lines for 1-, 2- and 4-byte dtypes and a multiple of
# every SIMD width the kernel uses, so no slot shares a line or a vector with its neighbour; and it is one block of
# 8-bit state, so every slot (and every shard, see ShardLayout) owns whole scale blocks.
ALIGN = 64
assert ALIGN % Q8_BLOCK == 0


def align_up(n: int, alignment: int = ALIGN) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Where the parameters of one bucket live in its flat buffers.

    Attributes:
        indices (Tuple[int, ...]): positions of the bucket's parameters in their group's ``params`` list.
        offsets (Tuple[int, ...]): element offset of each parameter's slot, multiples of :data:`ALIGN`.
        numels (Tuple[int, ...]): elements of each parameter.
        padded_numel (int): length of each flat buffer.
        device (torch.device): where the parameters live.
        dtype (torch.dtype): the parameters' dtype (and their gradients').
    """

    indices: Tuple[int, ...]
    offsets: Tuple[int, ...]
    numels: Tuple[int, ...]
    padded_numel: int
    device: torch.device
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def span(self, first: int, last: int) -> Tuple[int, int]:
        """Element range covering parameters ``first..last`` (bucket positions, inclusive), padding included."""
        end = self.offsets[last + 1] if last + 1 < len(self.offsets) else self.padded_numel
        return self.offsets[first], end


def plan_buckets(params: Sequence[torch.Tensor], max_numel: int, cuts: Optional[Sequence[Hashable]] = None,
                 rooms: Optional[Sequence[int]] = None) -> List[BucketLayout]:
    """Split one group's parameters into buckets: one per (device, dtype), in order of first appearance, each cut
    where it would exceed ``max_numel`` elements (a larger parameter gets a bucket to itself; parameters are never
    split) and, with ``cuts``, where the next parameter's key differs from the last one's (FSDP2: its unit, whose
    gradients arrive together). Within a bucket, parameters keep their group order.

    Args:
        params (Sequence[Tensor]): the group's parameters.
        max_numel (int): soft cap on a bucket's elements.
        cuts (Sequence, optional): a key per parameter. Default: None.
        rooms (Sequence[int], optional): the least elements of each parameter's slot, where more than its own
            (FSDP2: a shard whose storage the slot takes over, padding rows included). Default: None.
    """
    by_kind: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
    for i, p in enumerate(params):
        by_kind.setdefault((p.device, p.dtype), []).append(i)
    layouts = []
    for (device, dtype), indices in by_kind.items():
        run: List[int] = []
        offsets: List[int] = []
        cursor = 0
        for i in indices:
            n = params[i].numel()
            if run and (cursor + n > max_numel or (cuts is not None and cuts[i] != cuts[run[-1]])):
                layouts.append(_layout(run, offsets, params, cursor, device, dtype))
                run, offsets, cursor = [], [], 0
            run.append(i)
            offsets.append(cursor)
            cursor += align_up(n if rooms is None else max(n, rooms[i]))
        if run:
            layouts.append(_layout(run, offsets, params, cursor, device, dtype))
    return layouts


def _layout(run, offsets, params, cursor, device, dtype) -> BucketLayout:
    return BucketLayout(tuple(run), tuple(offsets), tuple(params[i].numel() for i in run), cursor, device, dtype)


def view_like(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The slot of ``like`` in ``flat``, with ``like``'s shape and, when ``like`` is dense (e.g. channels-last),
    its strides too: the optimizer state then has the parameter's memory format, as ``torch.zeros_like`` gives
    AdamW, and gradient copies into the slot are straight memory copies."""
    n = like.numel()
    if like.is_contiguous() or not _dense(like):
        return flat[offset : offset + n].view(like.shape)
    return flat.as_strided(like.shape, like.stride(), flat.storage_offset() + offset)


def memory_order_flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a 1-D tensor in the order :func:`view_like` lays them out in a slot: memory order for
    a dense tensor (a view), logical order otherwise (a copy when ``t`` is not contiguous)."""
    if t.is_contiguous() or not _dense(t):
        return t.reshape(-1)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements exactly fill ``t.numel()`` consecutive memory slots in some dimension order."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True



@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How one bucket is cut over the ``world`` ranks of a process group (ZeRO), seen from rank ``rank``.

    The bucket's full flat layout (``full``) is padded to a multiple of ``world * ALIGN`` elements and cut into
    ``world`` equal contiguous shards of ``numel`` elements (a multiple of :data:`ALIGN`); rank ``r`` owns
    ``[r * numel, (r + 1) * numel)``. A parameter may straddle shard boundaries, and a rank may own only padding.
    ``local`` describes the shard in the coordinates the update uses: the same parameters, each with its *piece*
    (the part of its slot inside the shard, possibly empty) at a shard-local offset, so spans, runs and kernel
    calls work on a shard exactly as on a whole bucket.

    Attributes:
        full (BucketLayout): the whole bucket, padded for the cut.
        world (int), rank (int): the group's size and this rank.
        pieces (Tuple[Tuple[int, int], ...]): each parameter's piece ``[a, b)`` in shard coordinates.
        piece_src (Tuple[int, ...]): where each piece starts within its parameter's slot.
        local (BucketLayout): the shard's own layout.
    """

    full: BucketLayout
    world: int
    rank: int
    pieces: Tuple[Tuple[int, int], ...]
    piece_src: Tuple[int, ...]
    local: BucketLayout

    @staticmethod
    def cut(layout: BucketLayout, world: int, rank: int) -> "ShardLayout":
        padded = align_up(layout.padded_numel, ALIGN * world)
        shard = padded // world
        lo = rank * shard
        pieces = tuple((min(max(o - lo, 0), shard), min(max(o + n - lo, 0), shard))
                       for o, n in zip(layout.offsets, layout.numels))
        local = BucketLayout(layout.indices, tuple(a for a, _ in pieces), tuple(b - a for a, b in pieces), shard,
                             layout.device, layout.dtype)
        return ShardLayout(dataclasses.replace(layout, padded_numel=padded), world, rank, pieces,
                           tuple(a + lo - o for (a, _), o in zip(pieces, layout.offsets)), local)

    @property
    def numel(self) -> int:
        return self.full.padded_numel // self.world

    @property
    def lo(self) -> int:
        return self.rank * self.numel

    def pieces_of(self, i: int) -> List[Tuple[int, int, int]]:
        """How parameter ``i``'s slot is spread over the ranks: ``(rank, start within the slot, length)`` for each
        rank that owns a non-empty piece of it."""
        offset, numel, shard = self.full.offsets[i], self.full.numels[i], self.numel
        out = []
        for r in range(self.world):
            a, b = max(offset, r * shard), min(offset + numel, (r + 1) * shard)
            if b > a:
                out.append((r, a - offset, b - a))
        return out

"""Where ``dcp.load`` writes the state of a :func:`~zero_offload.checkpoint.dcp.sharded_state_dict` until the load is
committed: staging, never the live buffers, so that a load that fails part way (a truncated file, a missing
chunk) leaves the optimizer as it was, as ``load_state_dict()`` does.

DCP plans a load by asking each tensor of the dict for its chunks (``__create_chunk_list__``), and a save by asking
for its write items (``__create_write_items__``); both then ask for the tensor to read or write
(``__get_tensor_shard__``). So a piece is staged only when a load plans it (saving reads the live buffers, as
before, and costs nothing more), in the :class:`Twin` of the live buffer it views, or, for a parameter's value
(``param``), in a tensor of its own. Once ``load_sharded_state_dict`` has validated the dict,
:meth:`LoadStage.commit` makes each twin the live buffer: the bytes no piece covered (alignment padding, a piece
the load left out) are copied into the twin, then the two trade their memory
(:func:`~zero_offload._compat.take_memory`: O(1), every view of the live buffer follows), and the old state goes
with the twin.

Memory: from the load's planning to the commit (or, after a failure, until the dict is dropped), each buffer the load
writes into is held twice: this rank's moments, and the masters of bf16/fp16 parameters (8 to 16 bytes per
parameter, fp32), and with ``delayed_update`` the parameters' values once more.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from zero_offload._compat import take_memory
from zero_offload.host_memory import empty_host

__all__ = ["LoadStage", "Staging", "Twin"]


class Twin:
    """A live flat buffer that pieces of a sharded state dict view and, once a load plans to write into one of them,
    its staging twin: the same size, dtype, device and pinning, uninitialised, with the ranges the planned pieces
    cover."""

    def __init__(self, live: torch.Tensor, pin: bool):
        self.live, self.pin = live, pin
        self.staged: Optional[torch.Tensor] = None
        self.covered: List[Tuple[int, int]] = []

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """The twin's range where ``local`` (a 1-D contiguous view of the live buffer) is (the twin made at the
        first)."""
        if self.staged is None:
            live = self.live
            self.staged = (empty_host(live.numel(), live.dtype, pin=self.pin) if live.device.type == "cpu"
                           else torch.empty_like(live))
        a = local.storage_offset() - self.live.storage_offset()
        self.covered.append((a, a + local.numel()))
        return self.staged[a : a + local.numel()]

    def commit(self) -> None:
        """The twin becomes the live buffer, keeping the live bytes no planned piece covered."""
        staged, self.staged = self.staged, None
        if staged is None:
            return
        at, end = 0, self.live.numel()
        for a, b in sorted(self.covered) + [(end, end)]:
            if a > at:
                staged[at:a].copy_(self.live[at:a])
            at = max(at, b)
        self.covered = []
        take_memory(self.live, staged)


class LoadStage:
    """The staging of one sharded state dict: its :class:`Twin` per live buffer, and the pieces a load staged."""

    def __init__(self) -> None:
        self.twins: List[Twin] = []
        self.pieces: List["Staging"] = []

    def twin(self, live: torch.Tensor, pin: bool) -> Twin:
        twin = Twin(live, pin)
        self.twins.append(twin)
        return twin

    def commit(self) -> None:
        """The twins become the live buffers (a piece staged in a tensor of its own is taken by
        :meth:`Staging.take`)."""
        for twin in self.twins:
            twin.commit()
        for piece in self.pieces:
            if piece.twin is not None:
                piece.staged = None
        self.pieces = [piece for piece in self.pieces if piece.twin is None]


class Staging:
    """One piece's part in DCP's plans: ``local`` is what a save reads; a load writes into a range of ``twin``
    (None: a tensor of its own). Without a ``stage``, ``local`` is a private copy (the state after a pending delayed
    update), which a load writes in place."""

    __slots__ = ("local", "stage", "twin", "staged", "loading")

    def __init__(self, local: torch.Tensor, stage: Optional[LoadStage], twin: Optional[Twin]):
        self.local, self.stage, self.twin = local, stage, twin
        self.staged: Optional[torch.Tensor] = None
        self.loading = False  # the last plan DCP made with the piece was a load's

    def plan_load(self) -> None:
        self.loading = True
        if self.stage is not None and self.staged is None and self.local.numel():
            self.staged = self.twin.view(self.local) if self.twin is not None else torch.empty_like(self.local)
            self.stage.pieces.append(self)

    def plan_save(self) -> None:
        self.loading = False

    def target(self) -> torch.Tensor:
        """The tensor DCP reads (saving) or writes (loading)."""
        return self.staged if self.loading and self.staged is not None else self.local

    def take(self) -> torch.Tensor:
        """What a load wrote into a tensor of its own (given up), else ``local``."""
        staged, self.staged = self.staged, None
        return self.local if staged is None else staged

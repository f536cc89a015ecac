"""A graph state's own index buffer, which an engine packs each step's batch into:
:class:`IndexBuffer`.

A batch built in a session's :class:`~attnreg.runtime.IndexLayout` is packed into
a buffer of its own, and every replay copies that buffer onto the graph's (one
device copy, ``GraphState.fill_packed``).  Packed *into the graph's buffer*
instead (``decode_batch(pool, lens, layout=session.index_buffer)``) the batch's
index tensors already are what the graph reads: the replay copies nothing.  The
pack does the same device work either way (one host-to-device copy of the
lengths, the page table's fill and copy), so the step's one copy is removed, not
moved (issue 26: the host time of a session step).

The price is that the buffer holds one batch.  Packing a second batch (or any
replay that copies another batch in, or a capture) overwrites the first, and its
index tensors, views of the buffer, then describe the second.  Replaying or
running the first eagerly after that would attend the second's pages, silently,
so :attr:`PackedIndices.overwritten` marks it and the backend refuses it (its
batch check names the cause).  Engines that build the next batch before the
current one is launched (an overlap scheduler) pack into a layout instead.
Device order needs nothing: the pack's copies are queued on the stream after the
replay that read the previous batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .indices import IndexLayout, PackedIndices

__all__ = ["OVERWRITTEN", "IndexBuffer"]

#: Why a batch whose buffer was written since it was packed must not run (the one text the
#: batch check, ``GraphState.fill`` and ``ForwardBatch.in_layout`` give).
OVERWRITTEN = ("the batch was packed into a graph's index buffer (GraphSession.index_buffer) "
               "and another batch has been packed or copied over it since, so its index "
               "tensors describe that one: build it again, and pack one batch at a time "
               "into the buffer, running each before packing the next (or pack into "
               "GraphSession.index_layout)")


class IndexBuffer:
    """The flat index buffer of a :class:`~attnreg.runtime.GraphState`, as a place to
    pack one batch at a time (``ForwardBatch.build(..., layout=buffer)``).

    It packs as its :attr:`layout` does (:meth:`IndexLayout.pack`, same
    arguments), writing into :attr:`flat`; :attr:`current` is the last batch
    packed and still intact (None once anything else wrote the buffer).
    """

    __slots__ = ("current", "flat", "layout")

    def __init__(self, layout: IndexLayout, flat: torch.Tensor) -> None:
        layout.views(flat)  # the buffer's shape and dtype are the layout's (ValueError)
        self.layout = layout
        self.flat = flat
        self.current: PackedIndices | None = None

    def pack(self, seq_lens: Sequence[int], prefix_lens: Sequence[int],
             extend_lens: Sequence[int], page_table: torch.Tensor,
             out_cache_loc: Sequence[int] | torch.Tensor, device: torch.device
             ) -> PackedIndices:
        """:meth:`IndexLayout.pack` into this buffer: the batch packed before is overwritten."""
        dev, have = torch.device(device), self.flat.device
        if dev.type != have.type or (dev.index is not None and have.index is not None
                                     and dev.index != have.index):
            raise ValueError(f"the batch is on {device}, this index buffer on "
                             f"{self.flat.device}")
        self.current = None  # from the first write on, the previous batch is gone
        packed = self.layout.pack(seq_lens, prefix_lens, extend_lens, page_table,
                                  out_cache_loc, device, into=self)
        self.current = packed
        return packed

    def fit_problems(self, seq_lens: Sequence[int], num_tokens: int) -> list[str]:
        """Why a batch of these lengths cannot be packed here (:meth:`IndexLayout.fit_problems`)."""
        return self.layout.fit_problems(seq_lens, num_tokens)

    def holds(self, packed: PackedIndices) -> bool:
        """Whether ``packed`` was packed here and nothing has written the buffer since."""
        return packed is self.current

    def overwritten(self) -> None:
        """Record a write of the buffer by anything but :meth:`pack` (a copy of another
        batch, a capture's dummy batch): the batch packed here is gone."""
        self.current = None

    def __repr__(self) -> str:
        return f"IndexBuffer({self.layout!r}, holds a batch: {self.current is not None})"

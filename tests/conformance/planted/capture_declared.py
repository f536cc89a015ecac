"""(g) What the runtime allocates for graphs and what it replays differ from the declaration.

* ``planted_memory_overdeclared``: declares decode capture memory with the old
  per-slot formula (``128 x 32 x 513 x 4`` bytes per request slot: 2 GiB at 256
  slots) while the runtime allocates the split workspace it needs, far less; the
  graph policy would drop a graph that fits (issue 15);
* ``planted_memory_undeclared``: its runtime allocates a scratch buffer for graphs
  the declaration does not mention;
* ``planted_padding_rows``: leaves the output rows of padding tokens as the
  kernel left them (never written) instead of zeroing them;
* ``planted_padding_rows_wide``: from 64 heads up only, padding rows of finite non-zero
  values, as a backend would give that relies on its kernel writing zeros for padding
  requests (flashinfer_mla's decode graphs do) when the kernel's wide-head tiling does
  not: a claim at the base head count alone passes it;
* ``planted_page_table_p16``: its decode graphs read the page table through a captured
  table of its own, sized and refreshed in 16-token pages (the size it was written at):
  every claim at page 16 (the base) and 64 passes it; at page 1 a replayed sequence
  longer than that table's width reads the padding page for the rest of its keys;
* ``planted_idle_replay_skipped``: its decode graphs read the lengths from an array of
  its own, refreshed by the replay metadata, which returns early for a batch with no
  request ("nothing to plan"): an idle data-parallel rank's replay recomputes the previous
  batch's attention into rows that must be zero.  Every replay of a real batch is right.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

import attnreg
from attnreg.backends.triton_mla import TritonGraphBuffers, TritonMLABackend
from attnreg.registry import CaptureMemory, DeclarationContext, GraphMode, Phase

from ._common import spec, triton_like

OVER = "planted_memory_overdeclared"
UNDER = "planted_memory_undeclared"
PADDING = "planted_padding_rows"
PADDING_WIDE = "planted_padding_rows_wide"
PAGE_TABLE = "planted_page_table_p16"
IDLE = "planted_idle_replay_skipped"
#: the page size planted_page_table_p16 sizes its captured table for
WRITTEN_AT_PAGE = 16
#: from this many heads planted_padding_rows_wide writes non-zero padding rows
WIDE_HEADS = 64
#: The per-slot decode estimate the Triton declaration had before issue 15.
OLD_PER_SLOT = 128 * 32 * (512 + 1) * 4
#: What the undeclared scratch buffer takes.
SCRATCH_BYTES = 8 << 20


def capabilities_over(ctx: DeclarationContext) -> attnreg.Capabilities:
    caps = triton_like(OVER, ctx)
    modes = tuple(replace(g, capture_memory=CaptureMemory(per_batch_slot_bytes=OLD_PER_SLOT))
                  if (g.phase, g.mode) == (Phase.DECODE, GraphMode.FULL) else g
                  for g in caps.graph_modes)
    return replace(caps, graph_modes=modes)


def capabilities_under(ctx: DeclarationContext) -> attnreg.Capabilities:
    return triton_like(UNDER, ctx)


def capabilities_padding(ctx: DeclarationContext) -> attnreg.Capabilities:
    return triton_like(PADDING, ctx)


@dataclass
class ScratchBuffers(TritonGraphBuffers):
    scratch: torch.Tensor | None = None


class Undeclared(TritonMLABackend):
    def _init_graph_state_impl(self, state: Any) -> None:
        super()._init_graph_state_impl(state)
        # THE DEFECT: graph memory the declaration does not count
        state.buffers = ScratchBuffers(**vars(state.buffers),
                                       scratch=torch.empty(SCRATCH_BYTES, dtype=torch.uint8,
                                                           device=self.device))


class KeepsPaddingRows(TritonMLABackend):
    def zero_padded_rows(self, out: torch.Tensor, md: Any) -> None:
        # THE DEFECT: the rows of padding tokens keep whatever was in the output buffer
        return None


class KeepsPaddingRowsWhenWide(TritonMLABackend):
    # Triton's decode relies on its kernel writing zeros for a sequence of length 0 (no
    # zeroing launch), as flashinfer_mla's decode graphs do on flashinfer's
    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             **kwargs: Any) -> None:
        super()._forward_decode_impl(q, pool, md, out, **kwargs)
        if self.config.num_heads >= WIDE_HEADS and md.is_graph and self.graph_state:
            # THE DEFECT: at wide heads the padding rows get finite non-zero values, as a
            # kernel leaves them that folds empty sequences into another's partial
            # results (FlashMLA's fp8 decode does from 32 sequences up, on the H200)
            self.graph_state.fill_padded_rows(out, md, 1.0)


@dataclass
class OwnTableBuffers(TritonGraphBuffers):
    page_table: torch.Tensor | None = None


class PageTableSizedAtP16(TritonMLABackend):
    def _init_graph_state_impl(self, state: Any) -> None:
        super()._init_graph_state_impl(state)
        # the backend's own captured page table (as a library's index array a graph reads)
        table = torch.full((state.max_bs, state.max_pages), 0, dtype=torch.int32,
                           device=self.device)
        state.buffers = OwnTableBuffers(**vars(state.buffers), page_table=table)

    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             **kwargs: Any) -> None:
        buffers = self.graph_state.buffers if md.is_graph and self.graph_state else None
        if not isinstance(buffers, OwnTableBuffers) or buffers.page_table is None:
            return super()._forward_decode_impl(q, pool, md, out, **kwargs)
        # THE DEFECT: the columns refreshed are those of a table in 16-token pages; at a
        # smaller page size the rest keep the padding page the table was allocated with
        width = min(buffers.page_table.shape[1], -(-md.max_seq_len // WRITTEN_AT_PAGE))
        table = buffers.page_table[:md.batch_size]
        table[:, :width].copy_(md.page_table[:, :width])
        return super()._forward_decode_impl(q, pool, replace(md, indices=replace(
            md.indices, page_table=table)), out, **kwargs)


@dataclass
class OwnLengthsBuffers(TritonGraphBuffers):
    seq_lens: torch.Tensor | None = None


class SkipsIdleReplay(TritonMLABackend):
    def _init_graph_state_impl(self, state: Any) -> None:
        super()._init_graph_state_impl(state)
        # the backend's own captured lengths (as flashinfer's kv_indptr a plan refreshes)
        lens = torch.zeros(state.max_bs, dtype=torch.int32, device=self.device)
        state.buffers = OwnLengthsBuffers(**vars(state.buffers), seq_lens=lens)

    def _own_lengths(self) -> torch.Tensor | None:
        buffers = self.graph_state.buffers if self.graph_state else None
        return buffers.seq_lens if isinstance(buffers, OwnLengthsBuffers) else None

    def _init_capture_impl(self, md: Any) -> None:
        super()._init_capture_impl(md)
        lens = self._own_lengths()
        if lens is not None and md.is_decode:
            lens[:md.batch_size].copy_(md.seq_lens)

    def _init_replay_impl(self, md: Any, batch: Any) -> None:
        super()._init_replay_impl(md, batch)
        lens = self._own_lengths()
        if lens is None or not md.is_decode:
            return
        if not batch.seq_lens_cpu:
            # THE DEFECT: "an idle rank has nothing to attend": the lengths of the last
            # replay stay, and the graph recomputes that batch into the padding rows
            return
        lens[:md.batch_size].copy_(md.seq_lens)

    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             **kwargs: Any) -> None:
        lens = self._own_lengths() if md.is_graph else None
        if lens is None:
            return super()._forward_decode_impl(q, pool, md, out, **kwargs)
        return super()._forward_decode_impl(q, pool, replace(md, indices=replace(
            md.indices, seq_lens=lens[:md.batch_size])), out, **kwargs)


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    register(spec(OVER, "declares 2 GiB-style per-slot decode capture memory",
                  capabilities_over, "attnreg.backends.triton_mla:TritonMLABackend"))
    register(spec(UNDER, "allocates an undeclared graph buffer", capabilities_under,
                  f"{__name__}:Undeclared"))
    register(spec(PADDING, "leaves padding output rows unwritten", capabilities_padding,
                  f"{__name__}:KeepsPaddingRows"))
    register(spec(PADDING_WIDE, f"writes non-zero padding output rows from {WIDE_HEADS} "
                  "heads up", lambda ctx: triton_like(PADDING_WIDE, ctx),
                  f"{__name__}:KeepsPaddingRowsWhenWide"))
    register(spec(PAGE_TABLE, f"its decode graphs refresh their page table in "
                  f"{WRITTEN_AT_PAGE}-token pages", lambda ctx: triton_like(PAGE_TABLE, ctx),
                  f"{__name__}:PageTableSizedAtP16"))
    register(spec(IDLE, "its decode graphs keep the last lengths for a batch with no "
                  "request", lambda ctx: triton_like(IDLE, ctx),
                  f"{__name__}:SkipsIdleReplay"))

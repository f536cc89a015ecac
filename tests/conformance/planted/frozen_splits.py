"""(d) Split-KV chunk size planned from the capture batch and frozen (sglang #26019).

Decode splits each sequence's KV into ``SPLITS`` chunks of ``chunk`` tokens; the
chunk is planned on the host from the longest sequence.  Eagerly that is right.
Under capture it is planned once, from the capture batch, and never re-planned in
``init_forward_metadata_replay``: a replay with longer sequences drops every token
past ``SPLITS * chunk``.

``planted_frozen_splits_wide_pages`` has the same defect only where a second, newer
decode path would have it: pages of at least 64 tokens (the whole-page tiles of
triton's 16-head fp8 config) and a captured plan that splits.  The base configuration
is right, and graphs captured for many sequences (one split) are right: only split-KV
claims at the wide-page configurations (a page variant, the fp8 whole-page entry),
which capture few sequences, see it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import attnreg
from attnreg.backends._triton_kernels import mla_decode
from attnreg.backends.triton_mla import TritonMLABackend, TritonPlan
from attnreg.registry import DeclarationContext, Phase

from ._common import spec, triton_like

NAME = "planted_frozen_splits"
WIDE_PAGES_NAME = "planted_frozen_splits_wide_pages"
SPLITS = 4
#: the smallest page of the wide-pages backend's defective path
WIDE_PAGE = 64


def capabilities(ctx: DeclarationContext) -> attnreg.Capabilities:
    return triton_like(NAME, ctx)


def wide_pages_capabilities(ctx: DeclarationContext) -> attnreg.Capabilities:
    return triton_like(WIDE_PAGES_NAME, ctx)


def _chunk(max_seq_len: int) -> int:
    return max(1, -(-int(max_seq_len) // SPLITS))


@dataclass
class ChunkPlan(TritonPlan):
    """Triton's plan plus the planted backend's chunk length."""

    chunk: int = 1


class Backend(TritonMLABackend):
    def _init_metadata_impl(self, md: Any) -> None:
        super()._init_metadata_impl(md)
        if md.phase is Phase.DECODE:
            md.plan = ChunkPlan(md.plan.splits, md.plan.workspace, _chunk(md.max_seq_len))

    def _init_capture_impl(self, md: Any) -> None:
        super()._init_capture_impl(md)
        if md.phase is Phase.DECODE:
            # THE DEFECT: planned from the capture batch, and _init_replay_impl never
            # re-plans it for the lengths of each replay
            md.plan = ChunkPlan(md.plan.splits, md.plan.workspace,
                                _chunk(md.batch.max_seq_len if md.batch is not None else 1))

    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any,
                             out: torch.Tensor) -> None:
        covered = SPLITS * int(md.plan.chunk)
        rows = pool.buffer[md.page_table.long()].float()            # [B, P, ps, 576]
        rows = rows.reshape(rows.shape[0], -1, pool.row_dim) * pool.scale_tensor
        pos = torch.arange(rows.shape[1], device=q.device)
        visible = (pos[None, :] < md.seq_lens[:, None]) & (pos[None, :] < covered)
        scores = torch.einsum("bhd,bld->bhl", q.float(), rows) * self.config.softmax_scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out.copy_(torch.einsum("bhl,bld->bhd", probs, rows[..., :pool.kv_lora_rank]))


@dataclass
class CoveredPlan(TritonPlan):
    """Triton's plan plus the tokens a split plan frozen at capture covers."""

    covered: int = 0


class WidePagesBackend(TritonMLABackend):
    """Triton itself, but its captured decode plan on the wide-page split path is frozen
    from the capture batch: the kernel sees at most ``SPLITS * chunk`` tokens."""

    def _init_capture_impl(self, md: Any) -> None:
        super()._init_capture_impl(md)
        if md.is_decode and self.config.page_size >= WIDE_PAGE and md.plan.splits > 1:
            # THE DEFECT, on the wide-page split path only: planned from the capture
            # batch, never re-planned for the lengths of each replay
            covered = SPLITS * _chunk(md.batch.max_seq_len if md.batch is not None else 1)
            md.plan = CoveredPlan(md.plan.splits, md.plan.workspace, covered)

    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             *, lse: torch.Tensor | None = None) -> None:
        plan = self._plan(md)
        if not isinstance(plan, CoveredPlan):
            super()._forward_decode_impl(q, pool, md, out, lse=lse)
            return
        mla_decode(q, pool.buffer, md.page_table, md.seq_lens.clamp(max=plan.covered), out,
                   sm_scale=self.config.softmax_scale, kv_scale=self._kv_scale(pool),
                   max_splits=plan.splits, workspace=plan.workspace, lse=lse)


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    register(spec(NAME, "decode split plan frozen at capture", capabilities,
                  f"{__name__}:Backend"))
    register(spec(WIDE_PAGES_NAME, "decode split plan frozen at capture, pages >= 64 only",
                  wide_pages_capabilities, f"{__name__}:WidePagesBackend"))

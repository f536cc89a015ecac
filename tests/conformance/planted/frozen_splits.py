"""(d) Split-KV chunk size planned from the capture batch and frozen (sglang #26019).

Decode splits each sequence's KV into ``SPLITS`` chunks of ``chunk`` tokens; the
chunk is planned on the host from the longest sequence.  Eagerly that is right.
Under capture it is planned once, from the capture batch, and never re-planned in
``init_forward_metadata_replay``: a replay with longer sequences drops every token
past ``SPLITS * chunk``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import attnreg
from attnreg.backends.triton_mla import TritonMLABackend, TritonPlan
from attnreg.registry import DeclarationContext, Phase

from ._common import spec, triton_like

NAME = "planted_frozen_splits"
SPLITS = 4


def capabilities(ctx: DeclarationContext) -> attnreg.Capabilities:
    return triton_like(NAME, ctx)


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


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    register(spec(NAME, "decode split plan frozen at capture", capabilities,
                  f"{__name__}:Backend"))

"""Sparse (DSA) MLA defects, and a correct control, on a Triton-derived declaration.

The Triton declaration supplies a dense capture lifecycle that runs on cpu (the
sparse claims' graph session needs one); each backend adds a sparse kernel over
bf16 rows, captured natively in decode FULL and prefill BREAKABLE graphs.  The
sparse math is the reference's (:func:`sparse_attention_with_lse`), except where a
defect is planted:

* ``planted_dsa_ignores_indices``: attends every token of the sequence (dense),
  whatever the indices say;
* ``planted_dsa_reads_invalid``: treats -1 as a slot (torch reads the pool's last
  row for it) instead of no key;
* ``planted_dsa_wrong_scale_block``: declares a sparse kernel over ``fp8_ds_mla``
  rows (a pool of 656-byte rows, ``MLAKVPool(kv_format="fp8_ds_mla")``) and
  dequantises each 128-value latent block with the next block's scale;
* ``dsa_control``: no defect, over bf16 rows and over ``fp8_ds_mla`` rows: every
  sparse claim must be verified.
"""

from __future__ import annotations

from typing import Any

import torch

import attnreg
from attnreg.backends.reference import sparse_attention_with_lse
from attnreg.backends.triton_mla import TritonMLABackend
from attnreg.registry import (
    CaptureSupport,
    DeclarationContext,
    DType,
    GraphMode,
    GraphModeSupport,
    Phase,
    SparseKernel,
    SparseKVFormat,
)
from attnreg.runtime.kv_formats import FP8_DS_MLA_TILE, unpack_fp8_ds_mla

from ._common import spec, triton_like

IGNORES = "planted_dsa_ignores_indices"
READS_INVALID = "planted_dsa_reads_invalid"
WRONG_SCALE = "planted_dsa_wrong_scale_block"
CONTROL = "dsa_control"


def _kernel(fmt: SparseKVFormat) -> SparseKernel:
    return SparseKernel(frozenset({Phase.DECODE, Phase.PREFILL}), frozenset({DType.BF16}), fmt,
                        page_sizes=(16, 64), max_heads=128, max_top_k=2048,
                        kernel=f"torch (sparse over {fmt} rows, test)", lse=True)


def _declaration(name: str, ctx: DeclarationContext) -> attnreg.Capabilities:
    formats = {CONTROL: (SparseKVFormat.BF16, SparseKVFormat.FP8_DS_MLA),
               WRONG_SCALE: (SparseKVFormat.FP8_DS_MLA,)}.get(name, (SparseKVFormat.BF16,))
    modes = (
        GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.native()),
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE, CaptureSupport.native()),
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE,
                         CaptureSupport.unsupported("not run for this test backend")),
    )
    return triton_like(name, ctx, sparse_kernels=tuple(_kernel(f) for f in formats),
                       sparse_graph_modes=modes)


class Control(TritonMLABackend):
    def _forward_sparse_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             indices: torch.Tensor, *, lse: torch.Tensor | None = None) -> None:
        o, row_lse = sparse_attention_with_lse(q, pool, indices, self.config.softmax_scale)
        out.copy_(o.to(out.dtype))
        if lse is not None:
            lse.copy_(row_lse)


class IgnoresIndices(Control):
    def _forward_sparse_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             indices: torch.Tensor, *, lse: torch.Tensor | None = None) -> None:
        # THE DEFECT: the whole visible context, as dense attention would read it
        rows: list[list[int]] = []
        table = md.page_table.cpu().long()
        lens = md.seq_lens.cpu().tolist()
        extend = md.extend_lens.cpu().tolist()
        for b, (length, new) in enumerate(zip(lens, extend)):
            for t in range(new):
                visible = length - new + t + 1
                rows.append([int(table[b, p // pool.page_size]) * pool.page_size
                             + p % pool.page_size for p in range(visible)])
        width = max((len(r) for r in rows), default=1)
        dense = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32,
                             device=q.device)
        super()._forward_sparse_impl(q, pool, md, out, dense, lse=lse)


class ReadsInvalid(Control):
    def _forward_sparse_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             indices: torch.Tensor, *, lse: torch.Tensor | None = None) -> None:
        # THE DEFECT: no mask for -1: torch's negative indexing reads the pool's last slot
        kv = pool.read_slots(indices.reshape(-1)).view(*indices.shape, -1)
        scores = torch.einsum("rhd,rkd->rhk", q.float(), kv) * self.config.softmax_scale
        row_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.softmax(scores, dim=-1)
        out.copy_(torch.einsum("rhk,rkd->rhd", probs, kv[..., :pool.kv_lora_rank]).to(out.dtype))
        if lse is not None:
            lse.copy_(row_lse)


class _MisreadScales:
    """A pool layer read back with each latent block scaled by the next block's scale."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.kv_lora_rank = layer.kv_lora_rank

    def read_slots(self, slots: torch.Tensor) -> torch.Tensor:
        packed = self.layer.buffer.view(self.layer.num_slots, -1)[slots.long()].clone()
        end = self.kv_lora_rank + 4 * (self.kv_lora_rank // FP8_DS_MLA_TILE)
        scales = packed[:, self.kv_lora_rank:end].contiguous().view(torch.float32)
        # THE DEFECT: block i's values times block i+1's scale (the scale array read one
        # float32 too far along, wrapping)
        packed[:, self.kv_lora_rank:end] = torch.roll(scales, -1, dims=1).contiguous().view(
            torch.uint8)
        return unpack_fp8_ds_mla(packed, self.kv_lora_rank)


class WrongScaleBlock(Control):
    def _forward_sparse_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             indices: torch.Tensor, *, lse: torch.Tensor | None = None) -> None:
        super()._forward_sparse_impl(q, _MisreadScales(pool), md, out, indices, lse=lse)


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    for name, cls, what in ((IGNORES, "IgnoresIndices", "sparse attention ignores the indices"),
                            (READS_INVALID, "ReadsInvalid", "sparse attention reads index -1"),
                            (WRONG_SCALE, "WrongScaleBlock",
                             "fp8_ds_mla rows read with the next block's scale"),
                            (CONTROL, "Control", "a correct sparse path (the control)")):
        register(spec(name, what, lambda ctx, n=name: _declaration(n, ctx),
                      f"{__name__}:{cls}"))

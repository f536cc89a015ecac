"""Sparse (DSA) MLA forwards: attention restricted to the tokens a top-k indexer picked.

:class:`SparseForward` is mixed into :class:`~attnreg.runtime.AttentionBackend`:
``forward_sparse`` serves a decode batch (one index row per sequence) and an extend
batch (one per new token) alike.  It refuses, through the backend's
:class:`~attnreg.runtime.refusals.RequestChecker`, anything outside
``Capabilities.sparse_kernels`` / ``sparse_graph_modes`` and any index that is neither
-1 nor a slot of the pool, before the kernel; then writes the new rows and calls the
backend's ``_forward_sparse_impl``.  The contract is docs/sparse.md's.
"""

from __future__ import annotations

from typing import Any

import torch

from attnreg.registry import GraphMode

from .batch import ForwardBatch
from .metadata import ForwardMetadata
from .pool import MLAKVLayer, MLAKVPool

__all__ = ["FP8_DS_MLA_TILE", "SparseForward", "pack_fp8_ds_mla", "unpack_fp8_ds_mla"]

#: Latent values per float32 scale of an ``fp8_ds_mla`` row (4 tiles of 128 = 512).
FP8_DS_MLA_TILE = 128
_E4M3_MAX = 448.0


def pack_fp8_ds_mla(rows: torch.Tensor, kv_lora_rank: int = 512) -> torch.Tensor:
    """``[N, 576]`` rows (latent then rope) as ``fp8_ds_mla`` bytes ``uint8 [N, 656]``.

    The layout of :class:`~attnreg.registry.SparseKVFormat` ``FP8_DS_MLA``: bytes
    0..511 the latent as float8 e4m3, each tile of 128 values divided by its scale;
    bytes 512..527 the 4 float32 scales (``max |tile| / 448``, so the largest value
    of a tile is 448; an all-zero tile gets scale 1); bytes 528..655 the 64 rope
    values as bf16.  Dequantised value = e4m3 value x its tile's scale.
    """
    n = rows.shape[0]
    latent = rows[:, :kv_lora_rank].float().reshape(n, -1, FP8_DS_MLA_TILE)
    scales = latent.abs().amax(dim=-1) / _E4M3_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    quant = (latent / scales[..., None]).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    rope = rows[:, kv_lora_rank:].to(torch.bfloat16).contiguous()
    return torch.cat([quant.reshape(n, -1).view(torch.uint8),
                      scales.to(torch.float32).contiguous().view(torch.uint8),
                      rope.view(torch.uint8)], dim=-1)


def unpack_fp8_ds_mla(packed: torch.Tensor, kv_lora_rank: int = 512) -> torch.Tensor:
    """``fp8_ds_mla`` bytes ``[N, 656]`` as float32 rows ``[N, 576]`` (the inverse of
    :func:`pack_fp8_ds_mla`, up to the e4m3 rounding)."""
    n, tiles = packed.shape[0], kv_lora_rank // FP8_DS_MLA_TILE
    scale_end = kv_lora_rank + 4 * tiles
    quant = packed[:, :kv_lora_rank].contiguous().view(torch.float8_e4m3fn).float()
    scales = packed[:, kv_lora_rank:scale_end].contiguous().view(torch.float32)
    latent = (quant.reshape(n, tiles, FP8_DS_MLA_TILE) * scales[..., None]).reshape(n, -1)
    rope = packed[:, scale_end:].contiguous().view(torch.bfloat16).float()
    return torch.cat([latent, rope], dim=-1)


class SparseForward:
    """The sparse half of the backend contract (a mixin of ``AttentionBackend``)."""

    def forward_sparse(self, q: torch.Tensor, latent_new: torch.Tensor | None,
                       rope_new: torch.Tensor | None, pool: MLAKVPool,
                       batch: ForwardBatch | None = None, *, topk_indices: torch.Tensor,
                       out: torch.Tensor | None = None, layer_id: int = 0,
                       return_lse: bool = False, lse: torch.Tensor | None = None) -> Any:
        """Write the new tokens' rows (as :meth:`forward_decode` / :meth:`forward_extend`
        do), then sparse MLA: query row ``i`` (a decode sequence, or a new token of an
        extend batch) attends the pool slots ``topk_indices[i]`` only.

        ``q [R, H, 576]``; ``topk_indices`` int32 ``[R, top_k]``, each entry a pool slot
        (``page * page_size + offset``) or -1 (no key); a slot listed twice counts
        twice; no causal mask (the indexer chose the tokens).  Returns ``[R, H, 512]``,
        or ``(out, lse)`` where the sparse kernel declares ``lse``; a row with no key
        gets 0 and an LSE of ``-inf``.  Eagerly every index is checked on the host
        first (one sync); under capture, check them where the static index tensor is
        filled (:func:`attnreg.runtime.refusals.sparse_index_problems`).
        """
        backend: Any = self
        md: ForwardMetadata[Any] = backend._metadata_for(batch)
        mode: GraphMode = backend.active_graph_mode(md.phase)
        kv: MLAKVLayer = backend._layer(pool, layer_id)
        want_lse = return_lse or lse is not None
        backend._refuse(backend.refusals.sparse(md, mode, q, kv, topk_indices, latent_new,
                                                rope_new, out, lse, want_lse))
        if latent_new is not None and rope_new is not None:
            backend._write_kv(kv, md, latent_new, rope_new)
        if out is None:
            out = q.new_empty((*q.shape[:2], backend.config.kv_lora_rank))
        lse_out = backend._lse(lse, q) if want_lse else None
        self._forward_sparse_impl(q, kv, md, out, topk_indices, lse=lse_out)
        if lse_out is None:
            return out
        backend._mask_padded_lse(lse_out, md)
        return out, lse_out

    def _forward_sparse_impl(self, q: torch.Tensor, pool: MLAKVLayer, md: ForwardMetadata[Any],
                             out: torch.Tensor, indices: torch.Tensor, *,
                             lse: torch.Tensor | None = None) -> None:
        """Sparse MLA into ``out`` (and ``lse``, float32 ``[R, H]``, where declared): row
        ``i`` attends the slots ``indices[i]``, already checked (each -1 or a pool slot),
        as :meth:`forward_sparse` says.  Only for the phases of the backend's
        ``sparse_kernels``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement sparse MLA")

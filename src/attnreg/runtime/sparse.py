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
from .forward_io import lse_for, output_for
from .kv_formats import FP8_DS_MLA_TILE, pack_fp8_ds_mla, unpack_fp8_ds_mla
from .metadata import ForwardMetadata
from .pool import MLAKVLayer, MLAKVPool

__all__ = ["FP8_DS_MLA_TILE", "SparseForward", "pack_fp8_ds_mla", "unpack_fp8_ds_mla"]


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
        out = output_for(q, out, q.shape[0], backend.config.kv_lora_rank)
        lse_out = lse_for(lse, q) if want_lse else None
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

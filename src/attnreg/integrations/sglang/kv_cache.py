"""sglang's MLA token-to-KV pool as an attnreg :class:`~attnreg.runtime.MLAKVPool`, without a copy.

sglang 0.5.23's ``MLATokenToKVPool`` keeps one tensor per layer,
``kv_buffer[i]`` of shape ``[size + page_size, 1, kv_lora_rank + rope]``:
one 576-wide row per token slot, slot ``s`` of page ``s // page_size``,
slots ``0 .. page_size - 1`` reserved for padded graph replays.  That is
attnreg's layout exactly (``[num_pages, page_size, 576]`` per layer, page 0
the padding page), so :func:`wrap_mla_pool` views the same storage:

* bf16 / fp16 pools: a reshape of each layer's tensor (same storage);
* fp8 pools: sglang stores ``float8_e4m3fn`` as ``uint8`` (``index_put`` has no
  fp8 kernel); the view reinterprets the bytes as ``float8_e4m3fn``, no copy.
  Both store ``value / k_scale`` with one scale per layer (sglang's
  ``layer.k_scale``, attnreg's per-layer pool scale) and saturate at +-448;
* a pool whose ``size`` is not a whole number of pages: the slots past the last
  whole page belong to no page of the engine's page table; the view leaves them
  out (:attr:`SglangKVCache.unpaged_slots`), still without a copy.

What is not wrapped, with the reason, raises :class:`~attnreg.registry.UnsupportedError`:
subclasses with another row format (FP4, the DSA/NSA packed fp8 cache),
fp8_e5m2 pools, and rows that are not ``kv_lora_rank + qk_rope_head_dim`` wide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attnreg.registry import DType, UnsupportedError
from attnreg.runtime import MLAKVPool, dtype_from_torch

__all__ = ["SglangKVCache", "wrap_mla_pool"]

#: sglang pool dtypes attnreg reads (``pool.dtype``, the logical dtype; fp8 is stored as uint8).
_KV_DTYPES: dict[torch.dtype, DType] = {
    torch.bfloat16: DType.BF16,
    torch.float16: DType.FP16,
    torch.float8_e4m3fn: DType.FP8_E4M3,
}


@dataclass(frozen=True)
class SglangKVCache:
    """attnreg's view of one sglang MLA pool.

    ``pool`` has one layer per sglang layer of this rank: sglang's layer
    ``layer_id`` is attnreg's ``layer_id - start_layer`` (pipeline parallelism
    gives a rank the layers from ``start_layer``).  ``unpaged_slots`` counts the
    slots at the end of each buffer that no page covers (left out of the view).
    """

    pool: MLAKVPool
    start_layer: int
    page_size: int
    kv_dtype: DType
    unpaged_slots: int = 0

    def layer_index(self, layer_id: int) -> int:
        """attnreg's layer for sglang's ``layer.layer_id``."""
        return int(layer_id) - self.start_layer


def _refuse(what: str, reason: str, hint: str) -> UnsupportedError:
    return UnsupportedError("sglang bridge", what, reason, hint)


def wrap_mla_pool(token_to_kv_pool: Any, *, scales: float | Sequence[float] = 1.0
                  ) -> SglangKVCache:
    """View sglang's ``MLATokenToKVPool`` as an attnreg pool (no copy).

    Parameters
    ----------
    token_to_kv_pool
        The model runner's ``token_to_kv_pool`` (an ``MLATokenToKVPool``).
    scales
        The layers' fp8 scales (sglang's ``layer.k_scale``, 1.0 where a layer
        has none): one float for all layers or one per layer of this rank.
        Ignored (kept at 1.0) for a 16-bit pool.

    Raises
    ------
    UnsupportedError
        For a pool whose format attnreg does not declare (see the module doc).
    """
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    cls = type(token_to_kv_pool)
    if cls is not MLATokenToKVPool:
        raise _refuse(f"KV pool {cls.__name__}",
                      "attnreg reads sglang's plain MLATokenToKVPool only (one 576-wide row "
                      "of latent + rope per token); FP4, DSA/NSA and hybrid pools store "
                      "another format",
                      "use an MLA model with a bf16, fp16 or fp8_e4m3 KV cache")
    pool = token_to_kv_pool
    kv_dtype = _KV_DTYPES.get(pool.dtype)
    if kv_dtype is None:
        raise _refuse(f"KV cache dtype {pool.dtype}",
                      "attnreg declares bf16, fp16 and fp8_e4m3 MLA pools",
                      "pass --kv-cache-dtype auto (the model dtype) or fp8_e4m3")
    row = int(pool.kv_lora_rank) + int(pool.qk_rope_head_dim)
    if getattr(pool, "use_dsa", False) or int(pool.kv_cache_dim) != row:
        raise _refuse("KV pool row format",
                      f"rows of {pool.kv_cache_dim} values (DSA's packed cache), attnreg "
                      f"reads latent + rope rows of {row}",
                      "use a dense MLA attention backend for sparse-attention models")
    page_size = int(pool.page_size)
    buffers = []
    unpaged = 0
    for tensor in pool.kv_buffer:
        if not tensor.is_contiguous():
            raise _refuse("KV pool buffer", "a layer's buffer is not contiguous",
                          "attnreg views sglang's buffers without copying them")
        rows = tensor.view(-1, row)
        usable = rows.shape[0] - rows.shape[0] % page_size
        unpaged = rows.shape[0] - usable
        buffers.append(rows[:usable])
    if not isinstance(scales, (int, float)):
        scales = [float(s) for s in scales]
    if kv_dtype is not DType.FP8_E4M3:
        scales = 1.0
    wrapped = MLAKVPool.wrap(buffers, page_size, kv_dtype=kv_dtype, scale=scales,
                             kv_lora_rank=int(pool.kv_lora_rank),
                             rope_dim=int(pool.qk_rope_head_dim))
    assert dtype_from_torch(wrapped.dtype) is kv_dtype
    return SglangKVCache(wrapped, int(pool.start_layer), page_size, kv_dtype, unpaged)

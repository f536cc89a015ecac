"""KV row formats a pool can hold besides its 576-value rows: DeepSeek-V3.2's ``fp8_ds_mla``.

``fp8_ds_mla`` (:class:`~attnreg.registry.SparseKVFormat` ``FP8_DS_MLA``) is the
656-byte row FlashMLA's sparse decode reads (``is_fp8_kvcache=True``, ``kv_format``
V3.2) and vLLM's ``fp8_ds_mla`` cache stores: bytes 0..511 the 512 latent values as
float8 e4m3, each tile of 128 divided by its scale; bytes 512..527 the 4 float32
scales (``max |tile| / 448``, so a tile's largest value is stored as 448; an all-zero
tile gets scale 1); bytes 528..655 the 64 rope values as bf16.  Dequantised value =
e4m3 value x its tile's scale.

Both functions are device operations only (no host read), so a pool's write packs
inside a captured graph too.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_DS_MLA_TILE", "fp8_ds_mla_row_bytes", "pack_fp8_ds_mla", "unpack_fp8_ds_mla"]

#: Latent values per float32 scale of an ``fp8_ds_mla`` row (4 tiles of 128 = 512).
FP8_DS_MLA_TILE = 128
_E4M3_MAX = 448.0


def fp8_ds_mla_row_bytes(kv_lora_rank: int = 512, rope_dim: int = 64) -> int:
    """Bytes of one ``fp8_ds_mla`` row: latent e4m3, one float32 per tile, rope bf16 (656)."""
    return kv_lora_rank + 4 * (kv_lora_rank // FP8_DS_MLA_TILE) + 2 * rope_dim


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

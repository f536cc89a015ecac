"""Shared builders of backend test inputs: a pool with prefix tokens already
written, a batch over it, and the raw (unquantised) tensors that went in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnreg.runtime import ForwardBatch, MLAConfig, MLAKVPool, decode_batch, extend_batch

#: fp8 pools in tests use this scale, so bf16 inputs of magnitude ~3 use much of the range.
FP8_SCALE = 0.02


@dataclass
class Scenario:
    cfg: MLAConfig
    pool: MLAKVPool
    batch: ForwardBatch
    q: torch.Tensor                   # [B or T, H, 576] (MLA) or [T, H, 192] (MHA)
    latent_new: torch.Tensor          # [T, 512]
    rope_new: torch.Tensor            # [T, 64]
    seq_latent: list[torch.Tensor]    # per sequence [L, 512]: prefix then new tokens
    seq_rope: list[torch.Tensor]      # per sequence [L, 64]
    k: torch.Tensor | None = None     # MHA [Tk, H, 192]
    v: torch.Tensor | None = None     # MHA [Tk, H, 128]


def _rand(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


def make_pool(cfg: MLAConfig, seq_lens: list[int], spare_pages: int = 3) -> MLAKVPool:
    pages = sum(-(-n // cfg.page_size) for n in seq_lens) + 1 + spare_pages
    return cfg.make_pool(pages, scale=FP8_SCALE if cfg.kv_dtype.value == "fp8_e4m3" else 1.0)


def make_scenario(cfg: MLAConfig, prefix_lens: list[int], extend_lens: list[int], *,
                  decode: bool = False, mha: bool = False, seed: int = 0,
                  q_dtype: torch.dtype = torch.bfloat16, shuffle: bool = True,
                  pool: MLAKVPool | None = None) -> Scenario:
    """Pool with the prefixes written, a batch of the new tokens, random inputs.

    ``pool``: reuse an existing pool (pages are taken from its free list)."""
    gen = torch.Generator().manual_seed(seed)
    dev = cfg.device
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool = make_pool(cfg, seq_lens) if pool is None else pool
    pages = pool.allocate(seq_lens, shuffle=seed if shuffle else False)
    seq_latent, seq_rope = [], []
    for owned, n, p in zip(pages, seq_lens, prefix_lens):
        lat = _rand(gen, n, cfg.kv_lora_rank, dtype=q_dtype, device=dev)
        rope = _rand(gen, n, cfg.qk_rope_head_dim, dtype=q_dtype, device=dev)
        seq_latent.append(lat)
        seq_rope.append(rope)
        if p:
            slots = torch.tensor(pool.slots(owned, range(p)), dtype=torch.int32, device=dev)
            pool.write(slots, lat[:p], rope[:p])
    if decode:
        batch = decode_batch(pool, seq_lens, pages=pages)
    else:
        batch = extend_batch(pool, prefix_lens, extend_lens, pages=pages)
    latent_new = torch.cat([lat[p:] for lat, p in zip(seq_latent, prefix_lens)])
    rope_new = torch.cat([r[p:] for r, p in zip(seq_rope, prefix_lens)])
    t, h = batch.num_tokens, cfg.num_heads
    k = v = None
    if mha:
        qk, dv = cfg.mha_head_dims
        q = _rand(gen, t, h, qk, dtype=q_dtype, device=dev)
        k = _rand(gen, batch.num_kv_tokens, h, qk, dtype=q_dtype, device=dev)
        v = _rand(gen, batch.num_kv_tokens, h, dv, dtype=q_dtype, device=dev)
    else:
        q = _rand(gen, t, h, cfg.kv_row_dim, dtype=q_dtype, device=dev)
    return Scenario(cfg, pool, batch, q, latent_new, rope_new, seq_latent, seq_rope, k, v)

"""Random pools and step inputs for the CPU session tests (one copy for every file).

Seeded, so each test's numbers are the same on every run; the pool's every layer is
filled (page 0 included, as an engine's pool holds whatever padding wrote there).
"""
from __future__ import annotations

import torch

from attnreg.runtime import MLAConfig, MLAKVPool, StepInputs


def random_pool(cfg: MLAConfig, pages: int = 60, *, layers: int = 1,
                seed: int = 5) -> MLAKVPool:
    """A pool of ``pages`` pages and ``layers`` layers of seeded random KV."""
    pool = cfg.make_pool(pages, num_layers=layers)
    g = torch.Generator().manual_seed(seed)
    for layer in pool.layers:
        layer.buffer.copy_(torch.randn(layer.buffer.shape, generator=g).to(layer.buffer.dtype))
    return pool


def random_inputs(rows: int, heads: int, *, layers: int = 1, seed: int = 0,
                  dim: int = 576) -> StepInputs:
    """bf16 queries ``[rows, heads, dim]`` for ``layers`` layers, seeded."""
    g = torch.Generator().manual_seed(seed)
    return StepInputs([torch.randn(rows, heads, dim, generator=g).bfloat16()
                       for _ in range(layers)])

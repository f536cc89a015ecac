"""KV pools filled with random rows, flat slots of a batch, and the relative error of an output.

Measurements run on random data, never zeros (a kernel may shortcut zeros,
and a wrong kernel can look right on them).  torch is passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["kv_slots_of", "random_pool", "rel_error"]


def random_pool(torch: Any, config: Any, tokens: int, seed: int) -> Any:
    """A pool of ``config`` with room for ``tokens`` tokens (plus the padding page), rows ~N(0, 1).

    Parameters
    ----------
    torch : module
    config : MLAConfig
        ``config.make_pool(num_pages)`` builds the pool.
    tokens : int
        Tokens the pool must hold (rounded up to whole pages).
    seed : int
        Seeds the values, so a measurement can be repeated on the same data.
    """
    pool = config.make_pool(-(-tokens // config.page_size) + 2)
    gen = torch.Generator(device=pool.device).manual_seed(seed)
    if pool.buffer.dtype.itemsize == 1:
        # an fp8 buffer has no normal_: draw in float32 and round (values ~N(0, 1))
        noise = torch.empty(pool.buffer.shape, dtype=torch.float32, device=pool.device)
        pool.buffer.copy_(noise.normal_(generator=gen).to(pool.buffer.dtype))
        return pool
    # normal_ with a generator on a bf16 buffer: values ~N(0, 1), never zeros.
    pool.buffer.normal_(generator=gen)
    return pool


def kv_slots_of(torch: Any, pool: Any, pages: Sequence[Sequence[int]],
                seq_lens: Sequence[int]) -> Any:
    """Flat slots of every token of every sequence, in ``kv_indptr`` order (int64)."""
    slots: list[int] = []
    for p, n in zip(pages, seq_lens):
        slots.extend(pool.slots(p, range(n)))
    return torch.tensor(slots, dtype=torch.long, device=pool.device)


def rel_error(torch: Any, out: Any, ref: Any) -> float:
    """``||out - ref|| / ||ref||`` in float32; inf when ``out`` holds a NaN or an inf.

    A NaN-poisoned output buffer that a kernel did not fully write therefore
    never passes a tolerance check.
    """
    o, r = out.float(), ref.float()
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    return float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r).clamp_min(1e-30))

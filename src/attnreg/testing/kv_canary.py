"""Canary fills of a KV pool for tests: fill every row with one value, list the rows that lost it.

Test code, kept out of :class:`~attnreg.runtime.MLAKVPool` (the pool is
storage and an allocator).  The conformance harness itself compares against
a byte copy of the pool instead (:mod:`attnreg.testing.integrity`), which also
covers rows that hold real tokens; a canary is the quick check for unit tests
that only ask "did anything write outside these slots".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnreg.runtime import PADDING_PAGE, MLAKVPool

__all__ = ["Canary"]


class Canary:
    """A pool filled with one value, and which slots no longer hold it.

    The default value is finite on purpose: a kernel that loads a whole tile and
    masks the scores multiplies the masked values by a zero probability, which is
    harmless for a finite value but NaN for a NaN.

    Examples
    --------
    >>> pool = MLAKVPool(num_pages=4, page_size=2, kv_lora_rank=2, rope_dim=1)
    >>> canary = Canary.fill(pool)
    >>> pool.write([5], torch.ones(1, 2), torch.ones(1, 1))
    >>> canary.corrupted_slots()
    [5]
    >>> canary.corrupted_slots([5])
    []
    """

    def __init__(self, pool: MLAKVPool, pattern: torch.Tensor) -> None:
        self.pool = pool
        self.pattern = pattern

    @classmethod
    def fill(cls, pool: MLAKVPool, value: float = -3.0) -> Canary:
        """Fill every slot of every layer of ``pool`` with ``value`` (for ``fp8_ds_mla``
        rows: the packed row of ``value``, see :meth:`MLAKVLayer.fill`)."""
        for layer in pool.layers:
            layer.fill(value)
        return cls(pool, pool.layers[0].buffer[0, 0].clone())

    def corrupted_slots(self, written: Sequence[int] | torch.Tensor = (), *,
                        layer_id: int | None = None) -> list[int]:
        """Slots outside ``written`` (and outside the padding page) that lost the canary.

        ``layer_id``: check that layer only; None (default) checks every layer
        and lists a slot changed in any of them.  Compares bytes, so it also
        works for fp8 and NaN canaries.
        """
        pool = self.pool
        layers = pool.layers if layer_id is None else (pool.layer(layer_id),)
        ref = self.pattern.view(torch.uint8)
        changed = torch.zeros(pool.num_slots, dtype=torch.bool, device=pool.device)
        for layer in layers:
            flat = layer.buffer.view(pool.num_slots, -1).view(torch.uint8)
            changed |= (flat != ref).any(dim=1)
        changed[: (PADDING_PAGE + 1) * pool.page_size] = False
        if isinstance(written, torch.Tensor):
            idx = written.to(device=changed.device, dtype=torch.long)
        else:
            idx = torch.tensor(list(written), dtype=torch.long, device=changed.device)
        if idx.numel():
            changed[idx] = False
        return [int(i) for i in torch.nonzero(changed).flatten().tolist()]

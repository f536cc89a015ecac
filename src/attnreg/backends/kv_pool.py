"""Deprecated: the KV pool moved to :mod:`attnreg.runtime` (``attnreg.runtime.MLAKVPool``).

Kept importable for one release as re-exports.
"""

from __future__ import annotations

import warnings

from attnreg.runtime import (
    FP8_E4M3_MAX,
    PADDING_PAGE,
    MLAKVPool,
    dtype_from_torch,
    resolve_device,
    torch_dtype,
)

__all__ = ["FP8_E4M3_MAX", "PADDING_PAGE", "MLAKVPool", "dtype_from_torch", "resolve_device",
           "torch_dtype"]

warnings.warn("attnreg.backends.kv_pool is deprecated and will be removed in the next "
              "release; import MLAKVPool, PADDING_PAGE, torch_dtype from attnreg.runtime",
              DeprecationWarning, stacklevel=2)

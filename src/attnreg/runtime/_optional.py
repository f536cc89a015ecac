"""The runtime's optional Triton kernel modules, imported on first use.

``attnreg.runtime`` must import without triton (DESIGN.md: no kernel library at import
time outside ``backends/``); its fused kernels (``_quantize_q_kernel``,
``_pad_rows_kernel``) import triton, so callers ask for them here when a CUDA tensor
reaches them and fall back to the torch form when this returns None.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.cache
def triton_kernel_module(name: str) -> ModuleType | None:
    """``attnreg.runtime.<name>``, or None when it cannot be imported (no triton)."""
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:
        return None

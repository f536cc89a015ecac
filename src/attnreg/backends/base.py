"""Deprecated: the runtime interface moved to :mod:`attnreg.runtime`.

Kept importable for one release as re-exports; import from ``attnreg.runtime``
instead (``from attnreg.runtime import AttentionBackend, MLAConfig``).
"""

from __future__ import annotations

import warnings

from attnreg.runtime import (
    ATTENTION_CAPTURE_MODES,
    AttentionBackend,
    ForwardMetadata,
    GraphState,
    KernelErrors,
    MLAConfig,
    phase_of,
)

__all__ = [
    "ATTENTION_CAPTURE_MODES",
    "AttentionBackend",
    "ForwardMetadata",
    "GraphState",
    "KernelErrors",
    "MLAConfig",
    "phase_of",
]

warnings.warn("attnreg.backends.base is deprecated and will be removed in the next release; "
              "import AttentionBackend, MLAConfig, ForwardMetadata, GraphState, KernelErrors "
              "from attnreg.runtime", DeprecationWarning, stacklevel=2)

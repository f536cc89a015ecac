"""Deprecated: batches moved to :mod:`attnreg.runtime` (``ForwardBatch``, ``decode_batch``,
``extend_batch``).  Kept importable for one release as re-exports.
"""

from __future__ import annotations

import warnings

from attnreg.runtime import ForwardBatch, decode_batch, extend_batch

__all__ = ["ForwardBatch", "decode_batch", "extend_batch"]

warnings.warn("attnreg.backends.batch is deprecated and will be removed in the next release; "
              "import ForwardBatch, decode_batch, extend_batch from attnreg.runtime",
              DeprecationWarning, stacklevel=2)

"""What a forward allocates for its caller and hands its backend's hook, beside the inputs.

One place for the output's dtype (an fp8 query's output is the model's bf16), the LSE
buffer's shape, and the hook's optional keywords, which reach a hook only when given, so
a backend declaring neither an LSE nor an fp8 query keeps the hook signature it was
written with.
"""

from __future__ import annotations

import torch

from .dtypes import output_dtype

__all__ = ["hook_options", "lse_for", "output_for"]

_NOTHING: dict[str, torch.Tensor] = {}


def output_for(q: torch.Tensor, out: torch.Tensor | None, rows: int,
               v_dim: int) -> torch.Tensor:
    """``out`` (already checked), else a new ``[rows, heads, v_dim]`` in q's output dtype."""
    if out is not None:
        return out
    return q.new_empty((rows, q.shape[1], v_dim), dtype=output_dtype(q.dtype))


def lse_for(given: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """``given`` (already checked), else a float32 ``[q rows, heads]``."""
    return given if given is not None else q.new_empty(q.shape[:2], dtype=torch.float32)


def hook_options(q_scale: torch.Tensor | None,
                 lse: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The forward hook's optional keywords (``q_scale``, ``lse``), each only when given."""
    if q_scale is None and lse is None:
        return _NOTHING  # the common call: nothing built (a forward runs per layer per step)
    return {k: v for k, v in (("q_scale", q_scale), ("lse", lse)) if v is not None}

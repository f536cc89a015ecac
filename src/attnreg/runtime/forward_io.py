"""What a forward allocates for its caller and hands its backend's hook, beside the inputs.

One place for the output's dtype (an fp8 query's output is the model's bf16), the LSE
buffer's shape, and the hook's optional keywords, which reach a hook only when given, so
a backend declaring neither an LSE nor an fp8 query keeps the hook signature it was
written with.  A backend whose hooks return their kernel library's own output tensor
(``AttentionBackend.returns_kernel_output``) gets ``out=None`` when the caller gave none,
so the library's result is not copied into a second tensor.
"""

from __future__ import annotations

import torch

from .dtypes import output_dtype

__all__ = ["hook_options", "hook_result", "lse_for", "output_for"]

_NOTHING: dict[str, torch.Tensor] = {}


def output_for(q: torch.Tensor, out: torch.Tensor | None, rows: int, v_dim: int, *,
               kernel_owns: bool = False) -> torch.Tensor | None:
    """``out`` (already checked), else a new ``[rows, heads, v_dim]`` in q's output dtype;
    None when ``kernel_owns`` and no ``out`` was given (the hook returns its kernel's)."""
    if out is not None or kernel_owns:
        return out
    return q.new_empty((rows, q.shape[1], v_dim), dtype=output_dtype(q.dtype))


def hook_result(hook: str, out: torch.Tensor | None, returned: object, q: torch.Tensor,
                rows: int, v_dim: int) -> torch.Tensor:
    """The forward's output: ``out`` when the hook was given one, else the tensor it returned
    (checked: a wrong shape, dtype or layout would reach the engine's next layer)."""
    if out is not None:
        return out
    want = (rows, q.shape[1], v_dim)
    dtype = output_dtype(q.dtype)
    if isinstance(returned, torch.Tensor) and tuple(returned.shape) == want and \
            returned.dtype == dtype and returned.is_contiguous():
        return returned
    got = (f"a {'' if returned.is_contiguous() else 'non-contiguous '}{returned.dtype} tensor "
           f"of shape {tuple(returned.shape)}" if isinstance(returned, torch.Tensor)
           else type(returned).__name__)
    raise TypeError(f"the {hook} hook was called with out=None (the backend sets "
                    f"returns_kernel_output) and must return its contiguous {dtype} output of "
                    f"shape {want} (engines view it as [rows, heads * v_dim]); it returned {got}")


def lse_for(given: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """``given`` (already checked), else a float32 ``[q rows, heads]``."""
    return given if given is not None else q.new_empty(q.shape[:2], dtype=torch.float32)


def hook_options(q_scale: torch.Tensor | None,
                 lse: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The forward hook's optional keywords (``q_scale``, ``lse``), each only when given."""
    if q_scale is None and lse is None:
        return _NOTHING  # the common call: nothing built (a forward runs per layer per step)
    return {k: v for k, v in (("q_scale", q_scale), ("lse", lse)) if v is not None}

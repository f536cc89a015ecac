"""(q) A kernel's q rounding against its declaration (``KernelConstraints.q_compute_dtype``).

* ``planted_q_rounded_undeclared``: the Triton backend, its declaration unchanged, that
  rounds every absorbed MLA q to fp8 e4m3 (one power-of-two scale per row, attnreg's
  convention) before its kernels, as a kernel moved to fp8 score dots without its
  declaration would.  The output moves by ~8e-3, inside the bf16 (0.02) and fp8 (0.08)
  tolerances: every claim but ``q_rounding`` holds.
* ``planted_q_rounding_undone``: the Triton backend whose 16-bit-pool kernels declare q
  rounded to fp8 per row, which they do not do (the oracle then rounds q, the kernel
  does not: again inside the tolerances).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

import attnreg
from attnreg.backends.triton_mla import TritonMLABackend
from attnreg.registry import DeclarationContext, DType, ForwardMethod
from attnreg.testing.workload import round_q

from ._common import spec, triton_like

ROUNDED = "planted_q_rounded_undeclared"
UNDONE = "planted_q_rounding_undone"


class RoundsQUndeclared(TritonMLABackend):
    @staticmethod
    def _round(q: torch.Tensor) -> torch.Tensor:
        # THE DEFECT: q rounded to fp8 where the declaration says it is used as given
        # (an fp8 value times a power of two is exact in q's 16-bit dtype)
        return round_q(q, DType.FP8_E4M3, "row").to(q.dtype)

    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             **kwargs: Any) -> None:
        super()._forward_decode_impl(self._round(q), pool, md, out, **kwargs)

    def _forward_extend_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             *, method: ForwardMethod, **kwargs: Any) -> None:
        if method is ForwardMethod.MLA:
            q = self._round(q)
        super()._forward_extend_impl(q, pool, md, out, method=method, **kwargs)


def rounded_capabilities(ctx: DeclarationContext) -> attnreg.Capabilities:
    return triton_like(ROUNDED, ctx)


def undone_capabilities(ctx: DeclarationContext) -> attnreg.Capabilities:
    caps = triton_like(UNDONE, ctx)
    # THE DEFECT: a rounding declared for kernels that use q as given
    kernels = tuple(
        replace(k, q_compute_dtype=DType.FP8_E4M3, q_compute_scale="row")
        if k.method is ForwardMethod.MLA and DType.FP8_E4M3 not in k.kv_dtypes else k
        for k in caps.kernels)
    return replace(caps, kernels=kernels)


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    register(spec(ROUNDED, "rounds q to fp8 without declaring it", rounded_capabilities,
                  f"{__name__}:RoundsQUndeclared"))
    register(spec(UNDONE, "declares q rounded to fp8, uses it as given",
                  undone_capabilities, f"{__name__}:TritonMLABackend"))

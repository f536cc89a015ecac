"""(m) ``planted_fp8_q_unscaled``: an FP8-KV kernel fed q cast to fp8 with no scale.

The Triton backend, declared (truthfully) to compute with q rounded to fp8 e4m3 for its
FP8-KV kernels (``KernelConstraints.q_compute_dtype``), that rounds q by a plain
``q.to(torch.float8_e4m3fn)``, as ``trtllm_mla`` did before it scaled q: every
``|q| > 448`` becomes NaN (e4m3fn has no inf).  With N(0, 1) queries the plain cast is
attnreg's per-tensor rounding up to fp8 subnormals (a power-of-two scale commutes with
the rounding), so every other claim holds; only ``fp8_large_q`` sees it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

import attnreg
from attnreg.backends.triton_mla import TritonMLABackend
from attnreg.registry import DeclarationContext, DType, ForwardMethod

from ._common import spec, triton_like

NAME = "planted_fp8_q_unscaled"


class Fp8QueryUnscaled(TritonMLABackend):
    @staticmethod
    def _round(q: torch.Tensor, pool: Any) -> torch.Tensor:
        if pool is None or not pool.is_fp8:
            return q
        return q.to(torch.float8_e4m3fn).to(q.dtype)  # THE DEFECT: no scale before the cast

    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             **kwargs: Any) -> None:
        super()._forward_decode_impl(self._round(q, pool), pool, md, out, **kwargs)

    def _forward_extend_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             *, method: ForwardMethod, **kwargs: Any) -> None:
        if method is ForwardMethod.MLA:
            q = self._round(q, pool)
        super()._forward_extend_impl(q, pool, md, out, method=method, **kwargs)


def capabilities(ctx: DeclarationContext) -> attnreg.Capabilities:
    caps = triton_like(NAME, ctx)
    kernels: list[Any] = []
    for k in caps.kernels:
        if k.method is not ForwardMethod.MLA or DType.FP8_E4M3 not in k.kv_dtypes:
            kernels.append(k)
            continue
        # the 16-bit pool as before; the fp8 pool with q rounded to fp8 (declared, one
        # scale per batch: what the cast pretends to do)
        if k.kv_dtypes - {DType.FP8_E4M3}:
            kernels.append(replace(k, kv_dtypes=k.kv_dtypes - {DType.FP8_E4M3}))
        kernels.append(replace(k, kv_dtypes=frozenset({DType.FP8_E4M3}),
                               q_compute_dtype=DType.FP8_E4M3, q_compute_scale="batch"))
    return replace(caps, kernels=tuple(kernels))


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    register(spec(NAME, "q cast to fp8 without a scale", capabilities,
                  f"{__name__}:Fp8QueryUnscaled"))

"""(n) An engine's fp8 query (``forward_*(q, q_scale=)``), mishandled two ways.

Both are the Triton backend with one more declared kernel entry: an fp8 query
(``q_dtypes`` fp8_e4m3, no ``q_compute_dtype``: taken as given) over an fp8 pool,
served by dequantising q to bf16 and running Triton's fp8-pool kernel.

* ``planted_fp8_q_scale_ignored``: reads the fp8 values as the query and drops
  ``q_scale`` (real q = q * q_scale), as a wrapper that forwards q but not its
  descale would.  The oracle's q is 1/16 .. 1/256 of what it attends with.
* ``planted_fp8_q_scale_kept``: keeps each layer's first ``q_scale`` (a copy made
  once, as a per-layer descale cached at warm-up would be) and uses it for every
  later step.  The first batch of each claim is right; every later batch whose
  query has another magnitude (:data:`attnreg.testing.workload.FP8_Q_GAINS`) is
  off by a power of two.
* ``planted_fp8_q_scale_per_step``: uses the scale of the step's first layer for
  every layer of that step (a descale taken once per step, e.g. with the plan, as
  if the engine had one for the whole model).  Every single-layer claim holds; only
  the multi-layer claims of the fp8-query pair, whose layers carry their own
  scales, refute it.

The correct form of the same backend (``q.to(bf16) * q_scale`` every call) holds
every claim on the output: ``planted_fp8_q_scale_correct``, the control.  Not its
``capture_memory`` claims: the dequantised q is a temporary inside the graph that
Triton's declaration does not count (H200: 17.3 MiB allocated against 8.3 MiB declared
for the decode graphs), so runs of these backends leave those claims out.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

import attnreg
from attnreg.backends.triton_mla import TritonMLABackend
from attnreg.registry import DeclarationContext, DType, ForwardMethod

from ._common import spec, triton_like

IGNORED = "planted_fp8_q_scale_ignored"
KEPT = "planted_fp8_q_scale_kept"
PER_STEP = "planted_fp8_q_scale_per_step"
CORRECT = "planted_fp8_q_scale_correct"


def _with_fp8_queries(name: str, ctx: DeclarationContext) -> attnreg.Capabilities:
    caps = triton_like(name, ctx)
    extra = [replace(k, q_dtypes=frozenset({DType.FP8_E4M3}),
                     kv_dtypes=frozenset({DType.FP8_E4M3}))
             for k in caps.kernels
             if k.method is ForwardMethod.MLA and DType.FP8_E4M3 in k.kv_dtypes
             and k.q_compute_dtype is None]
    return replace(caps, kernels=caps.kernels + tuple(extra))


class Fp8QueryCorrect(TritonMLABackend):
    """The control: every call dequantises with the scale it was handed."""

    def _scale(self, q_scale: torch.Tensor, pool: Any) -> torch.Tensor:
        return q_scale

    def _dequantise(self, q: torch.Tensor, q_scale: torch.Tensor | None,
                    pool: Any) -> torch.Tensor:
        if q_scale is None:
            return q
        return q.to(torch.bfloat16) * self._scale(q_scale, pool).to(torch.bfloat16)

    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             *, q_scale: torch.Tensor | None = None, **kwargs: Any) -> None:
        super()._forward_decode_impl(self._dequantise(q, q_scale, pool), pool, md, out,
                                     **kwargs)

    def _forward_extend_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             *, method: ForwardMethod, q_scale: torch.Tensor | None = None,
                             **kwargs: Any) -> None:
        super()._forward_extend_impl(self._dequantise(q, q_scale, pool), pool, md, out,
                                     method=method, **kwargs)


class Fp8QueryScaleIgnored(Fp8QueryCorrect):
    def _scale(self, q_scale: torch.Tensor, pool: Any) -> torch.Tensor:
        return torch.ones_like(q_scale)  # THE DEFECT: the descale never reaches the kernel


class Fp8QueryScaleKept(Fp8QueryCorrect):
    def _scale(self, q_scale: torch.Tensor, pool: Any) -> torch.Tensor:
        kept: dict[int, torch.Tensor] = self.__dict__.setdefault("_kept_scales", {})
        # THE DEFECT: a copy of the first scale each layer saw, reused for every later step
        return kept.setdefault(id(pool.buffer), q_scale.clone())


class Fp8QueryScalePerStep(Fp8QueryCorrect):
    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             *, q_scale: torch.Tensor | None = None, **kwargs: Any) -> None:
        super()._forward_decode_impl(q, pool, md, out, q_scale=self._step_scale(md, q_scale),
                                     **kwargs)

    def _forward_extend_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             *, method: ForwardMethod, q_scale: torch.Tensor | None = None,
                             **kwargs: Any) -> None:
        super()._forward_extend_impl(q, pool, md, out, method=method,
                                     q_scale=self._step_scale(md, q_scale), **kwargs)

    def _step_scale(self, md: Any, q_scale: torch.Tensor | None) -> torch.Tensor | None:
        # THE DEFECT: the first layer's scale (the tensor itself: under capture, layer 0's
        # static scale) serves every layer planned with the same metadata
        if q_scale is None:
            return None
        if self.__dict__.get("_step_md") is not md:
            self.__dict__["_step_md"], self.__dict__["_step_q_scale"] = md, q_scale
        return self.__dict__["_step_q_scale"]


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    register(spec(IGNORED, "an fp8 query's q_scale dropped",
                  lambda ctx: _with_fp8_queries(IGNORED, ctx),
                  f"{__name__}:Fp8QueryScaleIgnored"))
    register(spec(KEPT, "an fp8 query's first q_scale kept for every later step",
                  lambda ctx: _with_fp8_queries(KEPT, ctx), f"{__name__}:Fp8QueryScaleKept"))
    register(spec(PER_STEP, "the first layer's q_scale used for every layer of a step",
                  lambda ctx: _with_fp8_queries(PER_STEP, ctx),
                  f"{__name__}:Fp8QueryScalePerStep"))
    register(spec(CORRECT, "(control) an fp8 query dequantised with its own q_scale",
                  lambda ctx: _with_fp8_queries(CORRECT, ctx),
                  f"{__name__}:Fp8QueryCorrect"))

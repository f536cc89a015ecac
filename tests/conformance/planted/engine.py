"""(h)-(j) defects of the engine contract: layers, verify batches, LSE.

* ``planted_layer0`` reads layer 0 of the pool whatever ``layer_id`` says (one
  pool for all layers, but the per-layer view is ignored);
* ``planted_verify_noncausal`` lets every draft token of a target-verify batch see
  all the others (no causal mask among the drafts);
* ``planted_lse_base2`` returns its decode log-sum-exp in base 2, as flashinfer's
  kernels do before conversion.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

import attnreg
from attnreg.backends.triton_mla import TritonMLABackend
from attnreg.registry import DeclarationContext, ForwardMode

from ._common import spec, triton_like


class LayerZero(TritonMLABackend):
    def _layer(self, pool: Any, layer_id: int) -> Any:
        return pool.layer(0)  # THE DEFECT: every layer attends (and writes) layer 0


class VerifyNonCausal(TritonMLABackend):
    def _forward_extend_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             **kwargs: Any) -> None:
        if md.forward_mode is ForwardMode.TARGET_VERIFY:
            # THE DEFECT: queries placed after the whole sequence see every draft token
            md = replace(md, prefix_lens=md.seq_lens)
        super()._forward_extend_impl(q, pool, md, out, **kwargs)


class LseBase2(TritonMLABackend):
    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor, *,
                             lse: torch.Tensor | None = None) -> None:
        super()._forward_decode_impl(q, pool, md, out, lse=lse)
        if lse is not None:
            lse.div_(math.log(2.0))  # THE DEFECT: the kernel's base-2 LSE, unconverted


BACKENDS = {"planted_layer0": ("every layer_id reads layer 0", "LayerZero"),
            "planted_verify_noncausal": ("draft tokens see each other", "VerifyNonCausal"),
            "planted_lse_base2": ("base-2 log-sum-exp", "LseBase2")}


def _caps(name: str) -> Any:
    def capabilities(ctx: DeclarationContext) -> attnreg.Capabilities:
        return triton_like(name, ctx)
    return capabilities


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    for name, (summary, cls) in BACKENDS.items():
        register(spec(name, summary, _caps(name), f"{__name__}:{cls}"))

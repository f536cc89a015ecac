"""(k)-(l) defects the suite's base configuration hides (issue 17).

* ``planted_fixed_scale`` computes with DeepSeek's default softmax scale,
  1/sqrt(192), whatever ``MLAConfig.sm_scale`` says: right for every claim at the
  default scale, wrong for a YaRN-scaled model (DeepSeek-V3 with rope scaling);
* ``planted_heads_block8`` runs its heads in blocks of 8 and gives every block after
  the first the first block's output (a block index dropped from an offset): right
  at 2 heads, the cpu base configuration, wrong at 16 and more.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

import attnreg
from attnreg.backends.triton_mla import TritonMLABackend
from attnreg.registry import DeclarationContext

from ._common import spec, triton_like

#: The scale DeepSeek's head dims give (q/k nope 128 + rope 64) when none is set.
DEFAULT_SCALE = 1.0 / math.sqrt(192.0)
#: Heads per block of ``planted_heads_block8``.
HEAD_BLOCK = 8


class FixedScale(TritonMLABackend):
    def __init__(self, config: Any, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        # THE DEFECT: the kernels get the default scale, not the configured one
        self.config = replace(self.config, sm_scale=DEFAULT_SCALE)


def _first_block_everywhere(out: torch.Tensor) -> None:
    heads = out.shape[1]
    if heads > HEAD_BLOCK:
        source = torch.arange(heads, device=out.device) % HEAD_BLOCK
        out.copy_(out[:, source])  # THE DEFECT: head h gets head h % 8's output


class HeadsBlock8(TritonMLABackend):
    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             **kwargs: Any) -> None:
        super()._forward_decode_impl(q, pool, md, out, **kwargs)
        _first_block_everywhere(out)

    def _forward_extend_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             **kwargs: Any) -> None:
        super()._forward_extend_impl(q, pool, md, out, **kwargs)
        _first_block_everywhere(out)


BACKENDS = {
    "planted_fixed_scale": ("softmax scale fixed at 1/sqrt(192)", "FixedScale"),
    "planted_heads_block8": ("heads beyond the first 8 get the first 8's output",
                             "HeadsBlock8"),
}


def _caps(name: str) -> Any:
    def capabilities(ctx: DeclarationContext) -> attnreg.Capabilities:
        return triton_like(name, ctx)
    return capabilities


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    for name, (summary, cls) in BACKENDS.items():
        register(spec(name, summary, _caps(name), f"{__name__}:{cls}"))

"""(b) Split-KV declared under capture for an absorbed extend kernel without a split variant.

Seed 000 defect 2: flash_attn.cute's qv kernel (absorbed form) has no split-KV
variant; paged absorbed extend still chose split-KV under capture and asserted.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

import attnreg
from attnreg.backends.triton_mla import TritonMLABackend
from attnreg.registry import (
    CaptureSupport,
    DeclarationContext,
    ForwardMethod,
    GraphMode,
    GraphModeSupport,
    Phase,
    SplitKV,
)

from ._common import spec, triton_like

NAME = "planted_split_assert"
#: the split heuristic: one split per this many KV tokens
TOKENS_PER_SPLIT = 256


def capabilities(ctx: DeclarationContext) -> attnreg.Capabilities:
    caps = triton_like(NAME, ctx)
    modes = tuple(
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE, CaptureSupport.native(),
                         pinned_method=ForwardMethod.MLA, split_kv=SplitKV.DYNAMIC)
        if g.phase is Phase.PREFILL and g.mode is GraphMode.BREAKABLE else g
        for g in caps.graph_modes)
    kernels = tuple(replace(k, split_kv=SplitKV.DYNAMIC)
                    if k.method is ForwardMethod.MLA and Phase.PREFILL in k.phases else k
                    for k in caps.kernels)
    return replace(caps, graph_modes=modes, kernels=kernels)


def fake_qv_extend(num_splits: int) -> None:
    """Stands in for the qv kernel's launcher: it has no split-KV variant."""
    assert num_splits == 1, f"flash_attn qv kernel: no split-KV variant (num_splits={num_splits})"


class Backend(TritonMLABackend):
    def _forward_extend_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor, *,
                             method: ForwardMethod, k: Any, v: Any) -> None:
        if method is ForwardMethod.MLA:
            # split plan from the longest sequence the launch may see: under capture that
            # is the capture bound, so long-KV graphs plan several splits
            fake_qv_extend(max(1, -(-md.max_seq_len // TOKENS_PER_SPLIT)))
        super()._forward_extend_impl(q, pool, md, out, method=method, k=k, v=v)


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    register(spec(NAME, "split-KV declared under capture, kernel asserts on splits > 1",
                  capabilities, f"{__name__}:Backend"))

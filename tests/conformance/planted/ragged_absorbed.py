"""(a) Under capture, extend goes to a ragged MHA kernel that only takes MHA head dims.

Seed 000 defect 1: trtllm_mla's ragged prefill kernel accepts q/k 192, 128 or 256
and v 128; under capture the forward method is pinned to absorbed MLA, and the
(576, 576, 512) tensors reached the ragged kernel and hit its assert.
"""

from __future__ import annotations

from typing import Any

import torch

import attnreg
from attnreg.backends.triton_mla import TritonMLABackend
from attnreg.registry import DeclarationContext, ForwardMethod, GraphMode, Phase

from ._common import spec, triton_like

NAME = "planted_ragged_absorbed"


def capabilities(ctx: DeclarationContext) -> attnreg.Capabilities:
    return triton_like(NAME, ctx)


def fake_trtllm_ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Stands in for trtllm's ragged kernel: its shape assert, nothing else."""
    assert q.shape[-1] in (128, 192, 256) and k.shape[-1] == q.shape[-1] \
        and v.shape[-1] == 128, (f"trtllm ragged attention: unsupported head dims "
                                 f"q/k {q.shape[-1]}/{k.shape[-1]}, v {v.shape[-1]}")


class Backend(TritonMLABackend):
    def _forward_extend_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor, *,
                             method: ForwardMethod, k: Any, v: Any) -> None:
        if self.active_graph_mode(Phase.PREFILL) is not GraphMode.DISABLED \
                and method is ForwardMethod.MLA:
            # THE DEFECT: under capture every extend takes the ragged kernel, absorbed
            # tensors included (the latent rows serve as k, their first 512 as v)
            rows = pool.buffer.view(-1, pool.row_dim)
            fake_trtllm_ragged(q, rows, rows[:, :pool.kv_lora_rank])
        super()._forward_extend_impl(q, pool, md, out, method=method, k=k, v=v)


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    register(spec(NAME, "ragged MHA kernel handed absorbed tensors under capture",
                  capabilities, f"{__name__}:Backend"))

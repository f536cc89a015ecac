"""(c) Freeing storage that a captured graph recorded.

Seed 000 defect 3: ``dispose_tensor`` skipped only under tc_piecewise capture and
freed, under breakable capture, the storage of a tensor whose address the graph
had recorded; replay then wrote into reused memory (KV-cache corruption).

* ``planted_dispose_inputs``: after the KV write it frees ``latent_new`` /
  ``rope_new`` ("dead now, save memory") with exactly that buggy guard.
* ``planted_dispose_in_graph`` (GPU): frees, during real stream capture, the
  scratch copy of q that it allocated before capture and the graph reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import attnreg
from attnreg.backends.triton_mla import TritonMLABackend, TritonPlan
from attnreg.graph_policy.capture import current_capture
from attnreg.registry import DeclarationContext, GraphMode, Phase

from ._common import spec, triton_like

INPUTS = "planted_dispose_inputs"
IN_GRAPH = "planted_dispose_in_graph"


def buggy_dispose(t: torch.Tensor) -> None:
    """The seed's dispose: a no-op under tc_piecewise only (should be: under any capture)."""
    if current_capture() is GraphMode.TC_PIECEWISE:
        return
    t.set_(torch.empty((0,), device=t.device, dtype=t.dtype))


class DisposeInputs(TritonMLABackend):
    def _write_kv(self, pool: Any, md: Any, latent_new: torch.Tensor,
                  rope_new: torch.Tensor) -> None:
        super()._write_kv(pool, md, latent_new, rope_new)
        buggy_dispose(latent_new)
        buggy_dispose(rope_new)


@dataclass
class ScratchPlan(TritonPlan):
    """Triton's plan plus a scratch copy of q the planted backend allocates at capture."""

    q_scratch: torch.Tensor | None = None


class DisposeInGraph(TritonMLABackend):
    def _init_capture_impl(self, md: Any) -> None:
        super()._init_capture_impl(md)
        if md.phase is Phase.DECODE:
            heads, dim = self.config.num_heads, self.config.kv_row_dim
            scratch = torch.empty(md.batch_size, heads, dim, dtype=attnreg_q_dtype(self),
                                  device=self.device)
            md.plan = ScratchPlan(md.plan.splits, md.plan.workspace, scratch)

    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any,
                             out: torch.Tensor) -> None:
        scratch = getattr(md.plan, "q_scratch", None)
        if scratch is None or scratch.numel() == 0:
            super()._forward_decode_impl(q, pool, md, out)
            return
        scratch.copy_(q)
        super()._forward_decode_impl(scratch, pool, md, out)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # THE DEFECT: the graph just recorded scratch's address; freeing it hands the
            # block back to the allocator while every replay still writes and reads it
            scratch.set_(torch.empty((0,), device=scratch.device, dtype=scratch.dtype))


def attnreg_q_dtype(backend: TritonMLABackend) -> torch.dtype:
    from attnreg.runtime import torch_dtype

    return torch_dtype(backend.config.q_dtype)


def capabilities_inputs(ctx: DeclarationContext) -> attnreg.Capabilities:
    return triton_like(INPUTS, ctx)


def capabilities_in_graph(ctx: DeclarationContext) -> attnreg.Capabilities:
    return triton_like(IN_GRAPH, ctx)


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    register(spec(INPUTS, "frees its inputs after the KV write, guarded for tc_piecewise "
                          "only", capabilities_inputs, f"{__name__}:DisposeInputs"))
    register(spec(IN_GRAPH, "frees a graph-recorded scratch buffer during capture",
                  capabilities_in_graph, f"{__name__}:DisposeInGraph"))

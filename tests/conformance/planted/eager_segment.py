"""Backends that run part of attention in their own eager break (not defects).

Under BREAKABLE capture the absorbed extend attention runs inside an
``eager_break``; a captured epilogue follows it (an output projection stands
there), so the graph is: KV write | eager attention | epilogue.

* ``planted_eager_attention``: the ``eager_break.run`` form: the break hands
  the runner a replay callable, so the harness re-runs the attention between
  the replayed segments and the replay claims hold (GPU);
* ``planted_eager_with_block``: the ``with`` form: nothing can re-run it at
  replay, and the harness skips its real-capture claims, naming the fix.

Outside BREAKABLE capture (eager runs, the cpu capture-mode path) the break is
a no-op and both behave like the Triton backend.
"""

from __future__ import annotations

from typing import Any

import torch

import attnreg
from attnreg.backends.triton_mla import TritonMLABackend
from attnreg.graph_policy.capture import eager_break
from attnreg.registry import DeclarationContext, ForwardMethod

from ._common import spec, triton_like

REPLAYABLE = "planted_eager_attention"
WITH_BLOCK = "planted_eager_with_block"
LABEL = "planted.eager_attention"


class EagerAttention(TritonMLABackend):
    def _forward_extend_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor, *,
                             method: ForwardMethod, k: Any, v: Any) -> None:
        # static buffers only (q, pool, graph metadata, out): replay re-uses these arguments
        eager_break.run(LABEL, super()._forward_extend_impl, q, pool, md, out, method=method,
                        k=k, v=v)
        out.mul_(1.0)  # the captured epilogue


class EagerWithBlock(TritonMLABackend):
    def _forward_extend_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor, *,
                             method: ForwardMethod, k: Any, v: Any) -> None:
        with eager_break(LABEL):
            super()._forward_extend_impl(q, pool, md, out, method=method, k=k, v=v)
        out.mul_(1.0)


def _caps(name: str) -> Any:
    def capabilities(ctx: DeclarationContext) -> attnreg.Capabilities:
        return triton_like(name, ctx)
    return capabilities


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    register(spec(REPLAYABLE, "extend attention in a replayable eager break",
                  _caps(REPLAYABLE), f"{__name__}:EagerAttention"))
    register(spec(WITH_BLOCK, "extend attention in a with-block eager break",
                  _caps(WITH_BLOCK), f"{__name__}:EagerWithBlock"))

"""(s) ``planted_kv_scale_frozen``: a captured decode that keeps each layer's fp8 scale as
the host float it saw first.

The Triton backend whose graph forwards hand its kernels ``layer.kv_scale`` (a float),
remembered per layer from the first forward on graph metadata, instead of
``layer.scale_tensor``: what a launch inside a CUDA graph records whether or not the
backend remembers it.  At a fixed scale every claim holds; after ``set_scale`` the graph
dequantises the cache by the scale of capture time.  Only ``kv_scale_change`` sees it.
"""

from __future__ import annotations

from typing import Any

import attnreg
from attnreg.backends.triton_mla import TritonMLABackend
from attnreg.registry import DeclarationContext

from ._common import spec, triton_like

NAME = "planted_kv_scale_frozen"


class FrozenScale(TritonMLABackend):
    def _kv_scale(self, pool: Any) -> Any:
        md = self.forward_metadata
        if not pool.is_fp8 or md is None or not md.is_graph:
            return super()._kv_scale(pool)
        frozen: dict[int, float] = self.__dict__.setdefault("_frozen_scales", {})
        # THE DEFECT: the host float of the first graph forward, kept for every replay
        return frozen.setdefault(pool.layer_id, pool.kv_scale)


def capabilities(ctx: DeclarationContext) -> attnreg.Capabilities:
    return triton_like(NAME, ctx)


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    register(spec(NAME, "a captured decode's fp8 scale frozen as a host float", capabilities,
                  f"{__name__}:FrozenScale"))

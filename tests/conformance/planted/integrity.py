"""(m)-(q) defects that corrupt serving silently: outputs right, something else wrong.

* ``planted_prefix_overwrite``: every decode step, after attending, writes into the
  first cached token of the batch's second sequence (an off-by-one-row store);
* ``planted_other_layer``: the new rows are also written into the next layer of the
  pool (a layer stride off by one);
* ``planted_nan_wide``: the decode output is NaN for batches of more than 4
  sequences (a tile count overflow);
* ``planted_inplace_q``: decode scales the caller's ``q`` in place after using it
  (a fused rope/scale step that writes back);
* ``planted_hang``: the decode forward never returns (a spin on a flag that is
  never set).
"""

from __future__ import annotations

import time
from typing import Any

import torch

import attnreg
from attnreg.backends.triton_mla import TritonMLABackend
from attnreg.registry import DeclarationContext

from ._common import spec, triton_like


class PrefixOverwrite(TritonMLABackend):
    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             **kwargs: Any) -> None:
        super()._forward_decode_impl(q, pool, md, out, **kwargs)
        if md.batch_size >= 2:
            # THE DEFECT: after attending (so this step's output is right), sequence 1's
            # first cached token is overwritten (device-side, so a graph replays it too)
            slot = md.page_table[1, 0].long() * pool.page_size
            pool.buffer.view(pool.num_slots, pool.row_dim)[slot] = 0.5


class OtherLayer(TritonMLABackend):
    def _layer(self, pool: Any, layer_id: int) -> Any:
        self._whole_pool = pool
        return super()._layer(pool, layer_id)

    def _write_kv(self, pool: Any, md: Any, latent_new: torch.Tensor,
                  rope_new: torch.Tensor) -> None:
        super()._write_kv(pool, md, latent_new, rope_new)
        whole = self._whole_pool
        if whole.num_layers > 1:
            # THE DEFECT: the rows land in the next layer as well
            other = whole.layer((pool.layer_id + 1) % whole.num_layers)
            other.write(md.out_cache_loc, latent_new, rope_new)


class NanWide(TritonMLABackend):
    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             **kwargs: Any) -> None:
        super()._forward_decode_impl(q, pool, md, out, **kwargs)
        if md.batch_size > 4:
            out.fill_(float("nan"))  # THE DEFECT: wrong above four sequences


class InplaceQ(TritonMLABackend):
    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             **kwargs: Any) -> None:
        super()._forward_decode_impl(q, pool, md, out, **kwargs)
        q.mul_(2.0)  # THE DEFECT: the caller's q is changed (the output is right)


class Hang(TritonMLABackend):
    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor,
                             **kwargs: Any) -> None:
        while True:  # THE DEFECT: never returns
            time.sleep(0.05)


BACKENDS = {
    "planted_prefix_overwrite": ("overwrites another sequence's cached prefix",
                                 "PrefixOverwrite"),
    "planted_other_layer": ("writes the new rows into the next layer too", "OtherLayer"),
    "planted_nan_wide": ("NaN output above four sequences", "NanWide"),
    "planted_inplace_q": ("scales the caller's q in place", "InplaceQ"),
    "planted_hang": ("decode never returns", "Hang"),
}


def _caps(name: str) -> Any:
    def capabilities(ctx: DeclarationContext) -> attnreg.Capabilities:
        return triton_like(name, ctx)
    return capabilities


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    for name, (summary, cls) in BACKENDS.items():
        register(spec(name, summary, _caps(name), f"{__name__}:{cls}"))

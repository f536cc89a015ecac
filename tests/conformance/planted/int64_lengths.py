"""(e) int64 lengths where the kernel expects int32 (the runtime contract is int32).

The backend skips the index-dtype check of the base class, and its decode hands
the kernel the lengths buffer reinterpreted as int32: for an int64 tensor that
reads ``[len0, 0, len1, 0, ...]``, silently wrong.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

import attnreg
from attnreg.backends.triton_mla import TritonMLABackend
from attnreg.registry import DeclarationContext

from ._common import spec, triton_like

NAME = "planted_int64_lengths"
_INDEX_FIELDS = ("seq_lens", "prefix_lens", "extend_lens", "qo_indptr", "kv_indptr",
                 "page_table", "out_cache_loc")


def capabilities(ctx: DeclarationContext) -> attnreg.Capabilities:
    return triton_like(NAME, ctx)


class Backend(TritonMLABackend):
    def _validate_batch(self, batch: Any) -> None:
        # THE DEFECT: validate a copy with int32 indices, i.e. never look at the dtype
        super()._validate_batch(replace(batch, **{
            f: getattr(batch, f).to(torch.int32) for f in _INDEX_FIELDS}))

    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any,
                             out: torch.Tensor) -> None:
        if md.seq_lens.dtype != torch.int32:
            md.seq_lens = md.seq_lens.view(torch.int32)[:md.batch_size]
        super()._forward_decode_impl(q, pool, md, out)


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    register(spec(NAME, "int64 lengths read as int32", capabilities, f"{__name__}:Backend"))

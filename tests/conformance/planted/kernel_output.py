"""(o) A backend that returns its kernel's own output (``returns_kernel_output``), wrong.

Both are the Triton backend allocating the output itself when the caller gives none,
as FlashMLA's library does, and returning it (the session keeps each bucket's).

* ``planted_kernel_output_shared``: one output tensor per row count, reused by every
  call (a library's workspace-backed output, as a wrapper that preallocates "its"
  output once would have).  An engine that consumes each layer's output before the
  next layer runs would not notice; but every layer of a captured step returns the
  same tensor, so the last layer's rows are what every layer hands back: the
  multi-layer claims refute it (single-layer claims hold).
* ``planted_kernel_output_correct``: the control, a new tensor per call.
"""

from __future__ import annotations

from typing import Any

import torch

import attnreg
from attnreg.backends.triton_mla import TritonMLABackend
from attnreg.runtime import output_dtype

from ._common import spec, triton_like

SHARED = "planted_kernel_output_shared"
CORRECT = "planted_kernel_output_correct"


class KernelOutputCorrect(TritonMLABackend):
    """The control: called without ``out``, a new output per call, returned."""

    returns_kernel_output = True

    def _output(self, q: torch.Tensor) -> torch.Tensor:
        return q.new_empty((q.shape[0], q.shape[1], self.config.kv_lora_rank),
                           dtype=output_dtype(q.dtype))

    def _forward_decode_impl(self, q: torch.Tensor, pool: Any, md: Any,
                             out: torch.Tensor | None, **kwargs: Any) -> torch.Tensor | None:
        mine = self._output(q) if out is None else out
        super()._forward_decode_impl(q, pool, md, mine, **kwargs)
        return mine if out is None else None

    def _forward_extend_impl(self, q: torch.Tensor, pool: Any, md: Any,
                             out: torch.Tensor | None, **kwargs: Any) -> torch.Tensor | None:
        mine = self._output(q) if out is None else out
        super()._forward_extend_impl(q, pool, md, mine, **kwargs)
        return mine if out is None else None


class KernelOutputShared(KernelOutputCorrect):
    def _output(self, q: torch.Tensor) -> torch.Tensor:
        shared: dict[tuple[int, ...], torch.Tensor] = self.__dict__.setdefault("_shared", {})
        shape = (q.shape[0], q.shape[1], self.config.kv_lora_rank)
        # THE DEFECT: one tensor per shape, handed to every layer (and every step)
        if shape not in shared:
            shared[shape] = super()._output(q)
        return shared[shape]


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    register(spec(SHARED, "its own output: one tensor reused by every layer",
                  lambda ctx: triton_like(SHARED, ctx), f"{__name__}:KernelOutputShared"))
    register(spec(CORRECT, "(control) its own output: a new tensor per call",
                  lambda ctx: triton_like(CORRECT, ctx), f"{__name__}:KernelOutputCorrect"))

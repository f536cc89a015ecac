"""(g) FALLBACK declarations checked against what actually served the forward.

Each backend declares prefill under TC_PIECEWISE as ``FALLBACK(to="reference")``
(attention runs eagerly there, so the float32 reference can serve it) and
reports what ran through ``attnreg.graph_policy.capture.note_served_by``:

* ``planted_fallback_mismatch`` (defect): declares the fallback to reference but
  keeps running its own Triton kernel under capture (and says so): the graph
  policy would price the mode by the wrong backend's cost;
* ``planted_native_but_fallback`` (defect): declares TC_PIECEWISE NATIVE but is
  served by the reference under capture (an undeclared fallback);
* ``planted_fallback_honest`` (control): declares the fallback and runs it;
* ``planted_fallback_silent`` (control): runs the fallback but reports nothing:
  the ``fallback_served`` claim is skipped, naming the call to add.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

import attnreg
from attnreg.backends.reference import ReferenceBackend
from attnreg.backends.triton_mla import TritonMLABackend
from attnreg.graph_policy.capture import current_capture, note_served_by
from attnreg.registry import (
    CaptureSupport,
    Cost,
    DeclarationContext,
    ForwardMethod,
    GraphMode,
    Phase,
)

from ._common import spec, triton_like

MISMATCH = "planted_fallback_mismatch"
NATIVE_BUT_FALLBACK = "planted_native_but_fallback"
HONEST = "planted_fallback_honest"
SILENT = "planted_fallback_silent"
FALLBACK_TO = "reference"


def _declares_fallback(name: str, ctx: DeclarationContext) -> attnreg.Capabilities:
    caps = triton_like(name, ctx)
    modes = tuple(
        replace(g, capture=CaptureSupport.fallback(FALLBACK_TO, Cost.LOW,
                                                   "the float32 reference serves it"))
        if g.phase is Phase.PREFILL and g.mode is GraphMode.TC_PIECEWISE else g
        for g in caps.graph_modes)
    return replace(caps, graph_modes=modes)


class _Base(TritonMLABackend):
    #: (runs the reference under TC_PIECEWISE, what to report; None: report nothing)
    use_reference = True
    report: str | None = FALLBACK_TO

    def __init__(self, config: Any, *, capabilities: Any, **kwargs: Any) -> None:
        super().__init__(config, capabilities=capabilities, **kwargs)
        # the reference's hooks, reused as the fallback implementation
        self._reference = ReferenceBackend(config, capabilities=capabilities)

    def _forward_extend_impl(self, q: torch.Tensor, pool: Any, md: Any, out: torch.Tensor, *,
                             method: ForwardMethod, k: Any, v: Any) -> None:
        fallback = current_capture() is GraphMode.TC_PIECEWISE
        if fallback and self.use_reference:
            self._reference._forward_extend_impl(q, pool, md, out, method=method, k=k, v=v)
        else:
            super()._forward_extend_impl(q, pool, md, out, method=method, k=k, v=v)
        if fallback and self.report is not None:
            note_served_by(self.name, self.report, "eager extend under tc_piecewise")


class Mismatch(_Base):
    # THE DEFECT: the declared fallback never runs; the backend's own kernel does
    use_reference = False
    report = MISMATCH


class NativeButFallback(_Base):
    # THE DEFECT: declared native, served by the reference
    pass


class Honest(_Base):
    pass


class Silent(_Base):
    report = None


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    register(spec(MISMATCH, "declares a fallback to reference, runs its own kernel",
                  lambda ctx: _declares_fallback(MISMATCH, ctx), f"{__name__}:Mismatch"))
    register(spec(NATIVE_BUT_FALLBACK, "declares tc_piecewise native, served by reference",
                  lambda ctx: triton_like(NATIVE_BUT_FALLBACK, ctx),
                  f"{__name__}:NativeButFallback"))
    register(spec(HONEST, "control: declares and runs a fallback to reference",
                  lambda ctx: _declares_fallback(HONEST, ctx), f"{__name__}:Honest"))
    register(spec(SILENT, "control: runs its fallback, reports nothing",
                  lambda ctx: _declares_fallback(SILENT, ctx), f"{__name__}:Silent"))

"""(f) Declares MLA pinned under BREAKABLE, but runs the MHA companion when asked to.

Seed 000: a backend that forgets to pin MLA gets its MHA companion captured and
prefix batches replayed wrongly.  Here the declaration says "pinned", but the
backend's refusal check of the graph mode (its ``RequestChecker``, where every refusal
is checked) drops the pinned-method part, so forward_extend(method=MHA) runs under
breakable capture.
"""

from __future__ import annotations

from typing import Any

import attnreg
from attnreg.backends.triton_mla import TritonMLABackend
from attnreg.registry import DeclarationContext
from attnreg.runtime.refusals import Refusal, RequestChecker

from ._common import spec, triton_like

NAME = "planted_pin_mismatch"


def capabilities(ctx: DeclarationContext) -> attnreg.Capabilities:
    return triton_like(NAME, ctx)


class _ForgetsThePin(RequestChecker):
    def graph_mode(self, phase: Any, mode: Any, method: Any = None) -> list[Refusal]:
        # THE DEFECT: checks the mode, forgets the pinned method
        return super().graph_mode(phase, mode, None)


class Backend(TritonMLABackend):
    def __init__(self, config: Any, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.refusals = _ForgetsThePin(self.name, self.capabilities, self.config, self.device)


@attnreg.hookimpl
def attnreg_register_backends(register: Any) -> None:
    register(spec(NAME, "pins MLA under breakable but runs MHA", capabilities,
                  f"{__name__}:Backend"))

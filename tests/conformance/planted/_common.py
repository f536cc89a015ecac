"""Shared pieces of the planted-defect plugins: a Triton-derived declaration and the spec."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from attnreg.backends.declarations import triton as triton_declaration
from attnreg.backends.declarations._common import TORCH, TRITON
from attnreg.registry import BackendSpec, Capabilities, DeclarationContext


def triton_like(name: str, ctx: DeclarationContext, **changes: Any) -> Capabilities:
    """The Triton backend's declaration under another name, with ``changes`` applied."""
    return replace(triton_declaration.capabilities(ctx), backend=name, **changes)


def spec(name: str, summary: str, capabilities: Callable[[DeclarationContext], Capabilities],
         runtime: str) -> BackendSpec:
    return BackendSpec(name=name, summary=f"PLANTED DEFECT (tests only): {summary}",
                       capabilities=capabilities, runtime=runtime, requires=(TORCH, TRITON))

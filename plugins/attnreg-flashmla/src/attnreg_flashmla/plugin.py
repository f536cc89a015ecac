"""The module the ``attnreg.backends`` entry point names: one hook, one backend.

attnreg imports it at startup and calls the hook with a host-owned
``register`` callback.  Nothing here imports torch or the kernel library.
"""

from __future__ import annotations

from collections.abc import Callable

from attnreg.registry import BackendSpec, hookimpl

from .declaration import BACKEND_NAME, FLASH_MLA, TORCH, capabilities


@hookimpl
def attnreg_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Register ``flashmla``: its declaration and, by dotted path, its runtime class."""
    register(BackendSpec(
        name=BACKEND_NAME,
        summary=("FlashMLA dense MLA decode and sparse (DSA) MLA (sgl-flash-mla, sm90): "
                 "bf16 or fp8 pool, page size 64"),
        capabilities=capabilities,
        # A string, not the class: torch and flash_mla are imported only when an
        # engine instantiates the backend, never by `attnreg backends` or `compat`.
        runtime="attnreg_flashmla.runtime:FlashMLABackend",
        # Missing, the backend is listed as unavailable with an install hint.
        requires=(TORCH, FLASH_MLA),
    ))

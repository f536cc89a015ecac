"""The plugin module named by the ``attnreg.backends`` entry point.

attnreg imports this module at startup and calls its hook with a
host-owned ``register`` callback; the plugin touches no global state.
"""

from __future__ import annotations

from collections.abc import Callable

import attnreg

from .declaration import BACKEND_NAME, TORCH, capabilities


@attnreg.hookimpl
def attnreg_register_backends(register: Callable[[attnreg.BackendSpec], None]) -> None:
    """Register ``compat_0_1_mla``: its declaration and, by dotted path, its runtime class."""
    register(attnreg.BackendSpec(
        name=BACKEND_NAME,
        summary="example plugin: batched torch MLA decode, page sizes 16/64, <= 64 heads",
        capabilities=capabilities,
        # A string, not the class: torch is imported only when an engine
        # instantiates the backend, never by `attnreg backends` or `compat`.
        runtime="attnreg_compat_0_1.runtime:ExampleMLABackend",
        requires=(TORCH,),
    ))

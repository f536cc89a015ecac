"""pluggy hook specifications of attnreg (project name ``"attnreg"``).

A plugin module implements hooks with ``@attnreg.hookimpl``.  Keep this
surface small: a hook is added only when a real extension needs it.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from .spec import BackendSpec

PROJECT_NAME = "attnreg"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def attnreg_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Register the attention backends this plugin provides.

    Call ``register(BackendSpec(...))`` once per backend.  The host validates
    each spec, stamps it with the plugin's name and distribution, and rejects a
    name that another plugin already registered (naming both plugins).  The
    hook must not import torch or kernel libraries: runtime classes are named
    by dotted path and loaded only when a backend is instantiated.

    :param register: host-owned callback taking one :class:`BackendSpec`.
    :return: nothing; the return value is ignored.  Not firstresult: every
        plugin's implementation is called.
    """

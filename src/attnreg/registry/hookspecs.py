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

    Call ``register(BackendSpec(...))`` once per backend.  The host calls
    every plugin's implementation in one pluggy call (pluggy's order: the
    built-ins are ``trylast``), then validates each spec, stamps it with the
    plugin's name and distribution, rejects a name that an earlier-loaded
    plugin already registered (naming both plugins), and evaluates the
    declaration on every platform it knows.  An implementation that raises
    (or calls ``sys.exit()``) is recorded as that plugin's error; the others
    still run.  The hook must not import torch or kernel libraries: runtime
    classes are named by dotted path and loaded only when a backend is
    instantiated (the host times the hook and warns about heavy imports).

    :param register: host-owned callback taking one :class:`BackendSpec`.
    :return: nothing; the return value is ignored.  Not firstresult: every
        plugin's implementation is called.
    """

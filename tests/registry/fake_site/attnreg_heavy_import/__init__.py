"""Imports a module the tests configure as heavy (ATTNREG_HEAVY_MODULES), at import
and in its hook, so the startup guard can be tested without importing torch."""

import attnreg_fake_heavy  # noqa: F401

import attnreg


@attnreg.hookimpl
def attnreg_register_backends(register):
    import attnreg_fake_heavy_too  # noqa: F401

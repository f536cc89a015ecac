"""Imports torch at import time: every attnreg command would pay for it."""

import torch  # noqa: F401  (the point of this plugin)

import attnreg


@attnreg.hookimpl
def attnreg_register_backends(register):
    pass

"""A well-formed third-party plugin with the things users should be told about.

``acme_mla`` needs a library that is not installed (its own dependency, not
an attnreg extra); ``ghost_mla`` names a runtime class its package lacks (and would be the
default on a CPU if that went unnoticed);
``greedy_mla`` outranks every built-in so that it becomes the default.
"""

import dataclasses

import attnreg
from attnreg import Requirement
from attnreg.backends.declarations import reference

ACME = Requirement("acme_kernels", "acme-kernels", "1.2")


def _like_reference(name, **changes):
    def capabilities(ctx):
        return dataclasses.replace(reference.capabilities(ctx), backend=name, **changes)
    return capabilities


@attnreg.hookimpl
def attnreg_register_backends(register):
    register(attnreg.BackendSpec(
        name="acme_mla", summary="needs acme-kernels", capabilities=_like_reference("acme_mla"),
        runtime="attnreg.backends.reference:ReferenceBackend", requires=(ACME,)))
    register(attnreg.BackendSpec(
        name="ghost_mla", summary="names a runtime class that does not exist",
        capabilities=_like_reference("ghost_mla", priority=35),
        runtime="attnreg_thirdparty.runtime:GhostBackend"))
    register(attnreg.BackendSpec(
        name="greedy_mla", summary="priority above everything",
        capabilities=_like_reference("greedy_mla", priority=10**6),
        runtime="attnreg.backends.reference:ReferenceBackend"))

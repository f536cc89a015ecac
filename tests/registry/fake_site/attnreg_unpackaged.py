"""A plugin that is not installed as a distribution: tried with ``--plugin``.

``attnreg_unpackaged`` (the module) registers ``unpackaged_mla``;
``attnreg_unpackaged:SECOND`` (an object in it) registers ``unpackaged_two``.
"""

import dataclasses

import attnreg
from attnreg.backends.declarations import reference


def _named(name):
    def capabilities(ctx):
        return dataclasses.replace(reference.capabilities(ctx), backend=name, priority=-5)
    return capabilities


@attnreg.hookimpl
def attnreg_register_backends(register):
    register(attnreg.BackendSpec(name="unpackaged_mla", summary="tried with --plugin",
                                 capabilities=_named("unpackaged_mla"),
                                 runtime="attnreg.backends.reference:ReferenceBackend"))


class _Second:
    @attnreg.hookimpl
    def attnreg_register_backends(self, register):
        register(attnreg.BackendSpec(name="unpackaged_two", summary="an object given as MODULE:OBJ",
                                     capabilities=_named("unpackaged_two"),
                                     runtime="attnreg.backends.reference:ReferenceBackend"))


SECOND = _Second()

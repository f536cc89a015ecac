import attnreg
from attnreg.backends.declarations import reference


@attnreg.hookimpl
def attnreg_register_backends(register):
    register(attnreg.BackendSpec(name="reference", summary="clashes with the built-in",
                                 capabilities=reference.capabilities,
                                 runtime="attnreg.backends.reference:ReferenceBackend"))

import attnreg


@attnreg.hookimpl
def attnreg_register_backends(register):
    raise RuntimeError("boom from raising_hook")

import attnreg


@attnreg.hookimpl
def attnreg_register_backends(regster):  # misspelled argument: pluggy rejects it
    raise AssertionError("never called")

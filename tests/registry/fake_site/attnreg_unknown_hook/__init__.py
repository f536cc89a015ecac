import attnreg


@attnreg.hookimpl
def attnreg_register_backend(register):  # misspelled hook name (singular)
    raise AssertionError("never called")

import sys

import attnreg


@attnreg.hookimpl
def attnreg_register_backends(register):
    sys.exit(3)

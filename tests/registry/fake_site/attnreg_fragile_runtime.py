"""A runtime module that defines its class but cannot be imported: startup's static
check says it resolves; only instantiating the backend finds out."""

import this_module_does_not_exist_anywhere  # noqa: F401  (the point of this module)


class Backend:
    pass

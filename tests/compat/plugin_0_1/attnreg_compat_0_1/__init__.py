"""attnreg-compat-0-1: a third-party MLA backend registered through an entry point.

Importing this package imports neither torch nor attnreg's backends: the
declaration is pure data and the runtime class is loaded by dotted path only
when the backend is instantiated.
"""

__version__ = "0.1.0"

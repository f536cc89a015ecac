"""attnreg-flashmla: FlashMLA (sgl-flash-mla) as an attnreg MLA decode backend.

Importing this package imports neither torch nor ``flash_mla``: the
declaration is pure data and the runtime class is loaded by dotted path only
when an engine instantiates the backend.
"""

__version__ = "0.1.0"

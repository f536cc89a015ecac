"""Built-in attention backends.

This package imports no torch: declarations live in ``declarations/`` (pure
data) and runtime classes in their own modules, imported only when a backend
is instantiated through the registry.
"""

# The stable surface (docs/api.md): ``attnreg.backends.reference.ReferenceBackend``, the
# float32 reference a plugin may subclass (the tutorial's example does).  The other
# built-ins are reached by name through the registry (``get_registry().create(name,
# config)``); their classes and modules are not promised.
__all__ = ["reference"]

"""Built-in attention backends.

This package imports no torch: declarations live in ``declarations/`` (pure
data) and runtime classes in their own modules, imported only when a backend
is instantiated through the registry.
"""

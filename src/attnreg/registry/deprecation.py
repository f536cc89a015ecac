"""Deprecations: the warning a replaced API form emits, and who used it.

A change to the stable surface (docs/api.md) first deprecates: the old form
keeps working for at least one minor release and emits an
:class:`AttnregDeprecationWarning` that names its replacement; the removal is
noted in CHANGELOG.md.  While plugins load, the registry records these
warnings per plugin (:func:`recording`), so ``attnreg doctor`` can list the
plugins that use a deprecated form even though Python hides
``DeprecationWarning`` outside ``__main__`` and tests.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["AttnregDeprecationWarning", "recording", "warn_deprecated", "warn_deprecated_at"]


class AttnregDeprecationWarning(DeprecationWarning):
    """An attnreg API form that still works but will be removed; the message names the new one."""


def warn_deprecated(message: str, *, stacklevel: int = 2) -> None:
    """Emit an :class:`AttnregDeprecationWarning` (``stacklevel`` as for :func:`warnings.warn`,
    counted from the caller of this function)."""
    warnings.warn(message, AttnregDeprecationWarning, stacklevel=stacklevel + 1)


def warn_deprecated_at(message: str, where: object) -> None:
    """Emit an :class:`AttnregDeprecationWarning` located at the function ``where``
    (a plugin's capability function, say) rather than at attnreg's own frame."""
    code = getattr(where, "__code__", None)
    module = getattr(where, "__module__", None) or "attnreg"
    if code is None:
        warnings.warn(message, AttnregDeprecationWarning, stacklevel=2)
        return
    warnings.warn_explicit(message, AttnregDeprecationWarning, code.co_filename,
                           code.co_firstlineno, module=module)


@contextmanager
def recording(into: list[str]) -> Iterator[None]:
    """Append the message of every attnreg deprecation raised in the block to ``into``.

    Every distinct warning caught (message and location) is emitted again
    afterwards, so the filters in force (pytest's, ``-W``) still see it:
    recording adds bookkeeping, it never silences.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    seen: set[tuple[str, type[Warning], str, int]] = set()
    for w in caught:
        text = str(w.message)
        if issubclass(w.category, AttnregDeprecationWarning) and text not in into:
            into.append(text)
        key = (text, w.category, w.filename, w.lineno)
        if key not in seen:  # a declaration evaluated on every platform warns once
            seen.add(key)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno,
                                   source=w.source)

"""The capture context: which graph mode (if any) the current code runs under.

Runtime code asks :func:`current_capture` / :func:`is_capturing` instead of
reading engine-global flags, so that every capture mode (FULL, BREAKABLE,
TC_PIECEWISE) is covered by one check.  Seed 000 defect 3 is the reason this
exists: ``dispose_tensor`` guarded only tc_piecewise capture and freed the
storage of a tensor whose address a *breakable* graph had recorded; replay then
wrote into reused memory and silently corrupted the KV cache.

Thread and async semantics
--------------------------
The mode lives in a :class:`contextvars.ContextVar`:

* each thread sees its own value; a new thread starts outside any capture
  (threads do not inherit the creator's context unless it is passed with
  ``contextvars.copy_context().run``);
* an asyncio task copies the context when it is created, so a task created
  inside ``capturing(mode)`` sees ``mode``, and a ``capturing()`` entered inside
  a task never leaks into other tasks or the creator.

Nothing here imports torch at module import; :func:`dispose_tensor` imports it
when called.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from contextvars import ContextVar
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

from ..registry.capabilities import GraphMode

if TYPE_CHECKING:  # typing_extensions is not a runtime dependency
    from typing_extensions import Self

__all__ = [
    "BreakHandler",
    "break_handler",
    "capturing",
    "current_capture",
    "dispose_tensor",
    "eager_break",
    "in_eager_break",
    "is_capturing",
]

logger = logging.getLogger("attnreg.graph_policy")

#: A harness-installed callback: called with the break's label when breakable
#: capture reaches an :func:`eager_break`; the context manager it returns is
#: entered around the eager code (typically: end the current graph segment on
#: entry, begin the next segment on exit).
BreakHandler = Callable[[str], AbstractContextManager[Any]]

_CAPTURE_MODE: ContextVar[GraphMode | None] = ContextVar("attnreg_capture_mode", default=None)
_BREAK_HANDLER: ContextVar[BreakHandler | None] = ContextVar("attnreg_break_handler",
                                                              default=None)
_IN_EAGER_BREAK: ContextVar[bool] = ContextVar("attnreg_in_eager_break", default=False)


@contextlib.contextmanager
def capturing(mode: GraphMode | str) -> Iterator[GraphMode]:
    """Mark the enclosed code as running under graph capture in ``mode``.

    Nestable: an inner ``capturing`` overrides the mode and the outer mode is
    restored on exit (also on exceptions).

    Parameters
    ----------
    mode
        A capture mode: FULL, BREAKABLE or TC_PIECEWISE (or its string name).

    Raises
    ------
    ValueError
        For DISABLED: eager code must not enter a capture context.

    Examples
    --------
    >>> from attnreg.registry import GraphMode
    >>> with capturing(GraphMode.BREAKABLE):
    ...     is_capturing()
    True
    >>> is_capturing()
    False
    """
    parsed = cast(GraphMode, GraphMode.parse(mode))
    if parsed is GraphMode.DISABLED:
        raise ValueError("capturing(DISABLED) makes no sense: DISABLED means eager; "
                         "run eager code outside capturing()")
    token = _CAPTURE_MODE.set(parsed)
    # An eager break of an outer capture does not carry into a nested capture.
    break_token = _IN_EAGER_BREAK.set(False)
    try:
        yield parsed
    finally:
        _IN_EAGER_BREAK.reset(break_token)
        _CAPTURE_MODE.reset(token)


def current_capture() -> GraphMode | None:
    """The capture mode of the current thread/task, or None when not capturing."""
    return _CAPTURE_MODE.get()


def is_capturing() -> bool:
    """True under any capture mode (FULL, BREAKABLE or TC_PIECEWISE)."""
    return _CAPTURE_MODE.get() is not None


def in_eager_break() -> bool:
    """True inside an :func:`eager_break` region of a breakable capture.

    Code there runs eagerly (it may read host values), but the capture session
    is still open: :func:`is_capturing` stays True, so storage the surrounding
    segments recorded is still not freed.
    """
    return _IN_EAGER_BREAK.get()


def dispose_tensor(t: Any) -> bool:
    """Free ``t``'s storage now (``t.set_(empty)``), unless a graph is being captured.

    Under ANY capture mode this is a no-op: a captured graph (breakable
    segments included) may have recorded the storage's address, and freeing
    it lets the allocator hand the memory to something else that replay then
    overwrites (seed 000 defect 3: silent KV-cache corruption).

    Parameters
    ----------
    t
        A ``torch.Tensor``.  Its shape becomes ``(0,)``; device and dtype stay.

    Returns
    -------
    bool
        True when the storage was released, False when skipped under capture.
    """
    if _CAPTURE_MODE.get() is not None:
        return False
    import torch  # lazily: graph_policy must import without torch

    t.set_(torch.empty((0,), device=t.device, dtype=t.dtype))
    return True


@contextlib.contextmanager
def break_handler(handler: BreakHandler) -> Iterator[None]:
    """Install ``handler`` for :func:`eager_break` markers in the enclosed code.

    The conformance harness (or an engine's breakable-graph runner) installs
    one around a breakable capture.  For each break reached while capturing
    in BREAKABLE mode, ``handler(label)`` is called and the returned context
    manager is entered around the eager code.
    """
    token = _BREAK_HANDLER.set(handler)
    try:
        yield
    finally:
        _BREAK_HANDLER.reset(token)


class eager_break(contextlib.ContextDecorator):  # lower case: it reads as a marker
    """Mark code that must run eagerly between two segments of a breakable graph.

    Usable as a context manager (``with eager_break("plan"):``) or a decorator
    (``@eager_break("plan")``).  Under BREAKABLE capture with a handler
    installed (:func:`break_handler`), the handler's context manager wraps the
    region, so the harness can close the current segment before it and open
    the next one after it.  Outside BREAKABLE capture it does nothing: in
    eager runs the code simply runs, and FULL / TC_PIECEWISE capture have no
    breaks.  Nested breaks are one break (the outer one).

    Under BREAKABLE capture without a handler nothing can split the graph;
    the region is then captured like the code around it and a debug message
    is logged.  A runner that relies on the break must install a handler.
    """

    def __init__(self, label: str = "eager") -> None:
        self.label = label
        self._stack: list[tuple[AbstractContextManager[Any] | None, Any]] = []

    def __enter__(self) -> Self:
        active = (_CAPTURE_MODE.get() is GraphMode.BREAKABLE and not _IN_EAGER_BREAK.get())
        handler = _BREAK_HANDLER.get() if active else None
        if active and handler is None:
            logger.debug("eager_break(%r) under breakable capture with no break handler "
                         "installed: the region is captured, not split", self.label)
        cm: AbstractContextManager[Any] | None = None
        flag_token = None
        if handler is not None:
            cm = handler(self.label)
            cm.__enter__()
            flag_token = _IN_EAGER_BREAK.set(True)
        self._stack.append((cm, flag_token))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        cm, flag_token = self._stack.pop()
        if flag_token is not None:
            _IN_EAGER_BREAK.reset(flag_token)
        if cm is not None:
            return bool(cm.__exit__(exc_type, exc, tb))
        return False

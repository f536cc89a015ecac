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

Two small hooks serve graph runners and the conformance suite:

* eager breaks (:class:`eager_break`, :func:`break_handler`): code that must
  run eagerly between two segments of a breakable graph.  The function and
  decorator forms hand the runner a *replay* callable, so the runner can run
  the same eager work again between the replayed segments;
* served-by records (:func:`note_served_by`, :func:`recording_served`): a
  backend says which implementation actually served a forward (itself, or the
  declared capture fallback), so a FALLBACK declaration can be checked
  against what ran.  A no-op unless someone records.

Nothing here imports torch at module import; :func:`dispose_tensor` imports it
when called.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

from ..registry.capabilities import GraphMode

if TYPE_CHECKING:  # typing_extensions is not a runtime dependency
    from typing_extensions import Self

__all__ = [
    "BreakHandler",
    "EagerReplay",
    "ReplayBreakHandler",
    "ServedForward",
    "break_handler",
    "capturing",
    "current_capture",
    "dispose_tensor",
    "eager_break",
    "in_eager_break",
    "is_capturing",
    "note_served_by",
    "recording_served",
]

logger = logging.getLogger("attnreg.graph_policy")

_P = ParamSpec("_P")
_R = TypeVar("_R")

#: Re-runs the eager work of one break at replay (no arguments, result ignored).
EagerReplay = Callable[[], object]

#: A harness-installed callback: called with the break's label when breakable
#: capture reaches an :func:`eager_break`; the context manager it returns is
#: entered around the eager code (typically: end the current graph segment on
#: entry, begin the next segment on exit).
BreakHandler = Callable[[str], AbstractContextManager[Any]]

#: The same, installed with ``break_handler(handler, with_replay=True)``: also
#: receives the break's :data:`EagerReplay` (None for the ``with`` form, whose
#: code cannot be run again), so the runner can re-run the eager work between
#: the replayed segments.
ReplayBreakHandler = Callable[[str, "EagerReplay | None"], AbstractContextManager[Any]]

_CAPTURE_MODE: ContextVar[GraphMode | None] = ContextVar("attnreg_capture_mode", default=None)
# Always stored in the two-argument form; label-only handlers are wrapped.
_BREAK_HANDLER: ContextVar[ReplayBreakHandler | None] = ContextVar("attnreg_break_handler",
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
def break_handler(handler: BreakHandler | ReplayBreakHandler, *,
                  with_replay: bool = False) -> Iterator[None]:
    """Install ``handler`` for :func:`eager_break` markers in the enclosed code.

    The conformance harness (or an engine's breakable-graph runner) installs
    one around a breakable capture.  For each break reached while capturing
    in BREAKABLE mode the handler is called and the returned context manager
    is entered around the eager code.

    Parameters
    ----------
    handler
        ``handler(label)``, or with ``with_replay=True``
        ``handler(label, replay)``: ``replay`` re-runs the break's eager work
        (see :class:`eager_break`) or is None when the break was a ``with``
        block.  A runner stores ``replay`` and calls it between the segments
        it replays; a runner that gets None cannot reproduce that region.
    with_replay
        Call the handler with the replay callable as well.
    """
    two_args: ReplayBreakHandler
    if with_replay:
        two_args = cast(ReplayBreakHandler, handler)
    else:
        label_only = cast(BreakHandler, handler)

        def two_args(label: str, replay: EagerReplay | None) -> AbstractContextManager[Any]:
            return label_only(label)
    token = _BREAK_HANDLER.set(two_args)
    try:
        yield
    finally:
        _BREAK_HANDLER.reset(token)


def _replay_in_break(work: Callable[[], object], mode: GraphMode) -> EagerReplay:
    """``work`` wrapped to run in the context it had at capture: ``mode``, inside a break.

    At replay the runner calls it outside any ``capturing()``; the eager code
    must still see :func:`is_capturing` True (the replayed segments recorded
    addresses, so :func:`dispose_tensor` must stay a no-op) and
    :func:`in_eager_break` True (it runs eagerly, as at capture).
    """

    def replay() -> object:
        mode_token = _CAPTURE_MODE.set(mode)
        break_token = _IN_EAGER_BREAK.set(True)
        try:
            return work()
        finally:
            _IN_EAGER_BREAK.reset(break_token)
            _CAPTURE_MODE.reset(mode_token)

    return replay


class eager_break(contextlib.ContextDecorator):  # lower case: it reads as a marker
    """Mark code that must run eagerly between two segments of a breakable graph.

    Three forms:

    * ``with eager_break("plan"): ...`` - the block runs eagerly; the runner is
      told where the break is but gets no way to run the block again
      (``replay`` None);
    * ``@eager_break("plan")`` on a function - each call is a break, and the
      runner gets ``replay``: the same function with the same arguments;
    * ``eager_break.run("plan", fn, *args, **kwargs)`` - one call of ``fn`` as
      a break, with ``replay`` as above; returns ``fn``'s result.

    Under BREAKABLE capture with a handler installed (:func:`break_handler`),
    the handler's context manager wraps the region, so the runner can close
    the current segment before it and open the next one after it; a runner
    installed with ``with_replay=True`` also gets ``replay`` and calls it
    between the replayed segments.  ``replay`` runs with the capture context
    the region had (:func:`is_capturing` and :func:`in_eager_break` True) and
    ignores the result: the eager work must leave what the next segment reads
    in tensors the graph recorded (static buffers), and the arguments it was
    called with are reused at every replay, so pass those static buffers, not
    per-batch temporaries.

    Outside BREAKABLE capture it does nothing: in eager runs the code simply
    runs, and FULL / TC_PIECEWISE capture have no breaks.  Nested breaks are
    one break (the outer one).  Under BREAKABLE capture without a handler
    nothing can split the graph; the region is then captured like the code
    around it and a debug message is logged.  A runner that relies on the
    break must install a handler.
    """

    def __init__(self, label: str = "eager") -> None:
        self.label = label
        self._stack: list[tuple[AbstractContextManager[Any] | None, Any]] = []

    def __enter__(self) -> Self:
        self._open(None)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        cm, flag_token = self._stack.pop()
        if flag_token is not None:
            _IN_EAGER_BREAK.reset(flag_token)
        if cm is not None:
            return bool(cm.__exit__(exc_type, exc, tb))
        return False

    def _open(self, work: Callable[[], object] | None) -> None:
        mode = _CAPTURE_MODE.get()
        active = mode is GraphMode.BREAKABLE and not _IN_EAGER_BREAK.get()
        handler = _BREAK_HANDLER.get() if active else None
        if active and handler is None:
            logger.debug("eager_break(%r) under breakable capture with no break handler "
                         "installed: the region is captured, not split", self.label)
        cm: AbstractContextManager[Any] | None = None
        flag_token = None
        if handler is not None:
            assert mode is not None
            replay = _replay_in_break(work, mode) if work is not None else None
            cm = handler(self.label, replay)
            cm.__enter__()
            flag_token = _IN_EAGER_BREAK.set(True)
        self._stack.append((cm, flag_token))

    def __call__(self, func: Callable[_P, _R]) -> Callable[_P, _R]:  # type: ignore[override]
        """Decorator form: every call is a break whose ``replay`` repeats the call."""

        @functools.wraps(func)
        def in_break(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            return eager_break.run(self.label, func, *args, **kwargs)

        return in_break

    @staticmethod
    def run(label: str, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
        """Run ``fn(*args, **kwargs)`` as an eager break that a runner can replay.

        Examples
        --------
        >>> eager_break.run("plan", max, 3, 4)   # outside capture: just a call
        4
        """
        brk = eager_break(label)
        brk._open(functools.partial(fn, *args, **kwargs))
        exc_info: tuple[Any, Any, Any] = (None, None, None)
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            exc_info = (type(exc), exc, exc.__traceback__)
            if not brk.__exit__(*exc_info):
                raise
            return cast(_R, None)  # the handler swallowed the exception
        finally:
            if exc_info[0] is None:
                brk.__exit__(None, None, None)


# ---------------------------------------------------------------------------
# served-by records
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ServedForward:
    """One forward as a backend reported it: who was asked, what actually ran.

    Attributes
    ----------
    backend
        The backend whose ``forward_*`` was called.
    implementation
        The backend (registry name) whose kernels served it: ``backend``
        itself when it runs natively, the declared ``fallback_to`` when it
        falls back.
    mode
        :func:`current_capture` when the forward ran (None: eager).
    in_eager_break
        True inside an :class:`eager_break` region (counts as eager).
    detail
        Free text (which kernel, why), shown in conformance messages.
    """

    backend: str
    implementation: str
    mode: GraphMode | None
    in_eager_break: bool
    detail: str = ""

    @property
    def under_capture(self) -> bool:
        """Whether the forward ran as captured code (a capture mode, outside an eager break)."""
        return self.mode is not None and not self.in_eager_break


_SERVED_RECORDERS: ContextVar[tuple[list[ServedForward], ...]] = ContextVar(
    "attnreg_served_recorders", default=())


def note_served_by(backend: str, implementation: str, detail: str = "") -> None:
    """Report that ``implementation`` served the current forward of ``backend``.

    Call it from a backend's forward, once per forward, naming the registry
    name whose kernels ran: ``note_served_by(self.name, self.name)`` on the
    native path, ``note_served_by(self.name, "other_backend", "paged MLA")``
    on a capture fallback.  The conformance suite uses it to check a FALLBACK
    declaration against what ran (and a NATIVE one against running someone
    else's kernels).  Costs one ContextVar read when nobody records; never
    call it from code that runs only at graph replay (nothing Python runs
    there: what is recorded at capture is what every replay runs).
    """
    recorders = _SERVED_RECORDERS.get()
    if not recorders:
        return
    record = ServedForward(backend, implementation, _CAPTURE_MODE.get(), _IN_EAGER_BREAK.get(),
                           detail)
    for recorder in recorders:
        recorder.append(record)


@contextlib.contextmanager
def recording_served() -> Iterator[list[ServedForward]]:
    """Collect :func:`note_served_by` reports made in the enclosed code (nestable).

    Examples
    --------
    >>> with recording_served() as served:
    ...     note_served_by("native_mla", "fallback_mla")
    >>> [(s.backend, s.implementation, s.under_capture) for s in served]
    [('native_mla', 'fallback_mla', False)]
    """
    records: list[ServedForward] = []
    token = _SERVED_RECORDERS.set(_SERVED_RECORDERS.get() + (records,))
    try:
        yield records
    finally:
        _SERVED_RECORDERS.reset(token)

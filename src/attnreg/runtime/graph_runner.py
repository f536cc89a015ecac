"""``GraphRunner``: the one implementation of graph capture and replay in attnreg.

The conformance suite proves claims with it, ``attnreg calibrate`` and the
benchmarks measure with it, and an engine can run its graphs with it: what is
proven is what is measured is what runs.  Three graph modes:

* FULL: one device graph around the captured function;
* BREAKABLE: the function is captured in segments; each
  :class:`~attnreg.graph_policy.capture.eager_break` the function reaches
  (the engine's own, or one a backend takes inside attention) ends the
  current segment, runs eagerly, and a new segment begins after it.  At
  replay the segments are replayed in order and each break's replay callable
  runs between them (the decorator / ``eager_break.run`` forms hand one over;
  a ``with``-block break cannot be re-run and fails the capture with
  :class:`UnreplayableBreakError`);
* TC_PIECEWISE: :meth:`GraphRunner.capture_pieces` captures the given pieces
  and runs the :class:`EagerStep` pieces (attention, as torch.compile's
  splitting ops) eagerly between them, at capture and at every replay, all
  under ``capturing(TC_PIECEWISE)``.

On a CUDA device every capture is warmed up on a side stream first (kernels
compile and libraries set up their state outside the graph), records into the
runner's private memory pool (shareable between runners, so many captured
shapes reuse one pool) and can refuse host syncs (``forbid_sync``).  Without
device graphs (a cpu, or ``device_graphs=False``) capture runs the function
once under ``capturing(mode)`` and replay runs it again: the same code paths
of the backends run, so cpu tests drive what the GPU captures.

Replays never synchronise, so back-to-back replays can be timed; call
``torch.cuda.synchronize()`` before reading outputs on the host.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from attnreg.graph_policy.capture import EagerReplay, break_handler, capturing
from attnreg.registry import GraphMode

from .dtypes import resolve_device

__all__ = [
    "CAPTURE_ERROR_MODES",
    "CaptureStats",
    "CapturedGraph",
    "CudaGraphRecorder",
    "EagerStep",
    "GraphCaptureError",
    "GraphRecorder",
    "GraphRunner",
    "UnreplayableBreakError",
]

#: ``capture_error_mode`` values of ``torch.cuda.graph``: ``global`` refuses unsafe CUDA
#: calls from any thread while capturing, ``thread_local`` only from this thread (a
#: process group's watchdog thread may query events meanwhile), ``relaxed`` none.
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")


class GraphCaptureError(RuntimeError):
    """A capture the runner cannot turn into a replayable graph."""


class UnreplayableBreakError(GraphCaptureError):
    """A BREAKABLE capture reached ``with eager_break(...)`` blocks, which cannot be re-run.

    ``labels`` names them.  Use ``@eager_break(label)`` or
    ``eager_break.run(label, fn, *args)`` instead: those hand the runner the
    callable it re-runs between the replayed segments.
    """

    def __init__(self, labels: Sequence[str]) -> None:
        self.labels = list(labels)
        super().__init__(
            f"eager_break({self.labels[0]!r}) was entered as a `with` block during breakable "
            "capture: the runner gets no callable to re-run that code between the replayed "
            "segments; use the decorator form or eager_break.run(label, fn, *args) so the "
            "region can be replayed")


@dataclass(frozen=True)
class EagerStep:
    """A step that runs eagerly: between captured pieces (TC_PIECEWISE), or a break.

    ``fn`` takes no arguments; its result is ignored.  It must leave what the
    next captured piece reads in the static tensors that piece recorded.
    """

    fn: Callable[[], object]
    label: str = "eager"

    def __call__(self) -> None:
        self.fn()


@dataclass(frozen=True)
class CaptureStats:
    """The device allocator around one capture (CUDA only).

    ``bytes_held``: allocated bytes the capture left allocated (blocks the
    graph keeps, tensors created inside and still alive); ``allocations`` /
    ``frees``: allocator calls during the capture.  Blocks allocated and
    freed inside the capture stay reserved in the graph's pool but are not
    "held" here; ``torch.cuda.max_memory_allocated`` around the capture sees them.
    """

    bytes_held: int
    allocations: int
    frees: int


class GraphRecorder(Protocol):
    """Opens and closes device-graph segments (a CUDA recorder, or a test's fake)."""

    def begin(self) -> Any:
        """Start recording a segment; return a handle for :meth:`end`."""

    def end(self, handle: Any, exc: BaseException | None = None) -> Any:
        """Stop recording; return the recorded graph (it has ``replay()``)."""

    def eager(self) -> contextlib.AbstractContextManager[None]:
        """Context for code that runs eagerly between segments while capturing."""


class CudaGraphRecorder:
    """Records ``torch.cuda.CUDAGraph`` segments into one memory pool.

    Parameters
    ----------
    mempool
        ``torch.cuda.graph_pool_handle()`` shared by every segment.
    capture_error_mode
        One of :data:`CAPTURE_ERROR_MODES`.
    forbid_sync
        Record with ``torch.cuda.set_sync_debug_mode("error")``: an operation
        that synchronises with the host inside a segment raises.  Lifted in
        eager regions.
    """

    def __init__(self, mempool: Any, *, capture_error_mode: str = "global",
                 forbid_sync: bool = False) -> None:
        self.mempool = mempool
        self.capture_error_mode = capture_error_mode
        self.forbid_sync = forbid_sync

    def begin(self) -> tuple[Any, Any, Any]:
        graph = torch.cuda.CUDAGraph()
        ctx = torch.cuda.graph(graph, pool=self.mempool,
                               capture_error_mode=self.capture_error_mode)  # type: ignore[arg-type]
        ctx.__enter__()
        previous = None
        if self.forbid_sync:  # after entering: torch.cuda.graph synchronises on entry
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        return graph, ctx, previous

    def end(self, handle: tuple[Any, Any, Any], exc: BaseException | None = None) -> Any:
        graph, ctx, previous = handle
        if previous is not None:
            torch.cuda.set_sync_debug_mode(previous)
        if exc is None:
            ctx.__exit__(None, None, None)
        else:
            ctx.__exit__(type(exc), exc, exc.__traceback__)
        return graph

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Eager regions may synchronise: lift the sync guard while they run."""
        if not self.forbid_sync:
            yield
            return
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


@dataclass
class _GraphStep:
    graph: Any
    label: str = "graph"

    def __call__(self) -> None:
        self.graph.replay()


class _Segments:
    """BREAKABLE capture: consecutive segments separated by eager breaks.

    Installed with ``break_handler(seg.handler, with_replay=True)``.  Each break
    ends the current segment, adds its replay callable to the plan (or notes
    that it has none) and begins the next segment when the region is left.
    """

    def __init__(self, recorder: GraphRecorder) -> None:
        self.recorder = recorder
        self.steps: list[Callable[[], None]] = []
        self.unreplayable: list[str] = []
        self.breaks: list[str] = []
        self._current: Any = None
        self._open = False

    def begin(self) -> None:
        self._current = self.recorder.begin()
        self._open = True

    def end(self) -> None:
        assert self._open, "no segment is open"
        handle, self._current, self._open = self._current, None, False
        self.steps.append(_GraphStep(self.recorder.end(handle)))

    def abort(self, exc: BaseException) -> None:
        if self._open:
            handle, self._current, self._open = self._current, None, False
            with contextlib.suppress(Exception):
                self.recorder.end(handle, exc)

    def handler(self, label: str, replay: EagerReplay | None
                ) -> contextlib.AbstractContextManager[None]:
        @contextlib.contextmanager
        def split() -> Iterator[None]:
            self.end()
            self.breaks.append(label)
            if replay is not None:
                self.steps.append(EagerStep(replay, label))
            else:
                self.unreplayable.append(label)
            with self.recorder.eager():
                yield
            self.begin()
        return split()


#: The label of the one step of a capture without device graphs.
_RERUN = "re-run (no device graph)"


def _under(mode: GraphMode, fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` run inside ``capturing(mode)`` (eager steps and cpu replays)."""

    def run() -> None:
        with capturing(mode):
            fn()
    return run


@dataclass
class CapturedGraph:
    """A captured function: its steps (device graphs and eager steps) in replay order.

    Attributes
    ----------
    mode : GraphMode
    steps : list
        What :meth:`replay` runs, in order: recorded segments and eager steps.
        Without device graphs: one step that re-runs the function under
        ``capturing(mode)``.
    breaks : list of str
        Labels of the eager breaks a BREAKABLE capture reached.
    stats : CaptureStats or None
        The allocator around the capture (CUDA only).
    device_graphs : bool
        Whether the steps replay recorded graphs.
    captured : tuple
        The functions that were captured, held for as long as the graph is.  A device
        graph keeps the addresses its launches read and write, not the tensors: what the
        functions' closures own (a kernel library's wrapper, its workspace and schedule,
        an output allocated before the capture) must outlive every replay, or a replay
        reads freed memory (seen on the device as an illegal memory access and as
        ``cudaErrorInvalidAddressSpace``).  Without device graphs the steps re-run these
        functions, so they are held either way.
    """

    mode: GraphMode
    steps: list[Callable[[], None]]
    device_graphs: bool
    breaks: list[str] = field(default_factory=list)
    stats: CaptureStats | None = None
    before_replay: Callable[[], object] | None = None
    captured: tuple[Callable[[], object], ...] = ()

    @property
    def plan(self) -> list[tuple[str, str]]:
        """(``"graph"`` or ``"eager"``, label) per step: what a replay runs."""
        return [("eager" if isinstance(s, EagerStep) else "graph",
                 getattr(s, "label", "")) for s in self.steps]

    @property
    def graphs(self) -> list[Any]:
        """The recorded device graphs (``torch.cuda.CUDAGraph``), in order."""
        return [s.graph for s in self.steps if isinstance(s, _GraphStep)]

    def replay(self) -> None:
        """Run the steps once (the runner's ``before_replay`` hook first); never synchronises."""
        if self.before_replay is not None:
            self.before_replay()
        for step in self.steps:
            step()


class GraphRunner:
    """Captures functions into device graphs and replays them; the one place attnreg does.

    Parameters
    ----------
    device : str or torch.device, optional
        Where the graphs run; default ``cuda`` when torch sees a GPU, else ``cpu``.
    mempool : optional
        A graph memory pool to record into (``other_runner.mempool``: the
        runners share one pool, as an engine's decode buckets do).  Default:
        a private pool of this runner.  Graphs sharing a pool must not run
        concurrently; capture the largest shape first so smaller ones reuse
        its blocks.
    capture_error_mode : {"global", "thread_local", "relaxed"}
        Passed to ``torch.cuda.graph``; use ``thread_local`` when other threads
        touch CUDA while capturing (a process group's watchdog).
    warmup : int
        Eager runs of the function before capturing it, on a side stream
        (device graphs only; 0 when the caller warmed up itself).
    forbid_sync : bool
        Record with ``torch.cuda.set_sync_debug_mode("error")`` so an operation
        that synchronises with the host inside a captured segment raises.
    device_graphs : bool, optional
        Record device graphs; default: on CUDA devices.  False: capture runs the
        function once under ``capturing(mode)`` and replay runs it again.
    before_replay : callable, optional
        Called at the start of every replay of every graph of this runner (a
        hook between capture and replay: the conformance suite churns the
        allocator there).
    recorder : GraphRecorder, optional
        What records segments (default :class:`CudaGraphRecorder`); tests pass a
        fake to check the replay plan on a cpu.

    Examples
    --------
    Capture once per bucket, replay many (cpu: capture runs, replay re-runs)::

        runner = GraphRunner("cpu")
        x, y = torch.zeros(4), torch.zeros(4)
        graph = runner.capture(lambda: torch.mul(x, 2, out=y), key=4)
        x.fill_(3.0)
        runner[4].replay()          # y == 6
    """

    def __init__(self, device: str | torch.device | None = None, *, mempool: Any = None,
                 capture_error_mode: str = "global", warmup: int = 1,
                 forbid_sync: bool = False, device_graphs: bool | None = None,
                 before_replay: Callable[[], object] | None = None,
                 recorder: GraphRecorder | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = resolve_device(device)
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(f"capture_error_mode must be one of {CAPTURE_ERROR_MODES}, got "
                             f"{capture_error_mode!r}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        on_cuda = self.device.type == "cuda"
        self.device_graphs = on_cuda if device_graphs is None else bool(device_graphs)
        if self.device_graphs and not on_cuda and recorder is None:
            raise ValueError(f"device graphs need a CUDA device, not {self.device}; pass "
                             "device_graphs=False (capture runs once, replay re-runs)")
        if mempool is None and self.device_graphs and on_cuda:
            with torch.cuda.device(self.device):
                mempool = torch.cuda.graph_pool_handle()
        self.mempool = mempool
        self.capture_error_mode = capture_error_mode
        self.warmup = int(warmup)
        self.forbid_sync = bool(forbid_sync)
        self.before_replay = before_replay
        self._recorder: GraphRecorder | None = recorder
        if self._recorder is None and self.device_graphs:
            self._recorder = CudaGraphRecorder(self.mempool,
                                               capture_error_mode=capture_error_mode,
                                               forbid_sync=self.forbid_sync)
        elif recorder is not None:
            self.device_graphs = True
        self._graphs: dict[Hashable, CapturedGraph] = {}

    # -- captured graphs by key ----------------------------------------------------------
    def __getitem__(self, key: Hashable) -> CapturedGraph:
        try:
            return self._graphs[key]
        except KeyError:
            raise KeyError(f"no graph captured under key {key!r}; captured: "
                           f"{sorted(map(repr, self._graphs))}") from None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def keys(self) -> list[Hashable]:
        """Keys of the graphs captured with ``key=``, in capture order."""
        return list(self._graphs)

    def replay(self, key: Hashable) -> None:
        """Replay the graph captured under ``key``."""
        self[key].replay()

    # -- warm-up -------------------------------------------------------------------------
    def warm_up(self, fn: Callable[[], object], mode: GraphMode | str = GraphMode.FULL,
                times: int = 1) -> None:
        """Run ``fn`` eagerly ``times`` times under ``capturing(mode)``.

        On CUDA on a side stream, joined back before returning: kernels compile
        and libraries allocate their lazy state outside any graph, and nothing
        the warm-up queued can land inside the capture.
        """
        mode = _capture_mode(mode)
        if not (self.device.type == "cuda" and self.device_graphs):
            with capturing(mode):
                for _ in range(times):
                    fn()
            return
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), capturing(mode):
                for _ in range(times):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()

    # -- capture -------------------------------------------------------------------------
    def capture(self, fn: Callable[[], object], mode: GraphMode | str = GraphMode.FULL, *,
                key: Hashable | None = None, warmup: int | None = None) -> CapturedGraph:
        """Capture ``fn`` under ``capturing(mode)``; return (and with ``key`` keep) the graph.

        Parameters
        ----------
        fn
            Takes no arguments; reads and writes static tensors only (a replay
            runs the same launches on the same addresses).
        mode
            FULL (one graph), BREAKABLE (segments split at ``eager_break``) or
            TC_PIECEWISE (one piece; see :meth:`capture_pieces` for pieces with
            eager attention between them).
        key
            Keep the graph as ``runner[key]`` (a decode bucket, a token bucket).
        warmup
            Side-stream warm-up runs (default: the runner's ``warmup``).

        Raises
        ------
        UnreplayableBreakError
            BREAKABLE: the function entered ``with eager_break(...)`` blocks.
        """
        mode = _capture_mode(mode)
        self._warm(lambda: fn(), mode, warmup)
        if not self.device_graphs:
            with capturing(mode):
                fn()
            graph = self._captured(mode, [EagerStep(_under(mode, fn), _RERUN)])
        elif mode is GraphMode.BREAKABLE:
            graph = self._capture_breakable(fn)
        else:
            graph = self._record(mode, [fn])
        graph.captured = (fn,)
        return self._keep(graph, key)

    def capture_pieces(self, pieces: Sequence[Callable[[], object] | EagerStep],
                       mode: GraphMode | str = GraphMode.TC_PIECEWISE, *,
                       key: Hashable | None = None, warmup: int | None = None
                       ) -> CapturedGraph:
        """Capture each plain callable of ``pieces`` as its own graph; run ``EagerStep`` s between.

        The torch.compile piecewise shape: attention is an :class:`EagerStep`
        that runs eagerly under ``capturing(mode)`` at capture and at every
        replay, between the recorded pieces around it.
        """
        mode = _capture_mode(mode)
        steps = list(pieces)
        if not steps:
            raise ValueError("capture_pieces needs at least one piece")

        def run_all() -> None:
            for step in steps:
                step()

        self._warm(run_all, mode, warmup)
        if not self.device_graphs:
            with capturing(mode):
                run_all()
            graph = self._captured(mode, [EagerStep(_under(mode, run_all), _RERUN)])
        else:
            graph = self._record(mode, steps)
        graph.captured = tuple(steps)
        return self._keep(graph, key)

    # -- internals -----------------------------------------------------------------------
    def _warm(self, fn: Callable[[], object], mode: GraphMode, warmup: int | None) -> None:
        times = self.warmup if warmup is None else int(warmup)
        if times and self.device_graphs and self.device.type == "cuda":
            self.warm_up(fn, mode, times)

    def _captured(self, mode: GraphMode, steps: list[Callable[[], None]], *,
                  breaks: Sequence[str] = (), stats: CaptureStats | None = None
                  ) -> CapturedGraph:
        return CapturedGraph(mode, steps, self.device_graphs, list(breaks), stats,
                             before_replay=self._call_before_replay)

    def _call_before_replay(self) -> None:
        # read at replay time: a hook set after capture still runs
        if self.before_replay is not None:
            self.before_replay()

    def _keep(self, graph: CapturedGraph, key: Hashable | None) -> CapturedGraph:
        if key is not None:
            self._graphs[key] = graph
        return graph

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[list[CaptureStats]]:
        """The device context of a capture, and its allocator statistics."""
        out: list[CaptureStats] = []
        if self.device.type != "cuda":
            yield out
            return
        with torch.cuda.device(self.device):
            # torch.cuda.graph collects garbage on entry: do it first, so tensors that
            # were already dead do not count as freed by the capture
            gc.collect()
            torch.cuda.synchronize()
            before = torch.cuda.memory_stats()
            yield out
            torch.cuda.synchronize()
            after = torch.cuda.memory_stats()

            def delta(key: str) -> int:
                return int(after.get(key, 0) - before.get(key, 0))

            out.append(CaptureStats(bytes_held=delta("allocated_bytes.all.current"),
                                    allocations=delta("allocation.all.allocated"),
                                    frees=delta("allocation.all.freed")))

    def _record(self, mode: GraphMode, pieces: Sequence[Callable[[], object] | EagerStep]
                ) -> CapturedGraph:
        """FULL / one piece, or TC_PIECEWISE pieces: one recorded graph per plain callable."""
        recorder = self._recorder
        assert recorder is not None
        steps: list[Callable[[], None]] = []
        with self._on_device() as stats, capturing(mode):
            for piece in pieces:
                if isinstance(piece, EagerStep):
                    with recorder.eager():
                        piece()
                    steps.append(EagerStep(_under(mode, piece.fn), piece.label))
                    continue
                handle = recorder.begin()
                try:
                    piece()
                except BaseException as exc:
                    recorder.end(handle, exc)
                    raise
                steps.append(_GraphStep(recorder.end(handle)))
        return self._captured(mode, steps, stats=stats[0] if stats else None)

    def _capture_breakable(self, fn: Callable[[], object]) -> CapturedGraph:
        assert self._recorder is not None
        seg = _Segments(self._recorder)
        with self._on_device() as stats:
            try:
                with capturing(GraphMode.BREAKABLE), break_handler(seg.handler,
                                                                   with_replay=True):
                    seg.begin()
                    fn()
                    seg.end()
            except BaseException as exc:
                seg.abort(exc)
                raise
        if seg.unreplayable:
            raise UnreplayableBreakError(seg.unreplayable)
        return self._captured(GraphMode.BREAKABLE, seg.steps, breaks=seg.breaks,
                              stats=stats[0] if stats else None)


def _capture_mode(mode: GraphMode | str) -> GraphMode:
    parsed = GraphMode.parse(mode)
    if parsed is GraphMode.DISABLED:
        raise ValueError("a graph is captured in FULL, BREAKABLE or TC_PIECEWISE mode; "
                         "DISABLED means eager: call the function instead")
    return parsed

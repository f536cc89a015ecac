"""GraphRunner on a cpu: the capture / replay plan of each graph mode (segments recorded by
a fake recorder that logs what a CUDA graph would replay), the cpu mode without device
graphs (capture runs once, replay runs again, both under capturing()), keys, the hook
between capture and replay, and refusals.  The CUDA recorder runs in the GPU tests."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from attnreg.graph_policy.capture import current_capture, eager_break, in_eager_break
from attnreg.registry import GraphMode
from attnreg.runtime import EagerStep, GraphRunner, UnreplayableBreakError


class FakeRecorder:
    """Records 'graphs' whose replay logs their number; counts open / closed segments."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.opened = 0
        self.closed: list[tuple[int, bool]] = []  # (segment, ended by an exception)

    def begin(self) -> int:
        self.opened += 1
        return self.opened

    def end(self, handle: int, exc: BaseException | None = None) -> Any:
        self.closed.append((handle, exc is not None))
        log = self.log

        class Graph:
            def replay(self) -> None:
                log.append(f"graph{handle}")
        return Graph()

    @staticmethod
    def eager() -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def test_cpu_mode_captures_by_running_once_and_replays_by_running_again() -> None:
    seen: list[object] = []
    x, y = torch.zeros(3), torch.zeros(3)

    def step() -> None:
        seen.append(current_capture())
        torch.mul(x, 2, out=y)

    runner = GraphRunner("cpu")
    assert not runner.device_graphs and runner.mempool is None
    graph = runner.capture(step, GraphMode.FULL, key=3)
    assert seen == [GraphMode.FULL], "capture ran the function once, under capturing()"
    x.fill_(4.0)
    runner[3].replay()
    assert seen == [GraphMode.FULL, GraphMode.FULL] and y.tolist() == [8.0] * 3
    assert runner[3] is graph and 3 in runner and runner.keys() == [3]
    assert graph.plan == [("eager", "re-run (no device graph)")] and graph.stats is None
    assert graph.graphs == []


def test_before_replay_runs_between_capture_and_every_replay() -> None:
    events: list[str] = []
    runner = GraphRunner("cpu", recorder=FakeRecorder(events))
    graph = runner.capture(lambda: None)
    runner.before_replay = lambda: events.append("hook")  # set after capture: still runs
    graph.replay()
    graph.replay()
    assert events == ["hook", "graph1", "hook", "graph1"]


def test_full_capture_records_one_segment_under_the_capture_mode() -> None:
    log: list[str] = []
    modes: list[object] = []
    recorder = FakeRecorder(log)
    graph = GraphRunner("cpu", recorder=recorder).capture(
        lambda: modes.append(current_capture()), GraphMode.FULL)
    assert modes == [GraphMode.FULL] and recorder.closed == [(1, False)]
    assert [k for k, _ in graph.plan] == ["graph"] and len(graph.graphs) == 1


def test_breakable_capture_splits_at_breaks_and_replays_them_between_segments() -> None:
    log: list[str] = []
    seen: list[tuple[bool, object]] = []

    def plan(label: str) -> None:
        seen.append((in_eager_break(), current_capture()))
        log.append(label)

    def forward() -> None:
        log.append("segment work")
        eager_break.run("plan", plan, "eager 1")
        eager_break("decorated")(plan)("eager 2")

    graph = GraphRunner("cpu", recorder=FakeRecorder(log)).capture(forward, "breakable")
    assert graph.breaks == ["plan", "decorated"]
    assert graph.plan == [("graph", "graph"), ("eager", "plan"), ("graph", "graph"),
                          ("eager", "decorated"), ("graph", "graph")]
    log.clear()
    seen.clear()
    graph.replay()
    assert log == ["graph1", "eager 1", "graph2", "eager 2", "graph3"]
    # breaks re-run eagerly, in the context they had at capture
    assert seen == [(True, GraphMode.BREAKABLE)] * 2
    assert current_capture() is None


def test_a_with_block_break_cannot_be_replayed() -> None:
    def forward() -> None:
        with eager_break("plan"):
            pass

    with pytest.raises(UnreplayableBreakError) as info:
        GraphRunner("cpu", recorder=FakeRecorder([])).capture(forward, GraphMode.BREAKABLE)
    assert info.value.labels == ["plan"]


def test_an_exception_while_capturing_closes_the_open_segment_and_propagates() -> None:
    recorder = FakeRecorder([])

    def boom() -> None:
        raise KeyError("x")

    for mode in (GraphMode.FULL, GraphMode.BREAKABLE):
        with pytest.raises(KeyError):
            GraphRunner("cpu", recorder=recorder).capture(boom, mode)
    assert recorder.closed == [(1, True), (2, True)]


def test_piecewise_pieces_are_recorded_and_attention_runs_eagerly_between_them() -> None:
    log: list[str] = []
    modes: list[object] = []

    def attention() -> None:
        modes.append(current_capture())
        log.append("attention")

    graph = GraphRunner("cpu", recorder=FakeRecorder(log)).capture_pieces(
        [lambda: log.append("a"), EagerStep(attention, "attention"),
         lambda: log.append("b")])
    assert log == ["a", "attention", "b"]  # capture ran the eager step too
    assert graph.plan == [("graph", "graph"), ("eager", "attention"), ("graph", "graph")]
    log.clear()
    graph.replay()
    assert log == ["graph1", "attention", "graph2"]
    assert modes == [GraphMode.TC_PIECEWISE] * 2


def test_piecewise_cpu_mode_runs_every_piece_again_at_replay() -> None:
    log: list[str] = []
    graph = GraphRunner("cpu").capture_pieces([lambda: log.append("a"),
                                               EagerStep(lambda: log.append("attn")),
                                               lambda: log.append("b")])
    graph.replay()
    assert log == ["a", "attn", "b"] * 2


class _Owner:
    """What a raw call's closure stands for: a wrapper, its workspace, an output."""

    def __call__(self) -> None:
        pass


def _capture_kept(how: str) -> tuple[Any, Any]:
    """A graph of an ``_Owner`` captured ``how``, and a weak reference to the owner."""
    import weakref

    owner = _Owner()
    ref = weakref.ref(owner)
    if how == "cpu":
        graph = GraphRunner("cpu").capture(owner)
    elif how == "pieces":
        graph = GraphRunner("cpu", recorder=FakeRecorder([])).capture_pieces(
            [owner, EagerStep(lambda: None, "attention")])
    else:  # the fake recorder's graphs, like device graphs, do not hold the function
        graph = GraphRunner("cpu", recorder=FakeRecorder([])).capture(owner, how)
    return graph, ref


@pytest.mark.parametrize("how", ["full", "breakable", "pieces", "cpu"])
def test_a_graph_holds_what_it_captured_for_as_long_as_it_is_held(how: str) -> None:
    import gc

    graph, ref = _capture_kept(how)
    gc.collect()
    assert ref() is not None, "the captured function was collected while its graph lives"
    graph.replay()
    del graph
    gc.collect()
    assert ref() is None  # the graph was what held it: no longer than the graph


def test_runners_share_a_memory_pool_when_asked() -> None:
    pool = object()
    assert GraphRunner("cpu", mempool=pool, recorder=FakeRecorder([])).mempool is pool


@pytest.mark.parametrize("kwargs, match", [
    ({"capture_error_mode": "loud"}, "capture_error_mode"),
    ({"warmup": -1}, "warmup"),
    ({"device_graphs": True}, "need a CUDA device"),
])
def test_bad_options_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GraphRunner("cpu", **kwargs)


def test_disabled_is_not_a_capture_mode_and_unknown_keys_say_what_exists() -> None:
    runner = GraphRunner("cpu")
    with pytest.raises(ValueError, match="DISABLED means eager"):
        runner.capture(lambda: None, GraphMode.DISABLED)
    runner.capture(lambda: None, key="decode-8")
    with pytest.raises(KeyError, match="decode-8"):
        runner["decode-16"]

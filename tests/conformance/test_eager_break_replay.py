"""Replayable eager breaks and served-by records (graph_policy.capture), and how the
GraphRunner's breakable capture uses them.  CPU logic only: the segments are fakes
that log what a CUDA graph would replay."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from attnreg.graph_policy.capture import (
    break_handler,
    capturing,
    eager_break,
    in_eager_break,
    is_capturing,
    note_served_by,
    recording_served,
)
from attnreg.registry import GraphMode

torch = pytest.importorskip("torch")

from attnreg.graph_policy.capture import dispose_tensor  # noqa: E402
from attnreg.runtime import GraphRunner, UnreplayableBreakError  # noqa: E402
from attnreg.testing.capture_harness import HARNESS_BREAK  # noqa: E402


def _replay_handler(got: list[tuple[str, Any]]):  # type: ignore[no-untyped-def]
    @contextlib.contextmanager
    def handler(label: str, replay: Any) -> Iterator[None]:
        got.append((label, replay))
        yield
    return handler


def test_function_and_decorator_breaks_hand_the_runner_a_replay_with_the_same_arguments():
    calls: list[tuple[int, bool, bool]] = []

    @eager_break("plan")
    def plan(x: int) -> int:
        calls.append((x, in_eager_break(), is_capturing()))
        return x * 2

    got: list[tuple[str, Any]] = []
    with capturing(GraphMode.BREAKABLE), break_handler(_replay_handler(got), with_replay=True):
        assert plan(3) == 6
        assert eager_break.run("run", plan.__wrapped__, 5) == 10
        with eager_break("block"):
            pass
    assert [label for label, _ in got] == ["plan", "run", "block"]
    assert got[2][1] is None  # a with block cannot be re-run
    calls.clear()
    got[0][1]()  # at replay: outside capturing(), as a runner calls it
    got[1][1]()
    # same arguments, and the context the region had at capture
    assert calls == [(3, True, True), (5, True, True)]
    assert not is_capturing() and not in_eager_break()


def test_replayed_region_keeps_dispose_a_noop():
    buf = torch.ones(4)
    got: list[tuple[str, Any]] = []
    with capturing(GraphMode.BREAKABLE), break_handler(_replay_handler(got), with_replay=True):
        eager_break.run("free", dispose_tensor, buf)
    assert buf.numel() == 4
    assert got[0][1]() is False  # replay: dispose skipped, the graph recorded buf
    assert buf.numel() == 4


@pytest.mark.parametrize("mode", [None, GraphMode.FULL, GraphMode.TC_PIECEWISE])
def test_breaks_are_plain_calls_outside_breakable_capture(mode):
    got: list[tuple[str, Any]] = []
    seen: list[bool] = []

    def work(x: int) -> int:
        seen.append(in_eager_break())
        return x + 1

    ctx = capturing(mode) if mode is not None else contextlib.nullcontext()
    with ctx, break_handler(_replay_handler(got), with_replay=True):
        assert eager_break.run("x", work, 1) == 2
        assert eager_break("y")(work)(2) == 3
    assert got == [] and seen == [False, False]


def test_label_only_handlers_still_get_just_the_label():
    labels: list[str] = []

    def handler(label: str) -> contextlib.AbstractContextManager[None]:
        labels.append(label)
        return contextlib.nullcontext()

    with capturing(GraphMode.BREAKABLE), break_handler(handler):
        assert eager_break.run("old", lambda: in_eager_break()) is True
    assert labels == ["old"]


def test_an_exception_in_a_function_break_leaves_the_break_and_propagates():
    events: list[str] = []

    @contextlib.contextmanager
    def handler(label: str, replay: Any) -> Iterator[None]:
        events.append("end")
        try:
            yield
        finally:
            events.append("begin")

    def boom() -> None:
        raise KeyError("x")

    with capturing(GraphMode.BREAKABLE), break_handler(handler, with_replay=True):
        with pytest.raises(KeyError):
            eager_break.run("boom", boom)
        assert not in_eager_break()
    assert events == ["end", "begin"]


def test_served_records_are_kept_only_while_recording_and_carry_the_context():
    note_served_by("a", "a")  # nobody records: nothing to keep, nothing raised
    with recording_served() as outer:
        note_served_by("a", "a")
        with capturing(GraphMode.BREAKABLE), recording_served() as inner:
            note_served_by("a", "fallback", "why")
            with break_handler(lambda label: contextlib.nullcontext()), eager_break("e"):
                note_served_by("a", "a")
    assert [(r.implementation, r.under_capture) for r in inner] == [("fallback", True),
                                                                     ("a", False)]
    assert [r.implementation for r in outer] == ["a", "fallback", "a"]
    assert inner[0].detail == "why" and inner[0].mode is GraphMode.BREAKABLE


class _FakeRecorder:
    """Stands in for CUDA graph segments: each 'graph' logs its number when replayed."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.opened = 0

    def begin(self) -> int:
        self.opened += 1
        return self.opened

    def end(self, handle: int, exc: BaseException | None = None) -> Any:
        log = self.log

        class Graph:
            def replay(self) -> None:
                log.append(f"graph{handle}")
        return Graph()

    @staticmethod
    def eager() -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def _harness_like(log: list[str], backend_break: Any) -> Any:
    """The conformance harness's captured function: attention, its own break, an epilogue."""
    def step() -> None:
        backend_break()
        eager_break.run(HARNESS_BREAK, log.append, "harness")
    return step


def test_the_runner_replays_a_backends_own_break_between_the_right_graphs():
    log: list[str] = []
    runner = GraphRunner("cpu", recorder=_FakeRecorder(log))
    graph = runner.capture(_harness_like(log, lambda: eager_break.run("attn", log.append,
                                                                      "attention")),
                           GraphMode.BREAKABLE)
    assert graph.breaks == ["attn", HARNESS_BREAK]
    assert [kind for kind, _ in graph.plan] == ["graph", "eager", "graph", "eager", "graph"]
    log.clear()
    graph.replay()
    assert log == ["graph1", "attention", "graph2", "harness", "graph3"]


def test_the_runner_refuses_to_replay_a_with_block_break_and_the_harness_skips_it():
    log: list[str] = []

    def with_block() -> None:
        with eager_break("attn"):
            log.append("attention")

    runner = GraphRunner("cpu", recorder=_FakeRecorder(log))
    with pytest.raises(UnreplayableBreakError, match="as a `with` block.*eager_break.run"):
        runner.capture(_harness_like(log, with_block), GraphMode.BREAKABLE)

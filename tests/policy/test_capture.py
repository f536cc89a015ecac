"""The capture context: ContextVar semantics, dispose_tensor, eager breaks."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import torch

from attnreg.graph_policy import (
    break_handler,
    capturing,
    current_capture,
    dispose_tensor,
    eager_break,
    in_eager_break,
    is_capturing,
)
from attnreg.registry import GraphMode

CAPTURE_MODES = (GraphMode.FULL, GraphMode.BREAKABLE, GraphMode.TC_PIECEWISE)


def test_capturing_nests_and_restores_the_outer_mode() -> None:
    assert current_capture() is None and not is_capturing()
    with capturing(GraphMode.FULL):
        assert current_capture() is GraphMode.FULL
        with capturing("breakable"):
            assert current_capture() is GraphMode.BREAKABLE
        assert current_capture() is GraphMode.FULL
    assert current_capture() is None


def test_capturing_restores_on_exception() -> None:
    with pytest.raises(RuntimeError), capturing(GraphMode.BREAKABLE):
        raise RuntimeError("boom")
    assert current_capture() is None


def test_capturing_disabled_is_refused() -> None:
    with pytest.raises(ValueError, match="DISABLED"), capturing(GraphMode.DISABLED):
        pass


def test_a_new_thread_starts_outside_capture() -> None:
    seen: list[GraphMode | None] = []
    with capturing(GraphMode.FULL):
        worker = threading.Thread(target=lambda: seen.append(current_capture()))
        worker.start()
        worker.join()
        assert current_capture() is GraphMode.FULL
    assert seen == [None]


def test_async_tasks_inherit_at_creation_and_do_not_leak() -> None:
    async def inner_capture() -> GraphMode | None:
        with capturing(GraphMode.TC_PIECEWISE):
            await asyncio.sleep(0)
            return current_capture()

    async def observe() -> GraphMode | None:
        await asyncio.sleep(0)
        return current_capture()

    async def main() -> tuple[object, ...]:
        with capturing(GraphMode.BREAKABLE):
            inherited = asyncio.create_task(observe())
        outside = asyncio.create_task(observe())
        leaked = await asyncio.gather(inner_capture(), observe())
        return (await inherited, await outside, *leaked, current_capture())

    inherited, outside, inner, sibling, after = asyncio.run(main())
    assert inherited is GraphMode.BREAKABLE
    assert outside is None
    assert inner is GraphMode.TC_PIECEWISE
    assert sibling is None and after is None


@pytest.mark.parametrize("mode", CAPTURE_MODES, ids=lambda m: m.value)
def test_dispose_tensor_is_a_noop_under_every_capture_mode(mode: GraphMode) -> None:
    t = torch.arange(8, dtype=torch.float32)
    ptr = t.untyped_storage().data_ptr()
    with capturing(mode):
        assert dispose_tensor(t) is False
    assert t.numel() == 8 and t.untyped_storage().data_ptr() == ptr
    assert torch.equal(t, torch.arange(8, dtype=torch.float32))


def test_dispose_tensor_frees_storage_outside_capture() -> None:
    t = torch.ones(16, dtype=torch.bfloat16)
    assert dispose_tensor(t) is True
    assert t.numel() == 0 and t.untyped_storage().nbytes() == 0
    assert t.dtype is torch.bfloat16 and t.device.type == "cpu"


def _recording_handler(events: list[tuple[str, str]]):  # type: ignore[no-untyped-def]
    @contextlib.contextmanager
    def handler(label: str):  # type: ignore[no-untyped-def]
        events.append(("end_segment", label))
        try:
            yield
        finally:
            events.append(("begin_segment", label))
    return handler


def test_eager_break_splits_only_breakable_capture() -> None:
    events: list[tuple[str, str]] = []
    with break_handler(_recording_handler(events)):
        with eager_break("outside"):
            assert not in_eager_break()
        for mode in (GraphMode.FULL, GraphMode.TC_PIECEWISE):
            with capturing(mode), eager_break(mode.value):
                assert not in_eager_break()
        assert events == []
        with capturing(GraphMode.BREAKABLE):
            with eager_break("plan"):
                assert in_eager_break() and is_capturing()
                with eager_break("nested"):  # already eager: one break
                    pass
            assert not in_eager_break()
    assert events == [("end_segment", "plan"), ("begin_segment", "plan")]


def test_eager_break_as_decorator_and_on_exception() -> None:
    events: list[tuple[str, str]] = []

    @eager_break("host_plan")
    def plan_on_host() -> bool:
        return in_eager_break()

    with break_handler(_recording_handler(events)), capturing(GraphMode.BREAKABLE):
        assert plan_on_host() is True
        with pytest.raises(KeyError), eager_break("fails"):
            raise KeyError("x")
        assert not in_eager_break()
    assert events == [("end_segment", "host_plan"), ("begin_segment", "host_plan"),
                      ("end_segment", "fails"), ("begin_segment", "fails")]
    assert plan_on_host() is False  # outside capture: just runs


def test_eager_break_without_handler_does_nothing() -> None:
    with capturing(GraphMode.BREAKABLE), eager_break("lonely"):
        assert not in_eager_break()


def test_nested_capture_inside_an_eager_break_is_not_eager() -> None:
    events: list[tuple[str, str]] = []
    with break_handler(_recording_handler(events)), capturing(GraphMode.BREAKABLE), \
            eager_break("outer"):
        with capturing(GraphMode.BREAKABLE):
            assert not in_eager_break()
            with eager_break("inner"):
                assert in_eager_break()
        assert in_eager_break()
    assert [e for e in events if e[0] == "end_segment"] == [("end_segment", "outer"),
                                                            ("end_segment", "inner")]

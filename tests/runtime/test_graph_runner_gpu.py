"""GraphRunner with real CUDA graphs: replays see new inputs, breaks and eager pieces run
between recorded segments, runners share a memory pool, the sync guard is lifted in eager
breaks.  (The backends under the runner: tests/backends*/..._gpu.py and the conformance
suite with --device cuda.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attnreg.graph_policy.capture import current_capture, eager_break
from attnreg.registry import GraphMode
from attnreg.runtime import EagerStep, GraphRunner

pytestmark = pytest.mark.gpu


def _buffers(n: int = 4096) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(n, device="cuda") for _ in range(4))


def test_full_graph_replays_the_new_inputs_and_warms_up_on_a_side_stream() -> None:
    x, y, _, _ = _buffers()
    streams: list[object] = []
    modes: list[object] = []

    def step() -> None:
        streams.append(torch.cuda.current_stream())
        modes.append(current_capture())
        torch.mul(x, 2, out=y)

    main = torch.cuda.current_stream()
    graph = GraphRunner("cuda").capture(step, GraphMode.FULL)
    assert len(streams) == 2 and streams[0] != main, "warm-up ran on a side stream"
    assert modes == [GraphMode.FULL, GraphMode.FULL]
    assert len(graph.graphs) == 1 and graph.stats is not None
    for value in (3.0, -1.5):
        x.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.all(y == 2 * value)
    assert len(streams) == 2, "a replay runs no Python"


def test_breakable_graph_reruns_its_eager_break_between_segments_under_forbid_sync() -> None:
    x, y, z, w = _buffers()
    host_reads: list[float] = []

    def read_on_host() -> None:
        value = float(y[0].item())  # a sync: allowed in the eager break despite forbid_sync
        host_reads.append(value)
        z.fill_(value + 1.0)

    def step() -> None:
        torch.mul(x, 2, out=y)                       # segment 1
        eager_break.run("host", read_on_host)        # eager, re-run at replay
        torch.mul(z, 3, out=w)                       # segment 2

    runner = GraphRunner("cuda", forbid_sync=True, capture_error_mode="thread_local")
    graph = runner.capture(step, GraphMode.BREAKABLE)
    assert [kind for kind, _ in graph.plan] == ["graph", "eager", "graph"]
    x.fill_(5.0)
    graph.replay()
    torch.cuda.synchronize()
    assert host_reads[-1] == 10.0 and torch.all(w == 33.0)


def test_piecewise_pieces_share_the_pool_of_another_runner() -> None:
    x, y, z, w = _buffers()
    calls: list[object] = []

    def attention() -> None:  # eager between the pieces, like a splitting op
        calls.append(current_capture())
        torch.add(y, float(len(calls)), out=z)

    first = GraphRunner("cuda")
    second = GraphRunner("cuda", mempool=first.mempool)
    assert second.mempool is first.mempool
    decode = first.capture(lambda: torch.mul(x, 4, out=w), key=1)
    pieces = second.capture_pieces([lambda: torch.mul(x, 2, out=y), EagerStep(attention),
                                    lambda: torch.mul(z, 10, out=w)])
    assert [kind for kind, _ in pieces.plan] == ["graph", "eager", "graph"]
    x.fill_(1.0)
    runs_before = len(calls)
    pieces.replay()
    torch.cuda.synchronize()
    assert calls[-1] is GraphMode.TC_PIECEWISE and len(calls) == runs_before + 1
    assert torch.all(w == (2.0 + len(calls)) * 10)
    decode.replay()
    torch.cuda.synchronize()
    assert torch.all(w == 4.0) and first[1] is decode


def test_the_hook_runs_before_each_replay() -> None:
    x, y, _, _ = _buffers()
    order: list[str] = []
    runner = GraphRunner("cuda", before_replay=lambda: order.append("hook"))
    graph = runner.capture(lambda: torch.mul(x, 2, out=y))
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert order == ["hook", "hook"]

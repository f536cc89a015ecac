"""The padding rows of a replayed graph (issue 31, peers.wrapper): every fill of the graph
buffers sets ``GraphState.pad_mask`` once, outside the graph, and a backend's
``zero_padded_rows`` is then one launch per layer (it was two: the mask recomputed per
layer).  Checked on CPU: the rows it zeroes after fills of different sizes, through the
packed and the per-tensor copy, and the ops one zeroing runs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attnreg.registry import CaptureShape, DType, ForwardMode, GraphMode, Phase  # noqa: E402
from attnreg.runtime import ForwardBatch  # noqa: E402
from attnreg.runtime.graph_buffers import GraphState  # noqa: E402

from ._dispatch_ops import RecordOps  # noqa: E402

PAGE, BS, MAX_SEQ = 4, 4, 32


def _state() -> GraphState:
    shape = CaptureShape(max_batch_size=BS, max_num_tokens=BS, max_seq_len=MAX_SEQ,
                         num_heads=2, page_size=PAGE, kv_dtype=DType.parse("bf16"), num_sms=0)
    return GraphState.allocate(max_bs=BS, max_num_tokens=BS, max_seq_len=MAX_SEQ,
                               page_size=PAGE, graph_modes={Phase.DECODE: GraphMode.FULL},
                               capture_shape=shape, device=torch.device("cpu"))


def _batch(state: GraphState, n: int, packed: bool) -> ForwardBatch:
    table = torch.arange(1, 1 + n * state.max_pages, dtype=torch.int32).view(n, -1)
    loc = [int(table[b, 0]) * PAGE + 2 for b in range(n)]
    return ForwardBatch.build(ForwardMode.DECODE, [2] * n, [1] * n, table, loc,
                              layout=state.layout if packed else None)



@pytest.mark.parametrize("packed", [False, True])
def test_each_fill_sets_the_mask_the_zeroing_reads(packed: bool):
    state = _state()
    md = state.views(ForwardMode.DECODE, BS, BS, GraphMode.FULL)
    for n in (BS, 1, 3, BS, 2):  # shrinking and growing: every fill resets the mask
        batch = _batch(state, n, packed)
        if packed:
            assert state.fill_packed(md, batch)
        else:
            state.fill(md, batch, PAGE)
        out = torch.ones(BS, 2, 8)
        lse = torch.zeros(BS, 2)
        state.zero_padded_rows(out, md)
        state.fill_padded_rows(lse, md, float("-inf"))
        assert out[:n].eq(1).all() and out[n:].eq(0).all(), (n, out[:, 0, 0])
        assert lse[:n].eq(0).all() and lse[n:].eq(float("-inf")).all()
    assert state.fills["packed" if packed else "padded"] == 5


def test_one_zeroing_is_one_op_and_eager_metadata_none():
    state = _state()
    md = state.views(ForwardMode.DECODE, BS, BS, GraphMode.FULL)
    state.fill(md, _batch(state, 2, False), PAGE)
    out = torch.ones(BS, 2, 8)
    with RecordOps() as seen:
        state.zero_padded_rows(out, md)
    compute = [op for op in seen.ops if op not in ("aten.slice", "aten.view")]
    assert compute == ["aten.masked_fill_"], seen.ops
    eager = state.views(ForwardMode.DECODE, BS, BS, GraphMode.FULL)
    eager.graph_mode = GraphMode.DISABLED
    with RecordOps() as seen:
        state.zero_padded_rows(out, eager)
    assert seen.ops == []


def test_a_packed_fill_is_one_copy_that_brings_the_mask():
    """Issue 26 (host step): the packed batch carries its padding rows, so its replay
    metadata is the one copy of the flat buffer, no second launch setting the mask."""
    state = _state()
    md = state.views(ForwardMode.DECODE, BS, BS, GraphMode.FULL)
    state.fill(md, _batch(state, BS, False), PAGE)  # a full batch first: no padding rows
    assert not state.pad_mask.any()
    batch = _batch(state, 1, True)
    with RecordOps() as seen:
        assert state.fill_packed(md, batch)
    assert [op for op in seen.ops if op not in ("aten.slice", "aten.view")] == ["aten.copy_"]
    assert state.pad_mask.tolist() == [False] + [True] * (BS - 1)
    # the flags are whole int32 0 / 1 (the per-tensor path's ge writes them the same way)
    flags = state.layout.padding_rows(state.flat)
    assert flags.tolist() == [0] + [1] * (BS - 1)
    state.fill(md, _batch(state, 3, False), PAGE)
    assert flags.tolist() == [0, 0, 0, 1] and state.pad_mask.tolist() == [False] * 3 + [True]


def test_zeroing_with_a_source_copies_it_and_eager_metadata_only_copies():
    state = _state()
    md = state.views(ForwardMode.DECODE, BS, BS, GraphMode.FULL)
    state.fill(md, _batch(state, 3, False), PAGE)
    src = torch.arange(BS * 2 * 8, dtype=torch.float32).view(BS, 2, 8) + 1
    out = torch.full((BS, 2, 8), float("nan"))
    state.fill_padded_rows(out, md, 0.0, src=src)
    assert torch.equal(out[:3], src[:3]) and out[3:].eq(0).all()
    eager = state.views(ForwardMode.DECODE, BS, BS, GraphMode.FULL)
    eager.graph_mode = GraphMode.DISABLED
    out = torch.full((BS, 2, 8), float("nan"))
    state.fill_padded_rows(out, eager, 0.0, src=src)
    assert torch.equal(out, src)

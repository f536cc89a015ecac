"""A batch packed into the graph's own index buffer (``GraphSession.index_buffer``): its replay
copies nothing and gives what the copied batch gives; once anything else writes the buffer (the
next batch packed, a batch copied in by a replay, a capture) the batch is refused, eagerly and
replayed, instead of attending the pages of the batch that overwrote it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attnreg.registry import UnsupportedError, get_registry  # noqa: E402
from attnreg.runtime import (  # noqa: E402
    GraphSession,
    IndexBuffer,
    MLAConfig,
    StepInputs,
    decode_batch,
    verify_batch,
)

H, PS = 2, 16


@pytest.fixture()
def setup():  # type: ignore[no-untyped-def]
    cfg = MLAConfig(num_heads=H, page_size=PS, max_context_len=256)
    pool = cfg.make_pool(120)
    g = torch.Generator().manual_seed(5)
    layer = pool.layers[0]
    layer.buffer.copy_(torch.randn(layer.buffer.shape, generator=g).to(layer.buffer.dtype))
    be = get_registry().create("triton", cfg)  # the reference declares no graphs
    ses = GraphSession(be, pool, phase="decode", mode="full", buckets=[2, 4], writes_kv=False,
                       forward_modes={"decode": 1, "target_verify": 2})
    ses.capture()
    q = StepInputs([torch.randn(3, H, 576, generator=g).bfloat16()])
    return ses, pool, q, g


def test_a_batch_packed_into_the_buffer_replays_with_no_copy_and_the_same_outputs(setup):
    ses, pool, q, g = setup
    state = ses.backend.graph_state
    assert isinstance(ses.index_buffer, IndexBuffer) and ses.index_buffer.flat is state.flat
    pages = pool.allocate([33, 70, 5])
    copied = ses.run(decode_batch(pool, [33, 70, 5], pages=pages, layout=ses.index_layout), q)
    want = copied.output.clone()
    before = dict(state.fills)
    batch = decode_batch(pool, [33, 70, 5], pages=pages, layout=ses.index_buffer)
    assert batch.packed.flat is state.flat and ses.index_buffer.holds(batch.packed)
    res = ses.run(batch, q)
    assert res.replayed and res.bucket == 4 and torch.equal(res.output, want)
    assert state.fills["in_place"] - before["in_place"] == 1
    assert state.fills["packed"] == before["packed"] and state.fills["padded"] == before["padded"]
    # the same batch again, and eagerly: still held, still its own pages
    assert torch.equal(ses.run(batch, q).output, want)
    eager = ses.eager(batch, q)[0]
    assert torch.allclose(eager.float(), want.float(), atol=2e-2, rtol=2e-2)
    vq = StepInputs([torch.randn(6, H, 576, generator=g).bfloat16()])
    v_want = ses.run(verify_batch(pool, [31, 68, 3], 2, pages=pages), vq).output.clone()
    v = ses.run(verify_batch(pool, [31, 68, 3], 2, pages=pages, layout=ses.index_buffer), vq)
    assert v.replayed and torch.equal(v.output, v_want)


def _refused(fn):  # type: ignore[no-untyped-def]
    with pytest.raises(UnsupportedError, match="packed into a graph's index buffer"):
        fn()


def test_a_batch_overwritten_by_the_next_pack_is_refused_not_run_on_the_other_s_pages(setup):
    ses, pool, q, _ = setup
    first_pages, other_pages = pool.allocate([33, 70, 5]), pool.allocate([9, 100, 40])
    first = decode_batch(pool, [33, 70, 5], pages=first_pages, layout=ses.index_buffer)
    other = decode_batch(pool, [9, 100, 40], pages=other_pages, layout=ses.index_buffer)
    assert first.packed.overwritten and not other.packed.overwritten
    _refused(lambda: ses.run(first, q))
    _refused(lambda: ses.eager(first, q))
    _refused(lambda: ses.replay(first, q))
    with pytest.raises(ValueError, match="build it again"):
        first.in_layout(ses.index_layout)
    assert ses.run(other, q).replayed  # the batch the buffer holds runs


def test_a_replay_that_copies_another_batch_in_or_a_capture_overwrites_the_held_batch(setup):
    ses, pool, q, _ = setup
    pages = pool.allocate([33, 70, 5])
    held = decode_batch(pool, [33, 70, 5], pages=pages, layout=ses.index_buffer)
    ses.run(decode_batch(pool, [33, 70, 5], pages=pages, layout=ses.index_layout), q)
    _refused(lambda: ses.run(held, q))
    held = decode_batch(pool, [33, 70, 5], pages=pages, layout=ses.index_buffer)
    ses.run(decode_batch(pool, [33, 70, 5], pages=pages), q)  # the per-tensor padded copy
    _refused(lambda: ses.run(held, q))
    held = decode_batch(pool, [33, 70, 5], pages=pages, layout=ses.index_buffer)
    ses.capture()  # a capture's dummy batches fill the buffers
    _refused(lambda: ses.run(held, q))


def test_repacking_a_held_batch_into_its_own_buffer_keeps_its_pages(setup):
    ses, pool, q, _ = setup
    pages = pool.allocate([33, 70, 5])
    want = ses.run(decode_batch(pool, [33, 70, 5], pages=pages), q).output.clone()
    held = decode_batch(pool, [33, 70, 5], pages=pages, layout=ses.index_buffer)
    table = held.page_table.clone()
    # its page table and slots are views of the buffer the pack is about to fill: they must be
    # read before they are overwritten, not copied from the padding the fill left
    again = held.in_layout(ses.index_buffer)
    assert torch.equal(again.page_table, table) and held.packed.overwritten
    assert torch.equal(ses.run(again, q).output, want)


def test_an_index_buffer_takes_a_batch_of_its_own_device_and_layout_only(setup):
    ses, pool, _, _ = setup
    buf = ses.index_buffer
    with pytest.raises(ValueError, match="this index buffer on cpu"):
        buf.pack([3], [2], [1], torch.zeros(1, 1, dtype=torch.int32), [0],
                  torch.device("meta"))
    with pytest.raises(ValueError, match="flat index buffer of this layout"):
        IndexBuffer(buf.layout, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="does not fit"):
        decode_batch(pool, [30] * 5, layout=buf)
    assert buf.current is None or not buf.current.overwritten

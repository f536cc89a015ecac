"""Device-side replay metadata: a batch built in a session's IndexLayout fills the graph buffers
with one copy, and that copy leaves exactly what the per-tensor padded copy leaves, for every
captured shape and forward mode; batches that changed since they were packed, or were packed for
another layout, take the padded copy; the replayed outputs are the same either way."""

from __future__ import annotations

import dataclasses
import random

import pytest

torch = pytest.importorskip("torch")

from attnreg.registry import CaptureShape, DType, ForwardMode, GraphMode, Phase, get_registry  # noqa: E402
from attnreg.runtime import (  # noqa: E402
    PADDING_PAGE,
    GraphSession,
    GraphState,
    IndexLayout,
    MLAConfig,
    StepInputs,
    decode_batch,
    draft_extend_batch,
    extend_batch,
    verify_batch,
)
from attnreg.runtime.validation import batch_problems  # noqa: E402

H, PS = 2, 16


def _cfg() -> MLAConfig:
    return MLAConfig(num_heads=H, page_size=PS, max_context_len=256)


def _state(max_bs: int, max_tokens: int, max_seq_len: int = 256) -> GraphState:
    shape = CaptureShape(max_batch_size=max_bs, max_num_tokens=max_tokens,
                         max_seq_len=max_seq_len, num_heads=H, page_size=PS,
                         kv_dtype=DType.BF16, num_sms=0)
    return GraphState.allocate(max_bs=max_bs, max_num_tokens=max_tokens,
                               max_seq_len=max_seq_len, page_size=PS,
                               graph_modes={Phase.DECODE: GraphMode.FULL}, capture_shape=shape,
                               device=torch.device("cpu"))


def _batches(pool, layout, rng):  # type: ignore[no-untyped-def]
    """(forward mode, bucket, unpacked batch, the same batch packed in ``layout``)."""
    out = []
    for _ in range(6):
        b = rng.randint(1, 4)
        seq = [rng.randint(1, 200) for _ in range(b)]
        pages = pool.allocate(seq)
        out.append((ForwardMode.DECODE, 4, decode_batch(pool, seq, pages=pages),
                    decode_batch(pool, seq, pages=pages, layout=layout)))
        prefix = [max(0, s - 3) for s in seq]
        out.append((ForwardMode.TARGET_VERIFY, 4, verify_batch(pool, prefix, 3, pages=pages),
                    verify_batch(pool, prefix, 3, pages=pages, layout=layout)))
        ext = [rng.randint(1, 3) for _ in range(b)]
        pre = [max(0, s - e) for s, e in zip(seq, ext)]
        out.append((ForwardMode.DRAFT_EXTEND, 4,
                    draft_extend_batch(pool, pre, ext, pages=pages),
                    draft_extend_batch(pool, pre, ext, pages=pages, layout=layout)))
        pool.free([p for ps in pages for p in ps])
    return out


def test_one_copy_of_a_packed_batch_leaves_what_the_padded_copy_leaves_for_every_shape():
    cfg = _cfg()
    pool = cfg.make_pool(200)
    rng = random.Random(7)
    packed_state, padded_state = _state(4, 12), _state(4, 12)
    layout = packed_state.layout
    assert layout == padded_state.layout and layout.pad_slot == PADDING_PAGE * PS
    for fm, bs, plain, packed in _batches(pool, layout, rng):
        nt = bs * GraphState.query_bound(fm, bs, 12) if fm is not ForwardMode.DECODE else bs
        for state, batch in ((packed_state, packed), (padded_state, plain)):
            state.flat.fill_(-7)  # what an earlier replay left: every entry must be rewritten
            md = state.views(fm, bs, nt, GraphMode.FULL)
            assert not state.fit_problems(md, batch)
            state.fill(md, batch, PS)
        got = packed_state.indices.view(bs, nt)
        want = padded_state.indices.view(bs, nt)
        for (name, a), (_, b) in zip(got.items(), want.items()):
            assert torch.equal(a, b), f"{fm} bucket {bs}: {name} differs between the two fills"
    assert packed_state.fills == {"packed": 18, "padded": 0, "in_place": 0}
    assert padded_state.fills == {"packed": 0, "padded": 18, "in_place": 0}


def test_a_packed_batch_has_the_same_tensors_and_passes_the_same_checks():
    cfg = _cfg()
    pool = cfg.make_pool(64)
    layout = _state(4, 24).layout
    pages = pool.allocate([40, 17, 3])
    plain = extend_batch(pool, [30, 10, 0], [10, 7, 3], pages=pages)
    packed = extend_batch(pool, [30, 10, 0], [10, 7, 3], pages=pages, layout=layout)
    assert packed.packed is not None and plain.packed is None
    for (name, a), (_, b) in zip(packed.indices.items(), plain.indices.items()):
        if name == "page_table":  # as wide as the layout: the extra columns are the padding page
            assert torch.equal(a[:, :b.shape[1]], b) and bool((a[:, b.shape[1]:] == 0).all())
        else:
            assert torch.equal(a, b), name
    assert batch_problems(packed, torch.device("cpu"), PS) == []
    ref = get_registry().create("reference", cfg)
    q = torch.randn(20, H, 576).bfloat16()
    assert torch.equal(ref.forward_extend(q, None, None, pool, packed),
                       ref.forward_extend(q, None, None, pool, plain))


def test_a_batch_changed_since_packing_or_packed_for_another_layout_takes_the_padded_copy():
    cfg = _cfg()
    pool = cfg.make_pool(64)
    state = _state(4, 4)
    pages = pool.allocate([20, 9])
    packed = decode_batch(pool, [20, 9], pages=pages, layout=state.layout)
    changed = dataclasses.replace(packed, seq_lens=packed.seq_lens.clone())
    other = decode_batch(pool, [20, 9], pages=pages, layout=_state(8, 8).layout)
    md = state.views(ForwardMode.DECODE, 4, 4, GraphMode.FULL)
    for batch in (changed, other):
        state.fill(md, batch, PS)
    assert state.fills == {"packed": 0, "padded": 2, "in_place": 0}
    assert state.indices.seq_lens[:4].tolist() == [20, 9, 0, 0]


def test_pack_refuses_a_batch_the_layout_cannot_hold():
    cfg = _cfg()
    pool = cfg.make_pool(64)
    layout = IndexLayout(max_bs=2, max_num_tokens=2, max_pages=4, page_size=PS)
    with pytest.raises(ValueError, match="3 sequences, the layout holds 2"):
        decode_batch(pool, [5, 5, 5], layout=layout)
    with pytest.raises(ValueError, match="needs more than the layout's 4 pages"):
        decode_batch(pool, [65], layout=layout)
    with pytest.raises(ValueError, match="max_pages must be >= 1"):
        IndexLayout(max_bs=2, max_num_tokens=2, max_pages=0, page_size=PS)


def test_a_session_replays_a_packed_batch_with_one_copy_and_the_same_outputs():
    backend = "triton"  # the reference declares no graphs
    cfg = _cfg()
    pool = cfg.make_pool(120)
    g = torch.Generator().manual_seed(3)
    pool.layers[0].buffer.copy_(torch.randn(pool.layers[0].buffer.shape, generator=g)
                                .to(pool.layers[0].buffer.dtype))
    be = get_registry().create(backend, cfg)
    ses = GraphSession(be, pool, phase="decode", mode="full", buckets=[2, 4], writes_kv=False,
                       forward_modes={"decode": 1, "target_verify": 2})
    ses.capture()
    layout = ses.index_layout
    assert layout == be.graph_state.layout and layout.max_bs == 4
    pages = pool.allocate([33, 70, 5])
    q = StepInputs([torch.randn(3, H, 576, generator=g).bfloat16()])
    before = dict(be.graph_state.fills)
    plain = ses.run(decode_batch(pool, [33, 70, 5], pages=pages), q)
    plain_out = plain.output.clone()
    packed = ses.run(decode_batch(pool, [33, 70, 5], pages=pages, layout=layout), q)
    assert plain.replayed and packed.replayed and packed.bucket == 4
    assert torch.equal(packed.output, plain_out)
    vq = StepInputs([torch.randn(6, H, 576, generator=g).bfloat16()])
    v_plain = ses.run(verify_batch(pool, [31, 68, 3], 2, pages=pages), vq).output.clone()
    v_packed = ses.run(verify_batch(pool, [31, 68, 3], 2, pages=pages, layout=layout), vq)
    assert v_packed.replayed and torch.equal(v_packed.output, v_plain)
    fills = be.graph_state.fills
    assert fills["packed"] - before["packed"] == 2 and fills["padded"] - before["padded"] == 2


def test_a_packed_batch_is_checked_per_tensor_again_once_its_lengths_or_tensors_change():
    cfg = _cfg()
    pool = cfg.make_pool(64)
    layout = _state(4, 4).layout
    packed = decode_batch(pool, [20, 9], layout=layout)
    cpu = torch.device("cpu")
    assert packed.packed.serves(packed) and batch_problems(packed, cpu, PS) == []
    assert batch_problems(packed, cpu, 64) == [
        "the batch was packed for pages of 16, the backend's are 64"]
    lied = dataclasses.replace(packed, seq_lens_cpu=(20, 10))
    assert not packed.packed.serves(lied)
    assert any("host lengths disagree" in p for p in batch_problems(lied, cpu, PS))
    wrong = dataclasses.replace(packed, seq_lens=packed.seq_lens.long())
    assert not packed.packed.serves(wrong)
    assert any("seq_lens is torch.int64" in p for p in batch_problems(wrong, cpu, PS))


def test_the_gate_facts_of_a_packed_batch_equal_the_checked_constructor_s():
    from attnreg.graph_policy import ReplayBatch
    from attnreg.runtime import replay_batch

    cfg = _cfg()
    pool = cfg.make_pool(200)
    layout = _state(4, 12).layout
    for fm, _, plain, packed in _batches(pool, layout, random.Random(11)):
        fast = replay_batch(packed)
        slow = ReplayBatch(forward_mode=fm, batch_size=plain.batch_size,
                           num_tokens=plain.num_tokens, prefix_lens=plain.prefix_lens_cpu,
                           extend_lens=plain.extend_lens_cpu, seq_lens=plain.seq_lens_cpu)
        assert fast == slow and replay_batch(plain) == slow, fm
        assert fast.max_seq_len == slow.max_seq_len and fast.query_lens == slow.query_lens
    with_facts = replay_batch(packed, lora=True)
    assert with_facts.lora is True and with_facts.seq_lens == packed.seq_lens_cpu


def test_in_layout_packs_the_same_batch():
    cfg = _cfg()
    pool = cfg.make_pool(64)
    layout = _state(4, 24).layout
    plain = extend_batch(pool, [30, 10], [10, 7])
    packed = plain.in_layout(layout)
    assert packed.packed is not None and packed.packed.serves(packed)
    assert packed.seq_lens_cpu == plain.seq_lens_cpu
    for (name, a), (_, b) in zip(packed.indices.items(), plain.indices.items()):
        assert torch.equal(a[:, :b.shape[1]] if name == "page_table" else a, b), name


def test_a_packed_batch_s_remembered_decision_is_the_session_s_own_for_every_batch():
    """The session answers a packed batch from its lengths' summary, remembered per key;
    over generated batches (sizes beyond the buckets, sequences beyond the captured
    length, other draft counts) it is the answer the full question gives, twice over."""
    from attnreg.runtime import replay_batch

    cfg = _cfg()
    pool = cfg.make_pool(400)
    be = get_registry().create("triton", cfg)
    ses = GraphSession(be, pool, phase="decode", mode="full", buckets=[2, 4], writes_kv=False,
                       max_seq_len=160,
                       forward_modes={"decode": 1, "target_verify": 2, "draft_extend": 3})
    layout = _state(8, 40).layout  # holds batches the session's buckets do not
    rng = random.Random(5)
    answers = set()
    for _ in range(120):
        b = rng.randint(1, 8)
        seq = [rng.randint(4, 230) for _ in range(b)]
        pages = pool.allocate(seq)
        drafts = rng.choice([1, 2, 3])
        ext = [rng.randint(1, 4) for _ in range(b)]
        for build in (lambda **kw: decode_batch(pool, seq, pages=pages, **kw),
                      lambda **kw: verify_batch(pool, [s - drafts for s in seq], drafts,
                                                pages=pages, **kw),
                      lambda **kw: draft_extend_batch(pool, [s - e for s, e in zip(seq, ext)],
                                                      ext, pages=pages, **kw)):
            packed = build(layout=layout)
            expected = ses._own_decision(replay_batch(build()))
            assert ses.decide(packed) == expected and ses.decide(packed) == expected
            answers.add(expected[2].rule)
        pool.free([p for ps in pages for p in ps])
    assert {"gate.ok", "gate.batch_slots", "gate.seq_len_above_max",
            "gate.spec_query_len"} <= answers


@pytest.mark.parametrize(("max_bs", "max_tokens"), [(1, 1), (3, 5), (128, 128), (32, 32)])
def test_the_page_table_starts_256_byte_aligned_in_the_flat_buffer(max_bs, max_tokens):
    # a kernel reading one table entry per token (page size 1) ran 5% slower on a table
    # 8 bytes past a 16-byte boundary, where the flat buffer used to put it at B = 128
    layout = IndexLayout(max_bs=max_bs, max_num_tokens=max_tokens, max_pages=8, page_size=1)
    flat, views = layout.allocate("cpu")
    offset = views.page_table.data_ptr() - flat.data_ptr()
    assert offset % 256 == 0
    assert layout.head_entries <= layout.head_size < layout.head_entries + 64
    # the gap before it is zeros, and packing leaves it so: nothing reads it as an index
    pool = MLAConfig(num_heads=H, page_size=1, max_context_len=8).make_pool(8 * max_bs)
    seq = [min(8, 1 + i) for i in range(max_bs)]
    packed = decode_batch(pool, seq, layout=layout).packed
    assert packed is not None
    gap = packed.flat[layout.head_entries:layout.head_size]
    assert gap.numel() == layout.head_size - layout.head_entries
    assert not gap.any()
    assert packed.indices.page_table.data_ptr() - packed.flat.data_ptr() == offset

"""The thin backend (issue 26 item 3): every refusal decided by one ``RequestChecker`` and
raised as one error with every reason; one ``BatchIndices`` for the seven index tensors,
the old attribute and constructor names kept; the backend module the lifecycle only."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from attnreg.registry import UnsupportedError, load_registry  # noqa: E402
from attnreg.runtime import (  # noqa: E402
    ForwardBatch,
    ForwardMetadata,
    GraphState,
    MLAConfig,
    decode_batch,
    extend_batch,
)
from attnreg.runtime.indices import INDEX_FIELDS, BatchIndices  # noqa: E402
from attnreg.runtime.refusals import Refusal, refusal_error  # noqa: E402

BACKEND = Path(__file__).resolve().parents[2] / "src" / "attnreg" / "runtime" / "backend.py"


def _reference(cfg: MLAConfig):
    return load_registry(autoload=False).create("reference", cfg, platform="cpu")


def test_a_forward_wrong_in_several_ways_names_every_reason_at_once() -> None:
    cfg = MLAConfig(num_heads=2)
    backend = _reference(cfg)
    pool = cfg.make_pool(16)
    batch = decode_batch(pool, [3, 5])
    q = torch.randn(3, 2, 576).to(torch.bfloat16)              # 3 rows, the batch has 2
    out = torch.empty(2, 2, 512, dtype=torch.float16)           # not q's dtype
    latent = torch.zeros(2, 100, dtype=torch.bfloat16)          # not 512 wide
    with pytest.raises(UnsupportedError) as info:
        backend.forward_decode(q, latent, torch.zeros(2, 64, dtype=torch.bfloat16), pool,
                               batch, out=out)
    err = info.value
    assert [r.split(":")[0] for r in err.reasons] == ["q tensor", "new KV rows", "out tensor"]
    assert "q has shape (3, 2, 576), expected (2, 2, 576)" in str(err)
    assert "latent_new has shape (2, 100)" in str(err)
    assert "pass out=None" in err.hint and "one latent and one rope row" in err.hint
    # nothing was written or launched: the pool is still zero
    assert not pool.buffer.any()


def test_one_refusal_keeps_its_own_words() -> None:
    one = refusal_error("demo", [Refusal.of("lse tensor", "wrong shape", "pass lse=None")])
    assert str(one) == "demo: unsupported lse tensor: wrong shape. pass lse=None"
    two = refusal_error("demo", [Refusal.of("a", ["x", "y"], "fix a"), Refusal.of("b", "z")])
    assert two.what == "a and b" and two.reasons == ["a: x", "a: y", "b: z"]
    assert two.hint == "fix a"


def test_a_capture_request_names_every_reason() -> None:
    cfg = MLAConfig(num_heads=2)
    backend = load_registry(autoload=False).create("triton", cfg, platform="cpu")
    backend.init_cuda_graph_state(4, 8, graph_modes={"decode": "full"})
    with pytest.raises(UnsupportedError) as info:   # prefill not allocated, and too big
        backend.init_forward_metadata_capture(5, 9, forward_mode="extend")
    whats = info.value.what
    assert "prefill capture" in whats and "captured shape bs=5, num_tokens=9" in whats, whats
    with pytest.raises(UnsupportedError, match="multiple of bs=2"):
        backend.init_forward_metadata_capture(2, 3, forward_mode="target_verify")
    with pytest.raises(UnsupportedError, match="decode capture with num_tokens=3"):
        backend.init_forward_metadata_capture(2, 3)
    assert backend.captured_metadata() == []


def test_the_batch_its_metadata_and_the_graph_buffers_share_one_index_type() -> None:
    cfg = MLAConfig(num_heads=2, page_size=4)
    pool = cfg.make_pool(32)
    batch = extend_batch(pool, [3, 0], [2, 5])
    assert isinstance(batch.indices, BatchIndices)
    assert [name for name, _ in batch.indices.items()] == list(INDEX_FIELDS)
    for name in INDEX_FIELDS:
        assert getattr(batch, name) is getattr(batch.indices, name)
    md = ForwardMetadata.from_batch(batch)
    assert md.indices is batch.indices
    md.seq_lens = md.seq_lens + 1                    # the metadata's own, not the batch's
    assert md.indices is not batch.indices and batch.seq_lens.tolist() == [5, 5]
    # the old keywords still build one (and dataclasses.replace passes them)
    legacy = ForwardBatch(forward_mode=batch.forward_mode,
                          **{n: getattr(batch, n) for n in INDEX_FIELDS},
                          seq_lens_cpu=batch.seq_lens_cpu,
                          prefix_lens_cpu=batch.prefix_lens_cpu,
                          extend_lens_cpu=batch.extend_lens_cpu)
    assert legacy.indices == batch.indices
    changed = dataclasses.replace(batch, prefix_lens=batch.seq_lens)
    assert changed.prefix_lens is batch.seq_lens and changed.kv_indptr is batch.kv_indptr


def test_the_graph_buffers_are_filled_by_one_padded_copy() -> None:
    cfg = MLAConfig(num_heads=2, page_size=16)
    backend = load_registry(autoload=False).create("triton", cfg, platform="cpu")
    backend.init_cuda_graph_state(4, 4, graph_modes={"decode": "full"}, max_seq_len=32)
    state = backend.graph_state
    assert isinstance(state, GraphState) and isinstance(state.indices, BatchIndices)
    backend.init_forward_metadata_capture(4, 4)
    pool = cfg.make_pool(32)
    batch = decode_batch(pool, [6, 9])
    backend.init_forward_metadata_replay(4, 4, batch)
    md = backend.forward_metadata
    assert md is not None and md is state.captured_for(batch.forward_mode, 4, 4)
    assert md.seq_lens.tolist() == [6, 9, 0, 0]
    assert md.kv_indptr.tolist() == [0, 6, 15, 15, 15]
    assert md.qo_indptr.tolist() == [0, 1, 2, 2, 2]
    assert md.out_cache_loc.tolist()[:2] == batch.out_cache_loc.tolist()
    assert md.out_cache_loc.tolist()[2:] == [0, 0]            # the padding slot
    assert md.page_table[2:].eq(0).all()                      # the padding page
    assert backend.captured_metadata() == [md]


def test_the_backend_module_is_the_lifecycle_only() -> None:
    text = BACKEND.read_text()
    assert len(text.splitlines()) <= 400, "refusals, graph bookkeeping and chunked MHA " \
        "have their own modules"
    assert not re.search(r"UnsupportedError\(", text), \
        "every refusal is the RequestChecker's (attnreg.runtime.refusals)"

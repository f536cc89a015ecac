"""TritonMLABackend against the reference, on tiny shapes under the Triton CPU
interpreter (on a GPU machine the same tests run the compiled kernels); graph
metadata capture/replay emulated by re-running under ``capturing()``."""

from __future__ import annotations

import pytest
import torch

from attnreg.backends.declarations.triton_sizing import decode_rounds_q
from attnreg.graph_policy.capture import capturing
from attnreg.registry import ForwardMethod, GraphMode, UnsupportedError, get_registry
from attnreg.runtime import MLAConfig, decode_batch
from attnreg.testing.kv_canary import Canary
from attnreg.testing.workload import round_q

from ._scenarios import FP8_SCALE, make_scenario

H = 2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PLATFORM = None if DEVICE == "cuda" else "cpu"


def declared_q(q: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """The q triton's decode computes with: over an fp8 cache at these heads, rounded to
    fp8 per head row (declared ``q_compute_dtype`` fp8, ``q_compute_scale`` "row")."""
    return round_q(q, "fp8_e4m3", "row") if decode_rounds_q(H, kv_dtype) else q


def backends(cfg: MLAConfig, **options: object):
    reg = get_registry()
    return (reg.create("triton", cfg, platform=PLATFORM, **options),
            reg.create("reference", cfg, platform=PLATFORM))


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float = 2e-2) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert err <= atol, f"max abs error {err} > {atol}"


CASES = [(ps, kv) for ps in (1, 16) for kv in ("bf16", "fp8_e4m3")]


@pytest.mark.parametrize("page_size,kv_dtype", CASES)
@pytest.mark.parametrize("splits", [None, 3], ids=["heuristic", "forced3"])
def test_decode_matches_reference(page_size: int, kv_dtype: str, splits: int | None) -> None:
    cfg = MLAConfig(num_heads=H, page_size=page_size, kv_dtype=kv_dtype, device=DEVICE)
    tri, ref = backends(cfg, force_kv_splits=splits)
    sc = make_scenario(cfg, [0, 9, 70], [1, 1, 1], decode=True, seed=1)
    got = tri.forward_decode(sc.q, sc.latent_new, sc.rope_new, sc.pool, sc.batch)
    want = ref.forward_decode(declared_q(sc.q, kv_dtype), None, None, sc.pool, sc.batch)
    assert_close(got, want)


@pytest.mark.parametrize("page_size,kv_dtype", CASES)
@pytest.mark.parametrize("prefix", [[0, 0], [21, 3]], ids=["no_prefix", "prefix"])
def test_mla_extend_matches_reference(page_size: int, kv_dtype: str, prefix: list[int]) -> None:
    cfg = MLAConfig(num_heads=H, page_size=page_size, kv_dtype=kv_dtype, device=DEVICE)
    tri, ref = backends(cfg)
    sc = make_scenario(cfg, prefix, [5, 11], seed=2)
    got = tri.forward_extend(sc.q, sc.latent_new, sc.rope_new, sc.pool, sc.batch)
    want = ref.forward_extend(sc.q, None, None, sc.pool, sc.batch)
    assert_close(got, want)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("splits", [None, 3], ids=["heuristic", "forced3"])
def test_split_mla_extend_matches_reference(kv_dtype: str, splits: int | None) -> None:
    """A few new tokens over a long prefix: the heuristic (8 "SMs" on cpu, 256-token
    chunks) and a forced count both split the KV; the merged output is the reference's."""
    cfg = MLAConfig(num_heads=H, page_size=16, kv_dtype=kv_dtype, device=DEVICE)
    tri, ref = backends(cfg, force_kv_splits=splits)
    sc = make_scenario(cfg, [600, 90], [3, 2], seed=4)
    tri.init_forward_metadata(sc.batch)
    assert tri.forward_metadata.plan.splits == (splits or 3)
    got = tri.forward_extend(sc.q, sc.latent_new, sc.rope_new, sc.pool, sc.batch)
    want = ref.forward_extend(sc.q, None, None, sc.pool, sc.batch)
    assert_close(got, want)


@pytest.mark.parametrize("prefix", [[0, 0], [17, 2]], ids=["no_prefix", "prefix"])
def test_mha_extend_matches_reference(prefix: list[int]) -> None:
    cfg = MLAConfig(num_heads=H, page_size=16, device=DEVICE)
    tri, ref = backends(cfg)
    sc = make_scenario(cfg, prefix, [6, 4], mha=True, seed=3)
    got = tri.forward_extend(sc.q, None, None, None, sc.batch, method="mha", k=sc.k, v=sc.v)
    want = ref.forward_extend(sc.q, None, None, None, sc.batch, method="mha", k=sc.k, v=sc.v)
    assert got.shape == (10, H, 128)
    assert_close(got, want)


def test_decode_graph_metadata_replays_other_lengths_and_contents() -> None:
    """Capture metadata once for bs=3, then 'replay' (re-run under capturing(FULL), which
    reads only the graph buffers) with smaller and different batches."""
    cfg = MLAConfig(num_heads=H, page_size=16, device=DEVICE, kv_dtype="fp8_e4m3")
    tri, ref = backends(cfg, force_kv_splits=2)
    pool = cfg.make_pool(20, scale=FP8_SCALE)
    canary = Canary.fill(pool)
    tri.init_cuda_graph_state(max_bs=4, max_num_tokens=4, max_seq_len=64)
    tri.init_forward_metadata_capture(3, 3)
    static_q = torch.zeros(3, H, 576, dtype=torch.bfloat16, device=DEVICE)
    static_lat = torch.zeros(3, 512, dtype=torch.bfloat16, device=DEVICE)
    static_rope = torch.zeros(3, 64, dtype=torch.bfloat16, device=DEVICE)
    with capturing(GraphMode.FULL):
        tri.forward_decode(static_q, static_lat, static_rope, pool)
    written: list[int] = []
    for step, (prefix, seed) in enumerate([([5, 40, 1], 4), ([63], 5), ([0, 17], 6)]):
        sc = make_scenario(cfg, prefix, [1] * len(prefix), decode=True, seed=seed, pool=pool)
        b = sc.batch.batch_size
        tri.init_forward_metadata_replay(3, 3, sc.batch)
        static_q.zero_()
        static_q[:b] = sc.q
        static_lat[:b] = sc.latent_new
        static_rope[:b] = sc.rope_new
        with capturing(GraphMode.FULL):
            out = tri.forward_decode(static_q, static_lat, static_rope, pool)
        written += sc.batch.out_cache_loc.tolist()
        for pages_b, p in zip(sc.batch.page_table.tolist(), prefix):
            written += pool.slots(pages_b, range(p))
        want = ref.forward_decode(declared_q(sc.q, "fp8_e4m3"), None, None, pool, sc.batch)
        assert_close(out[:b], want)
        assert torch.count_nonzero(out[b:].float()) == 0, f"step {step}: padded rows not 0"
        assert canary.corrupted_slots(written) == [], f"step {step}: stray KV writes"


def test_extend_graph_metadata_replays_other_lengths() -> None:
    """Breakable prefill: capture metadata for (bs=2, 12 tokens), replay batches of other
    lengths; the new tokens are written through the captured out_cache_loc buffer."""
    cfg = MLAConfig(num_heads=H, page_size=1, device=DEVICE)
    tri, ref = backends(cfg)
    pool = cfg.make_pool(200)
    canary = Canary.fill(pool)
    tri.init_cuda_graph_state(max_bs=2, max_num_tokens=12, max_seq_len=64,
                              graph_modes={"prefill": "breakable"})
    tri.init_forward_metadata_capture(2, 12, forward_mode="extend")
    static_q = torch.zeros(12, H, 576, dtype=torch.bfloat16, device=DEVICE)
    static_lat = torch.zeros(12, 512, dtype=torch.bfloat16, device=DEVICE)
    static_rope = torch.zeros(12, 64, dtype=torch.bfloat16, device=DEVICE)
    written: list[int] = []
    for prefix, extend, seed in [([0, 30], [7, 5], 7), ([44], [12], 8), ([3, 0], [1, 2], 9)]:
        sc = make_scenario(cfg, prefix, extend, seed=seed, pool=pool)
        t = sc.batch.num_tokens
        tri.init_forward_metadata_replay(2, 12, sc.batch)
        static_q[:t] = sc.q
        static_lat[:t] = sc.latent_new
        static_rope[:t] = sc.rope_new
        with capturing(GraphMode.BREAKABLE):
            out = tri.forward_extend(static_q, static_lat, static_rope, pool,
                                     method=ForwardMethod.MLA)
        want = ref.forward_extend(sc.q, None, None, pool, sc.batch)
        assert_close(out[:t], want)
        written += sc.batch.out_cache_loc.tolist()
        for pages_b, p in zip(sc.batch.page_table.tolist(), prefix):
            written += pool.slots(pages_b, range(p))
        assert canary.corrupted_slots(written) == []


def test_split_extend_graph_metadata_replays_longer_prefixes() -> None:
    """Breakable prefill with split-KV: captured on a short batch, replayed with prefixes
    several chunks long; the workspace is a view of the graph state's buffer."""
    cfg = MLAConfig(num_heads=H, page_size=16, device=DEVICE)
    tri, ref = backends(cfg, force_kv_splits=3)
    pool = cfg.make_pool(80)
    canary = Canary.fill(pool)
    tri.init_cuda_graph_state(max_bs=2, max_num_tokens=8, max_seq_len=400,
                              graph_modes={"prefill": "breakable"})
    tri.init_forward_metadata_capture(2, 8, forward_mode="extend")
    md = tri.forward_metadata
    ws = md.plan.workspace
    assert md.plan.splits == 3
    assert ws.partial_out.data_ptr() == tri.graph_state.buffers.extend_partial_out.data_ptr()
    static = [torch.zeros(8, H, d, dtype=torch.bfloat16, device=DEVICE) for d in (576,)] + \
        [torch.zeros(8, d, dtype=torch.bfloat16, device=DEVICE) for d in (512, 64)]
    written: list[int] = []
    for prefix, extend, seed in [([0, 2], [3, 1], 10), ([390], [6], 11), ([150, 70], [2, 6], 12)]:
        sc = make_scenario(cfg, prefix, extend, seed=seed, pool=pool)
        t = sc.batch.num_tokens
        tri.init_forward_metadata_replay(2, 8, sc.batch)
        for buf, src in zip(static, (sc.q, sc.latent_new, sc.rope_new)):
            buf[:t] = src
        with capturing(GraphMode.BREAKABLE):
            out = tri.forward_extend(*static, pool, method=ForwardMethod.MLA)
        assert_close(out[:t], ref.forward_extend(sc.q, None, None, pool, sc.batch))
        written += sc.batch.out_cache_loc.tolist()
        for pages_b, p in zip(sc.batch.page_table.tolist(), prefix):
            written += pool.slots(pages_b, range(p))
        assert canary.corrupted_slots(written) == []


def test_split_extend_capture_takes_the_heuristic_splits_from_the_graph_state() -> None:
    """Without forcing: a graph for few tokens over long sequences gets > 1 split (8 "SMs"
    on cpu, 256-token chunks of max_seq_len 400 -> 2), a large one keeps the one-pass path."""
    cfg = MLAConfig(num_heads=H, page_size=16, device=DEVICE)
    tri, _ = backends(cfg, num_sms=8)
    tri.init_cuda_graph_state(max_bs=2, max_num_tokens=600, max_seq_len=400,
                              graph_modes={"prefill": "breakable"})
    tri.init_forward_metadata_capture(2, 8, forward_mode="extend")
    assert tri.forward_metadata.plan.splits == 2
    ws = tri.forward_metadata.plan.workspace
    assert ws.partial_out.shape == (8, 2, H, 512)
    tri.init_forward_metadata_capture(2, 600, forward_mode="extend")
    assert tri.forward_metadata.plan.splits == 1
    assert tri.forward_metadata.plan.workspace is None


# -- refusals ---------------------------------------------------------------------------

def test_mha_is_refused_under_breakable_capture_where_mla_is_pinned() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16, device=DEVICE)
    tri, _ = backends(cfg)
    sc = make_scenario(cfg, [0], [3], mha=True)
    tri.init_cuda_graph_state(2, 8, max_seq_len=32, graph_modes={"prefill": "breakable"})
    tri.init_forward_metadata_capture(1, 3, sc.batch)
    with capturing(GraphMode.BREAKABLE), \
            pytest.raises(UnsupportedError, match="pins mla under prefill/breakable"):
        tri.forward_extend(sc.q, None, None, None, sc.batch, method="mha", k=sc.k, v=sc.v)


def test_unsupported_page_size_and_query_dtype_are_refused() -> None:
    cfg = MLAConfig(num_heads=H, page_size=8, device=DEVICE)
    # an undeclared page size is refused when the backend is created
    with pytest.raises(UnsupportedError, match=r"page size 8 not in \[1, 16, 32, 64\]"):
        backends(cfg)
    cfg16 = MLAConfig(num_heads=H, page_size=16, device=DEVICE)
    tri16, _ = backends(cfg16)
    sc16 = make_scenario(cfg16, [0], [3], q_dtype=torch.float32)
    with pytest.raises(UnsupportedError, match=r"q dtype fp32 not in \['bf16'\]"):
        tri16.forward_extend(sc16.q, None, None, sc16.pool, sc16.batch)


def test_int64_page_table_is_refused() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16, device=DEVICE)
    tri, _ = backends(cfg)
    sc = make_scenario(cfg, [4], [1], decode=True)
    sc.batch.page_table = sc.batch.page_table.to(torch.int64)
    with pytest.raises(UnsupportedError, match="page_table is torch.int64"):
        tri.forward_decode(sc.q, sc.latent_new, sc.rope_new, sc.pool, sc.batch)


def test_kernel_value_errors_become_unsupported_errors() -> None:
    """A query with a strided last dimension passes the declaration and the base
    checks, but the kernel refuses it before launching: that refusal must surface
    as UnsupportedError.  (A bf16 pool under fp16 queries, used here before, is now
    refused by the declaration itself.)"""
    cfg = MLAConfig(num_heads=H, page_size=16, device=DEVICE)
    tri, _ = backends(cfg)
    sc = make_scenario(cfg, [4], [1], decode=True)
    wide = torch.zeros(*sc.q.shape[:-1], 2 * sc.q.shape[-1], dtype=sc.q.dtype,
                       device=sc.q.device)
    q = wide[..., ::2]
    q.copy_(sc.q)
    with pytest.raises(UnsupportedError, match="last dimension must be contiguous") as info:
        tri.forward_decode(q, None, None, sc.pool, sc.batch)
    assert isinstance(info.value.__cause__, ValueError)


def test_replay_refuses_batches_beyond_the_capture_bounds() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16, device=DEVICE)
    tri, _ = backends(cfg)
    pool = cfg.make_pool(16)
    tri.init_cuda_graph_state(max_bs=2, max_num_tokens=2, max_seq_len=32)
    tri.init_forward_metadata_capture(2, 2)
    with pytest.raises(UnsupportedError, match="exceeds the capture bound max_seq_len=32"):
        tri.init_forward_metadata_replay(2, 2, decode_batch(pool, [40]))
    with pytest.raises(UnsupportedError, match="batch has 3 sequences"):
        tri.init_forward_metadata_replay(2, 2, decode_batch(pool, [1, 1, 1]))
    with pytest.raises(UnsupportedError, match="no graph metadata was captured"):
        tri.init_forward_metadata_replay(1, 1, decode_batch(pool, [1]))
    with pytest.raises(UnsupportedError, match="max_bs=2"):
        tri.init_forward_metadata_capture(4, 4)


def test_backend_options_are_validated() -> None:
    cfg = MLAConfig(num_heads=H, device=DEVICE)
    with pytest.raises(ValueError, match="force_kv_splits must be a positive int"):
        backends(cfg, force_kv_splits=0)

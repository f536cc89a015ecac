"""attnreg backends behind sglang's AttentionBackend, on sglang 0.5.23's real classes.

Every step is a hand-built real sglang ``ForwardBatch`` over a real
``ReqToTokenPool`` and ``MLATokenToKVPool`` (two layers, sglang's own
``set_kv_buffer`` wrote the cached prefixes), run through sglang's own
``AttentionBackend.forward`` dispatch with real ``RadixAttention`` layers,
and compared with attnreg's float64 oracle.  The reference backend runs every
case; the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``)
at tiny shapes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from .conftest import SKIP_REASON

pytest.importorskip("sglang", reason=SKIP_REASON)

from attnreg.backends.declarations.triton_sizing import decode_rounds_q
from attnreg.graph_policy.capture import capturing
from attnreg.integrations.sglang.backend import AttnregAttentionBackend
from attnreg.integrations.sglang.kv_cache import wrap_mla_pool
from attnreg.integrations.sglang.registration import register_attention_backends
from attnreg.registry import DType, GraphMode, UnsupportedError
from attnreg.testing.workload import compare, oracle_mha, oracle_mla, round_q

from ._bridge_env import HEADS, LATENT, SCALE, Step, TinyServer, verify_input

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
#: Triton runs on the GPU where there is one (its cpu declaration needs the interpreter,
#: which the test suite turns on only without a GPU).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

#: name -> (sglang mode, prefix lens, extend lens)
CASES = {
    # a prefix that ends mid-page, one across a page boundary, and none
    "extend_with_prefix": ("EXTEND", [5, 21, 0], [4, 3, 2]),
    # chunked prefill with a decode request mixed in (extend length 1)
    "mixed": ("MIXED", [9, 30], [3, 1]),
    "decode": ("DECODE", [7, 20, 1], [1, 1, 1]),
    "target_verify": ("TARGET_VERIFY", [6, 19], [3, 3]),
}


def make_bridge(server: TinyServer, name: str = "reference") -> AttnregAttentionBackend:
    return AttnregAttentionBackend(
        name, req_to_token_pool=server.req_pool, token_to_kv_pool=server.kv_pool,
        num_heads=HEADS, sm_scale=SCALE, q_dtype=torch.bfloat16,
        kv_scales=[server.layer_scale(i) for i in range(server.num_layers)])


def new_step(server: TinyServer, case: str) -> tuple[Step, list[int]]:
    mode, prefix, extend = CASES[case]
    rows = [server.new_request(p) for p in prefix]
    return server.step(mode, rows, prefix, extend), rows


def run(bridge: AttnregAttentionBackend, server: TinyServer, step: Step) -> list[torch.Tensor]:
    """One model step: plan once, then every layer through sglang's forward dispatch."""
    bridge.init_forward_metadata(step.forward_batch)
    return [bridge.forward(step.q[i], step.k[i], step.k[i][..., :LATENT], server.mqa[i],
                           step.forward_batch)
            for i in range(server.num_layers)]


def check(outs: list[torch.Tensor], server: TinyServer, step: Step, *,
          rounds_q: bool = False) -> None:
    """``rounds_q``: the backend computes with q rounded to fp8 per head row (declared;
    triton's decode-phase steps over an fp8 cache at these heads), so the oracle too."""
    tokens = step.spec.num_tokens
    for i, out in enumerate(outs):
        assert out.shape == (tokens, HEADS * LATENT)
        q = round_q(step.q[i], "fp8_e4m3", "row") if rounds_q else step.q[i]
        expected, _ = oracle_mla(q, step.rows[i], step.spec, LATENT, SCALE)
        problem = compare(out.view(tokens, HEADS, LATENT), expected, DType.BF16, step.spec)
        assert problem is None, f"layer {i}: {problem}"
        # the new rows landed in sglang's own buffer of that layer (the view is zero-copy)
        assert torch.equal(server.read_back(i, step.new_slots),
                           server.stored(step.k[i][:, 0], i))


# ---------------------------------------------------------------------------------------
# the KV pool view
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kv_dtype", "page_size"), [(BF16, 1), (FP8, 16)])
def test_sglang_pool_is_viewed_without_a_copy(kv_dtype: torch.dtype, page_size: int) -> None:
    server = TinyServer(page_size=page_size, kv_dtype=kv_dtype)
    view = wrap_mla_pool(server.kv_pool, scales=[0.5, 0.25])
    pool = view.pool
    assert pool.num_layers == 2 and pool.page_size == page_size
    # sglang's [size + page_size, 1, 576] buffers: one extra page, sglang's padding page 0
    assert pool.num_slots == server.kv_pool.size + page_size
    for i in range(2):
        assert pool.layer(i).buffer.data_ptr() == server.kv_pool.kv_buffer[i].data_ptr()
    if kv_dtype == FP8:
        assert server.kv_pool.kv_buffer[0].dtype == torch.uint8  # sglang's storage
        assert pool.dtype == FP8 and pool.scales == (0.5, 0.25)
    else:
        assert pool.scales == (1.0, 1.0)  # a 16-bit pool has no scale


def test_pool_tail_outside_whole_pages_is_left_out() -> None:
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool(size=40, page_size=16, dtype=BF16, kv_lora_rank=512,
                            qk_rope_head_dim=64, layer_num=1, device="cpu",
                            enable_memory_saver=False)
    view = wrap_mla_pool(pool)
    assert (view.pool.num_pages, view.unpaged_slots) == (3, 8)  # 56 slots: 3 pages + 8
    assert view.pool.buffer.data_ptr() == pool.kv_buffer[0].data_ptr()


# ---------------------------------------------------------------------------------------
# eager steps against the float64 oracle
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("kv_dtype", "page_size"), [(BF16, 16), (FP8, 16), (BF16, 1)],
                         ids=["bf16-p16", "fp8-p16", "bf16-p1"])
def test_reference_backend_in_sglang(case: str, kv_dtype: torch.dtype, page_size: int) -> None:
    server = TinyServer(page_size=page_size, kv_dtype=kv_dtype)
    step, _ = new_step(server, case)
    check(run(make_bridge(server), server, step), server, step)


@pytest.mark.parametrize("case", ["extend_with_prefix", "decode", "target_verify"])
@pytest.mark.parametrize("kv_dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_triton_backend_in_sglang(case: str, kv_dtype: torch.dtype) -> None:
    server = TinyServer(page_size=16, kv_dtype=kv_dtype, seed=1, device=TRITON_DEVICE)
    step, _ = new_step(server, case)
    rounds = case != "extend_with_prefix" and decode_rounds_q(HEADS, kv_dtype)
    check(run(make_bridge(server, "triton"), server, step), server, step, rounds_q=rounds)


def test_a_request_prefills_decodes_and_verifies_through_one_bridge() -> None:
    server = TinyServer(page_size=16, kv_dtype=FP8, seed=2)
    bridge = make_bridge(server)
    prefix, new = [3, 17], [6, 2]
    rows = [server.new_request(p) for p in prefix]
    lens = [p + n for p, n in zip(prefix, new)]
    for mode, extend in (("EXTEND", new), ("DECODE", [1, 1]), ("TARGET_VERIFY", [2, 2])):
        start = prefix if mode == "EXTEND" else lens
        step = server.step(mode, rows, start, extend)
        check(run(bridge, server, step), server, step)
        server.commit(step, rows)
        lens = [s + e for s, e in zip(start, extend)]


def test_split_q_rope_form_and_rows_written_by_the_model() -> None:
    # sglang's other absorbed call form passes q_nope / q_pe and k_nope / k_pe apart; a
    # model that wrote the rows itself calls with save_kv_cache=False
    server = TinyServer(page_size=16, kv_dtype=FP8, seed=4)
    bridge = make_bridge(server)
    step, _ = new_step(server, "extend_with_prefix")
    fb = step.forward_batch
    bridge.init_forward_metadata(fb)
    q, k = step.q[0], step.k[0]
    out0 = bridge.forward(q[..., :LATENT], k[..., :LATENT], k[..., :LATENT], server.mqa[0], fb,
                          q_rope=q[..., LATENT:], k_rope=k[..., LATENT:])
    server._sglang_write(1, step.new_slots, step.k[1][:, 0])
    out1 = bridge.forward(step.q[1], step.k[1], step.k[1][..., :LATENT], server.mqa[1], fb,
                          save_kv_cache=False)
    check([out0, out1], server, step)


def test_mha_companion_runs_attnregs_ragged_mha() -> None:
    # sglang's DeepSeek runs a prefill without prefix as MHA over decompressed k / v
    # (attn_mha, save_kv_cache=False): attnreg's MHA method over the same rows.
    server = TinyServer(page_size=16)
    bridge = make_bridge(server)
    step, _ = new_step(server, "extend_with_prefix")
    fb = step.forward_batch
    fb.extend_prefix_lens_cpu = [0, 0, 0]
    fb.extend_prefix_lens = torch.zeros(3, dtype=torch.long)
    spec = type(step.spec)("sglang_mha", step.spec.phase, ((0, 4), (0, 3), (0, 2)), "mha")
    bridge.init_forward_metadata(fb)
    q, k, v = (server.randn(9, HEADS, d) for d in (192, 192, 128))
    out = bridge.forward(q, k, v, server.mha[1], fb, save_kv_cache=False)
    expected, _ = oracle_mha(q, k, v, spec, SCALE)
    assert out.shape == (9, HEADS * 128)
    assert compare(out.view(9, HEADS, 128), expected, DType.BF16, spec) is None


# ---------------------------------------------------------------------------------------
# sglang's decode graph runner hooks, driven without a device graph
# ---------------------------------------------------------------------------------------
def capture_batch(mode: str, bs: int, per_req: int, fill: int, device: str = "cpu") -> object:
    """What sglang's decode runner hands the backend before capturing ``bs``: its static
    buffers, every sequence a padding one (row 0 of req_to_token, the fill length)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    tokens = bs * per_req
    seq = torch.full((bs,), fill, dtype=torch.long)
    return ForwardBatch(
        forward_mode=ForwardMode[mode], batch_size=bs,
        input_ids=torch.zeros(tokens, dtype=torch.long, device=device),
        req_pool_indices=torch.zeros(bs, dtype=torch.long, device=device),
        seq_lens=seq.to(device), seq_lens_cpu=seq,
        out_cache_loc=torch.zeros(tokens, dtype=torch.long, device=device),
        seq_lens_sum=int(seq.sum()),
        spec_info=verify_input(per_req) if mode == "TARGET_VERIFY" else None)


def replay_view(step: Step, bs: int, fill: int) -> object:
    """The replay view sglang's decode runner hands the backend (``build_replay_fb_view``,
    whose module does not import in the cpu set: it needs einops and openai): the real
    batch's per-step fields over the static buffers padded to ``bs`` (padding sequences:
    req_to_token row 0, the fill length), ``num_padding`` = ``bs`` - real sequences."""
    fb = step.forward_batch
    raw = fb.batch_size
    seq = torch.full((bs,), fill, dtype=torch.long)
    seq[:raw] = fb.seq_lens_cpu
    indices = torch.zeros(bs, dtype=torch.long, device=fb.req_pool_indices.device)
    indices[:raw] = fb.req_pool_indices
    return SimpleNamespace(
        batch_size=bs, forward_mode=fb.forward_mode, actual_forward_mode=fb.forward_mode,
        req_pool_indices=indices, seq_lens=seq.to(indices.device), seq_lens_cpu=seq,
        seq_lens_sum=fb.seq_lens_sum + (bs - raw) * fill, num_padding=bs - raw,
        out_cache_loc=fb.out_cache_loc, spec_info=fb.spec_info)


@pytest.mark.parametrize(("mode", "per_req"), [("DECODE", 1), ("TARGET_VERIFY", 3)])
def test_capture_then_replay_a_smaller_batch(mode: str, per_req: int) -> None:
    server = TinyServer(page_size=16, seed=3, device=TRITON_DEVICE)
    bridge = make_bridge(server, "triton")
    fill = bridge.get_cuda_graph_seq_len_fill_value()
    max_bs = 4
    bridge.init_cuda_graph_state(max_bs, max_bs * per_req)
    rows_max = max_bs * per_req
    # the static inputs and outputs a captured graph records
    q = [torch.zeros(rows_max, HEADS, 576, dtype=BF16, device=TRITON_DEVICE) for _ in range(2)]
    k = [torch.zeros(rows_max, 1, 576, dtype=BF16, device=TRITON_DEVICE) for _ in range(2)]
    out: list[torch.Tensor] = [torch.empty(0)] * 2

    def model_step(n: int, fb: object) -> None:
        for i in range(2):
            out[i] = bridge.forward(q[i][:n], k[i][:n], k[i][:n, :, :LATENT], server.mqa[i], fb)

    captured = {}
    for bs in (max_bs, 2):  # largest first, as sglang captures
        fb = capture_batch(mode, bs, per_req, fill, device=TRITON_DEVICE)
        bridge.init_forward_metadata_out_graph(fb, in_capture=True)
        model_step(bs * per_req, fb)  # sglang's warm-up run, outside the capture
        with capturing(GraphMode.FULL):
            model_step(bs * per_req, fb)
        captured[bs] = fb
    fills = bridge.attnreg.graph_state.fills
    before = dict(fills)
    # a real batch of 3 sequences replays through the bs=4 graph (one padding sequence)
    prefix = [5, 18, 40]
    rows = [server.new_request(p) for p in prefix]
    step = server.step(mode, rows, prefix, [per_req] * 3)
    bridge.init_forward_metadata_out_graph(replay_view(step, max_bs, fill))
    n = step.spec.num_tokens
    for i in range(2):
        q[i].zero_()
        k[i].zero_()
        q[i][:n] = step.q[i]
        k[i][:n] = step.k[i]
    with capturing(GraphMode.FULL):  # a cpu "replay" re-runs what the graph recorded
        model_step(max_bs * per_req, captured[max_bs])
    check([o[:n].reshape(n, -1) for o in out], server, step)
    for o in out:  # the padding sequence's rows
        assert not o[n:].any()
    # a data-parallel rank with nothing to do replays the same graph: all padding
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    idle = replay_view(step, max_bs, fill)
    idle.actual_forward_mode = ForwardMode.IDLE
    bridge.init_forward_metadata_out_graph(idle)
    with capturing(GraphMode.FULL):
        model_step(max_bs * per_req, captured[max_bs])
    assert not any(o.any() for o in out)
    # each replay's batch was packed into the graph's own index buffer: nothing copied
    assert fills["in_place"] - before["in_place"] == 2
    assert (fills["padded"], fills["packed"]) == (before["padded"], before["packed"])


@pytest.mark.gpu
@pytest.mark.parametrize(("mode", "per_req"), [("DECODE", 1), ("TARGET_VERIFY", 3)])
def test_cuda_graphs_of_the_bridge_on_a_gpu(mode: str, per_req: int) -> None:
    """The decode runner's order on a GPU: metadata before each capture (largest first),
    a warm-up on a side stream, real CUDA graphs recorded with host syncs forbidden, then
    a smaller real batch replayed through the largest graph.  attnreg's GraphRunner records
    (the project's one capture path); sglang's own runner records the same calls."""
    import importlib.util

    if importlib.util.find_spec("sgl_kernel") is None:
        # docs/integrations/sglang.md, "The bridge's GPU test": a stand-in would be
        # imported by the KV pool this test measures through, so it is not honest.
        pytest.skip("sglang 0.5.23's mem_cache.memory_pool imports sgl_kernel at module "
                    "level, and no sgl_kernel build exists for this torch: the test runs "
                    "only where sglang's own GPU install does")
    from attnreg.runtime import GraphRunner

    server = TinyServer(page_size=16, seed=5, device="cuda")
    bridge = make_bridge(server, "triton")
    fill = bridge.get_cuda_graph_seq_len_fill_value()
    max_bs = 4
    bridge.init_cuda_graph_state(max_bs, max_bs * per_req)
    rows_max = max_bs * per_req
    q = [torch.zeros(rows_max, HEADS, 576, dtype=BF16, device="cuda") for _ in range(2)]
    k = [torch.zeros(rows_max, 1, 576, dtype=BF16, device="cuda") for _ in range(2)]
    outs: dict[int, list[torch.Tensor]] = {}

    def model_step(bs: int, fb: object) -> None:
        n = bs * per_req
        outs[bs] = [bridge.forward(q[i][:n], k[i][:n], k[i][:n, :, :LATENT], server.mqa[i],
                                   fb) for i in range(2)]

    runner = GraphRunner("cuda", forbid_sync=True)
    for bs in (max_bs, 2):
        fb = capture_batch(mode, bs, per_req, fill, device="cuda")
        bridge.init_forward_metadata_out_graph(fb, in_capture=True)
        runner.capture(lambda bs=bs, fb=fb: model_step(bs, fb), GraphMode.FULL, key=bs)
    prefix = [5, 18, 40]
    rows = [server.new_request(p) for p in prefix]
    step = server.step(mode, rows, prefix, [per_req] * 3)
    bridge.init_forward_metadata_out_graph(replay_view(step, max_bs, fill))
    n = step.spec.num_tokens
    for i in range(2):
        q[i].zero_()
        k[i].zero_()
        q[i][:n] = step.q[i]
        k[i][:n] = step.k[i]
    runner[max_bs].replay()
    torch.cuda.synchronize()
    check([o[:n].reshape(n, -1) for o in outs[max_bs]], server, step)
    assert not any(o[n:].any() for o in outs[max_bs])


# ---------------------------------------------------------------------------------------
# refusals: one clear error before any kernel runs
# ---------------------------------------------------------------------------------------
def test_page_size_outside_the_declaration_is_refused_at_startup() -> None:
    with pytest.raises(UnsupportedError, match="page size 8"):
        make_bridge(TinyServer(page_size=8))


def test_fp8_e5m2_pool_is_refused() -> None:
    with pytest.raises(UnsupportedError, match="attnreg declares bf16, fp16 and fp8_e4m3"):
        make_bridge(TinyServer(kv_dtype=torch.float8_e5m2))


def test_reference_refuses_decode_graphs() -> None:
    bridge = make_bridge(TinyServer())
    with pytest.raises(UnsupportedError, match="host-side lengths"):
        bridge.init_cuda_graph_state(4, 4)


def test_tree_verification_is_refused() -> None:
    server = TinyServer()
    step, _ = new_step(server, "target_verify")
    step.forward_batch.spec_info = verify_input(3, topk=2)
    with pytest.raises(UnsupportedError, match="tree verification"):
        make_bridge(server).init_forward_metadata(step.forward_batch)


def test_draft_extend_is_refused() -> None:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    server = TinyServer()
    step, _ = new_step(server, "decode")
    step.forward_batch.forward_mode = ForwardMode.DRAFT_EXTEND_V2
    with pytest.raises(UnsupportedError, match="draft model's extend batch"):
        make_bridge(server).init_forward_metadata(step.forward_batch)


def test_layer_features_outside_attnreg_are_refused() -> None:
    server = TinyServer()
    bridge = make_bridge(server)
    step, _ = new_step(server, "decode")
    bridge.init_forward_metadata(step.forward_batch)
    args = (step.q[0], step.k[0], step.k[0][..., :LATENT])
    with pytest.raises(UnsupportedError, match="sinks"):
        bridge.forward(*args, server.mqa[0], step.forward_batch, sinks=torch.zeros(HEADS))
    server.mqa[1].logit_cap = 30.0
    with pytest.raises(UnsupportedError, match="logit soft-capping"):
        bridge.forward(*args, server.mqa[1], step.forward_batch)


def test_idle_batches_return_no_rows() -> None:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    server = TinyServer()
    bridge = make_bridge(server)
    step, _ = new_step(server, "decode")
    step.forward_batch.forward_mode = ForwardMode.IDLE
    bridge.init_forward_metadata(step.forward_batch)
    q = torch.zeros(0, HEADS, 576, dtype=BF16)
    assert bridge.forward(q, None, None, server.mqa[0], step.forward_batch).shape == (0, 1024)


# ---------------------------------------------------------------------------------------
# registration with sglang
# ---------------------------------------------------------------------------------------
def test_registered_names_are_sglang_attention_backends() -> None:
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    names = register_attention_backends(["reference", "triton"])
    assert names == ["attnreg_reference", "attnreg_triton"]
    for name in names:
        assert name in ATTENTION_BACKENDS and name in ATTENTION_BACKEND_CHOICES
    # sglang's factory call: ATTENTION_BACKENDS[name](model_runner)
    server = TinyServer(kv_dtype=FP8)
    model = torch.nn.ModuleList([torch.nn.ModuleList([a, b])
                                 for a, b in zip(server.mqa, server.mha)])
    runner = SimpleNamespace(
        use_mla_backend=True, kv_index_translator=None, model=model, dtype=BF16,
        model_config=SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64,
                                     qk_nope_head_dim=128, v_head_dim=128),
        req_to_token_pool=server.req_pool, token_to_kv_pool=server.kv_pool)
    backend = ATTENTION_BACKENDS["attnreg_reference"](runner)
    assert isinstance(backend, AttnregAttentionBackend)
    cfg = backend.config
    assert (cfg.num_heads, cfg.softmax_scale, cfg.page_size) == (HEADS, SCALE, 16)
    assert backend.kv_cache.pool.scales == (0.5, 0.25)  # the layers' k_scale
    with pytest.raises(Exception, match="no_such_backend"):
        register_attention_backends(["no_such_backend"])


def test_plugin_makes_attnreg_names_resolvable(plugin_on: None, models: dict) -> None:
    """With the plugin on, sglang's own resolution accepts ``--attention-backend
    attnreg_<name>`` and attnreg's policy reads the exact declaration of what will run."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from attnreg.integrations.sglang.steps import outcome_of

    from . import _sglang_env

    assert {"attnreg_triton", "attnreg_reference"} <= set(ATTENTION_BACKENDS)
    for name, modes in (("attnreg_triton", ("breakable", "full")),
                        ("attnreg_reference", ("disabled", "disabled"))):
        scenario = _sglang_env.Scenario(name, "deepseek-v3", 90, {"attention_backend": name})
        result = _sglang_env.run_scenario(scenario, models)
        assert "error" not in result, result
        assert result["backends"] == [name, name]
        assert (result["prefill"], result["decode"]) == modes
        outcome = outcome_of(result["server_args"])
        assert outcome is not None and outcome.plan is not None
        assert all(m.exact for m in outcome.facts.backends.values())
        if name == "attnreg_reference":  # no graphs, for the declared reason
            assert "backend.capture_unsupported" in outcome.rule_ids
    # split backends: each is built for (and checked against) its own phase only
    from attnreg.integrations.sglang.backend import _phases_served
    from attnreg.registry import Phase

    split = _sglang_env.Scenario("split", "deepseek-v3", 90,
                                 {"prefill_attention_backend": "attnreg_triton",
                                  "decode_attention_backend": "attnreg_reference"})
    result = _sglang_env.run_scenario(split, models)
    assert "error" not in result, result
    runner = SimpleNamespace(server_args=result["server_args"])
    assert _phases_served(runner, "attnreg_triton") == (Phase.PREFILL,)
    assert _phases_served(runner, "attnreg_reference") == (Phase.DECODE,)

"""The reference backend against naive attention written independently here
(per query and head python loops, explicit softmax), plus the refusals every
backend inherits from the base class."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

from attnreg.graph_policy.capture import break_handler, capturing, eager_break
from attnreg.registry import ForwardMethod, GraphMode, UnsupportedError, get_registry
from attnreg.runtime import MLAConfig, decode_batch, extend_batch

from ._scenarios import FP8_SCALE, Scenario, make_scenario

H = 2


def stored(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """What a pool of ``kv_dtype`` holds for ``x``, back in float32 (independent of the pool)."""
    if kv_dtype == "fp8_e4m3":
        return (x.float() / FP8_SCALE).clamp(-448, 448).to(torch.float8_e4m3fn).float() \
            * FP8_SCALE
    return x.to({"bf16": torch.bfloat16, "fp16": torch.float16}[kv_dtype]).float()


def naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    prefix: int, scale: float) -> torch.Tensor:
    """q [E, H, D], keys [L, H or 1, D], values [L, H or 1, Dv]; query i sees keys 0..prefix+i."""
    e, heads = q.shape[0], q.shape[1]
    out = torch.zeros(e, heads, values.shape[-1])
    for i in range(e):
        for h in range(heads):
            kh = min(h, keys.shape[1] - 1)
            visible = prefix + i + 1
            logits = [float((q[i, h].double() * keys[j, kh].double()).sum()) * scale
                      for j in range(visible)]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            acc = torch.zeros(values.shape[-1], dtype=torch.float64)
            for j, w in enumerate(weights):
                acc += (w / total) * values[j, kh].double()
            out[i, h] = acc.float()
    return out


def naive_mla(sc: Scenario, prefix_lens: list[int]) -> torch.Tensor:
    kv_dtype = sc.cfg.kv_dtype.value
    outs, row = [], 0
    for lat, rope, p in zip(sc.seq_latent, sc.seq_rope, prefix_lens):
        e = lat.shape[0] - p
        keys = torch.cat([stored(lat, kv_dtype), stored(rope, kv_dtype)], dim=-1)[:, None]
        outs.append(naive_attention(sc.q[row:row + e].float(), keys, keys[..., :512], p,
                                    sc.cfg.softmax_scale))
        row += e
    return torch.cat(outs)


def reference(cfg: MLAConfig):
    return get_registry().create("reference", cfg, platform="cpu")


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float = 1.5e-2) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert err <= atol, f"max abs error {err} > {atol}"


CASES = [(ps, kv) for ps in (1, 16) for kv in ("bf16", "fp8_e4m3")]


@pytest.mark.parametrize("page_size,kv_dtype", CASES)
def test_decode_matches_naive_softmax(page_size: int, kv_dtype: str) -> None:
    cfg = MLAConfig(num_heads=H, page_size=page_size, kv_dtype=kv_dtype)
    prefix = [0, 4, 19]
    sc = make_scenario(cfg, prefix, [1, 1, 1], decode=True, seed=1)
    out = reference(cfg).forward_decode(sc.q, sc.latent_new, sc.rope_new, sc.pool, sc.batch)
    assert out.shape == (3, H, 512) and out.dtype == torch.bfloat16
    assert_close(out, naive_mla(sc, prefix))


@pytest.mark.parametrize("page_size,kv_dtype", CASES)
@pytest.mark.parametrize("prefix", [[0, 0], [5, 17]], ids=["no_prefix", "prefix"])
def test_mla_extend_matches_naive_softmax(page_size: int, kv_dtype: str,
                                          prefix: list[int]) -> None:
    cfg = MLAConfig(num_heads=H, page_size=page_size, kv_dtype=kv_dtype)
    sc = make_scenario(cfg, prefix, [6, 3], seed=2)
    out = reference(cfg).forward_extend(sc.q, sc.latent_new, sc.rope_new, sc.pool, sc.batch,
                                        method=ForwardMethod.MLA)
    assert out.shape == (9, H, 512)
    assert_close(out, naive_mla(sc, prefix))


@pytest.mark.parametrize("prefix", [[0, 0], [4, 11]], ids=["no_prefix", "prefix"])
def test_mha_ragged_extend_matches_naive_softmax(prefix: list[int]) -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    extend = [5, 2]
    sc = make_scenario(cfg, prefix, extend, mha=True, seed=3)
    out = reference(cfg).forward_extend(sc.q, None, None, None, sc.batch,
                                        method=ForwardMethod.MHA, k=sc.k, v=sc.v)
    assert out.shape == (7, H, 128)
    assert sc.k is not None and sc.v is not None
    want, row, kv = [], 0, 0
    for p, e in zip(prefix, extend):
        want.append(naive_attention(sc.q[row:row + e].float(), sc.k[kv:kv + p + e].float(),
                                    sc.v[kv:kv + p + e].float(), p, cfg.softmax_scale))
        row, kv = row + e, kv + p + e
    assert_close(out, torch.cat(want))


def test_mha_extend_also_writes_the_new_tokens_to_the_pool() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    sc = make_scenario(cfg, [3], [4], mha=True, seed=4)
    reference(cfg).forward_extend(sc.q, sc.latent_new, sc.rope_new, sc.pool, sc.batch,
                                  method="mha", k=sc.k, v=sc.v)
    rows = sc.pool.read_slots(sc.batch.out_cache_loc)
    assert torch.equal(rows[:, :512], sc.latent_new.float())
    assert torch.equal(rows[:, 512:], sc.rope_new.float())


def test_decode_written_token_is_attended_and_stays_in_the_pool() -> None:
    """Extend then decode: the decode step sees the prompt written by the extend."""
    cfg = MLAConfig(num_heads=H, page_size=16)
    backend = reference(cfg)
    sc = make_scenario(cfg, [0], [9], seed=5)
    backend.forward_extend(sc.q, sc.latent_new, sc.rope_new, sc.pool, sc.batch)
    owned = [int(p) for p in sc.batch.page_table[0].tolist()]
    step = decode_batch(sc.pool, [10], pages=[owned])
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, H, 576, generator=gen).bfloat16()
    lat = torch.randn(1, 512, generator=gen).bfloat16()
    rope = torch.randn(1, 64, generator=gen).bfloat16()
    out = backend.forward_decode(q, lat, rope, sc.pool, step)
    keys = torch.cat([torch.cat([sc.latent_new, lat]), torch.cat([sc.rope_new, rope])],
                     dim=-1).float()[:, None]
    assert_close(out, naive_attention(q.float(), keys, keys[..., :512], 9, cfg.softmax_scale))


def test_forward_plans_a_new_batch_without_explicit_init() -> None:
    cfg = MLAConfig(num_heads=H, page_size=1)
    backend = reference(cfg)
    first = make_scenario(cfg, [0], [3], seed=7)
    backend.forward_extend(first.q, first.latent_new, first.rope_new, first.pool, first.batch)
    second = make_scenario(cfg, [2], [5], seed=8)
    out = backend.forward_extend(second.q, second.latent_new, second.rope_new, second.pool,
                                 second.batch)
    assert backend.forward_metadata is not None
    assert backend.forward_metadata.batch is second.batch
    assert_close(out, naive_mla(second, [2]))


# -- refusals (base-class validation, exercised through the reference) ------------------

def test_reference_refuses_cuda_graph_state() -> None:
    backend = reference(MLAConfig(num_heads=H))
    with pytest.raises(UnsupportedError, match="host-side lengths"):
        backend.init_cuda_graph_state(4, 4)
    with pytest.raises(UnsupportedError, match="decode under full graph capture"):
        backend.init_cuda_graph_state(4, 4, graph_modes={"decode": "full"})


@pytest.mark.parametrize("mode", [GraphMode.FULL, GraphMode.BREAKABLE])
def test_reference_refuses_forward_under_attention_capture(mode: GraphMode) -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    sc = make_scenario(cfg, [0], [3], seed=9)
    backend = reference(cfg)
    backend.init_forward_metadata(sc.batch)
    with capturing(mode), pytest.raises(UnsupportedError, match="unsupported"):
        backend.forward_extend(sc.q, sc.latent_new, sc.rope_new, sc.pool)
    with capturing(mode), pytest.raises(UnsupportedError, match="under graph capture"):
        backend.init_forward_metadata(sc.batch)


def test_reference_runs_under_tc_piecewise_and_inside_eager_breaks() -> None:
    """Declared native under TC_PIECEWISE (attention runs eagerly between pieces), and
    an eager_break region of a breakable capture counts as eager."""
    cfg = MLAConfig(num_heads=H, page_size=16)
    sc = make_scenario(cfg, [2], [3], seed=10)
    backend = reference(cfg)
    with capturing(GraphMode.TC_PIECEWISE):
        out = backend.forward_extend(sc.q, sc.latent_new, sc.rope_new, sc.pool, sc.batch)
    assert_close(out, naive_mla(sc, [2]))
    with capturing(GraphMode.BREAKABLE), \
            break_handler(lambda label: contextlib.nullcontext()), eager_break("attention"):
        again = backend.forward_extend(sc.q, None, None, sc.pool, sc.batch)
    assert torch.equal(out, again)
    # Without a handler nothing splits the graph: the region is captured, so refused.
    with capturing(GraphMode.BREAKABLE), eager_break("attention"), \
            pytest.raises(UnsupportedError, match="breakable"):
        backend.forward_extend(sc.q, None, None, sc.pool, sc.batch)


def test_unsupported_page_size_is_refused_before_any_work() -> None:
    cfg = MLAConfig(num_heads=H, page_size=8)
    sc = make_scenario(cfg, [0], [3], seed=11)
    before = sc.pool.buffer.clone()
    with pytest.raises(UnsupportedError, match=r"page size 8 not in \[1, 16, 32, 64\]"):
        reference(cfg).forward_extend(sc.q, sc.latent_new, sc.rope_new, sc.pool, sc.batch)
    assert torch.equal(sc.pool.buffer, before), "a refused request must not write the pool"


def test_int64_index_tensors_are_refused() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    sc = make_scenario(cfg, [0, 2], [3, 1], seed=12)
    sc.batch.page_table = sc.batch.page_table.long()
    with pytest.raises(UnsupportedError, match="page_table is torch.int64; index tensors must "
                                               "be int32"):
        reference(cfg).init_forward_metadata(sc.batch)


def test_absorbed_tensors_handed_to_mha_are_refused() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    sc = make_scenario(cfg, [0], [3], seed=13)
    q576 = sc.q
    kv576 = torch.zeros(3, H, 576, dtype=torch.bfloat16)
    v512 = torch.zeros(3, H, 512, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match=r"head dims \(576, 512\) not in"):
        reference(cfg).forward_extend(q576, None, None, None, sc.batch, method="mha",
                                      k=kv576, v=v512)


def test_mha_q_given_to_mla_and_undeclared_method_are_refused() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    sc = make_scenario(cfg, [0], [3], mha=True, seed=14)
    backend = reference(cfg)
    with pytest.raises(UnsupportedError, match=r"head dims \(192, 512\)"):
        backend.forward_extend(sc.q, None, None, sc.pool, sc.batch, method="mla")
    caps = backend.capabilities
    no_chunked = dataclasses.replace(caps, kernels=tuple(
        k for k in caps.kernels if k.method is not ForwardMethod.MHA_CHUNKED_KV))
    with pytest.raises(UnsupportedError, match="no mha_chunked_kv kernel"):
        type(backend)(cfg, capabilities=no_chunked).forward_extend(
            sc.q, None, None, None, sc.batch, method="mha_chunked_kv", k=sc.k, v=sc.v)


def test_wrong_shapes_and_mismatched_pool_are_refused() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    sc = make_scenario(cfg, [0, 1], [3, 2], seed=15)
    backend = reference(cfg)
    with pytest.raises(UnsupportedError, match=r"q has shape \(4, 2, 576\), expected "
                                               r"\(5, 2, 576\)"):
        backend.forward_extend(sc.q[:4], None, None, sc.pool, sc.batch)
    with pytest.raises(UnsupportedError, match="latent_new has shape"):
        backend.forward_extend(sc.q, sc.latent_new[:2], sc.rope_new, sc.pool, sc.batch)
    other = MLAConfig(num_heads=H, page_size=1).make_pool(64)
    with pytest.raises(UnsupportedError, match="pool page size 1 != config page size 16"):
        backend.forward_extend(sc.q, None, None, other, sc.batch)
    with pytest.raises(UnsupportedError, match=r"expected \(5, 4, 576\)"):
        reference(MLAConfig(num_heads=4, page_size=16)).forward_extend(
            sc.q, None, None, sc.pool, sc.batch)
    many = torch.zeros(5, 129, 576, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match=r"129 heads not in 1..128"):
        reference(MLAConfig(num_heads=129, page_size=16)).forward_extend(
            many, None, None, sc.pool, sc.batch)


def test_decode_and_extend_calls_must_match_the_batch() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    ext = make_scenario(cfg, [0], [3], seed=16)
    backend = reference(cfg)
    with pytest.raises(UnsupportedError, match="forward_decode on an extend batch"):
        backend.forward_decode(ext.q, None, None, ext.pool, ext.batch)


def test_unknown_backend_option_is_an_error() -> None:
    with pytest.raises(TypeError, match="unknown options"):
        get_registry().create("reference", MLAConfig(num_heads=H), platform="cpu",
                              max_kv_splitz=2)


def test_extend_batch_prefix_positions_come_after_the_prefix() -> None:
    cfg = MLAConfig(num_heads=H, page_size=4)
    pool = cfg.make_pool(16)
    batch = extend_batch(pool, [3, 0], [2, 5])
    assert batch.seq_lens_cpu == (5, 5) and batch.num_tokens == 7
    assert batch.qo_indptr.tolist() == [0, 2, 7] and batch.kv_indptr.tolist() == [0, 5, 10]
    table = batch.page_table.tolist()
    assert batch.out_cache_loc.tolist()[:2] == [table[0][0] * 4 + 3, table[0][1] * 4 + 0]

"""FlashInferMLABackend on a CPU machine, against a fake flashinfer that computes what
the real one would from the arguments it is given (tests/backends_lib/fakes.py).

Pins down the argument plumbing the GPU cannot show in isolation: page indices
of shuffled pages, the 0.6 positional / 0.7 keyword plan forms, the padding of
captured shapes (which keeps the launch grid of a graph fixed), and refusals."""

from __future__ import annotations

import pytest
import torch

from attnreg.graph_policy.capture import capturing
from attnreg.registry import ForwardMethod, GraphMode, UnsupportedError, load_registry
from attnreg.runtime import GraphRunner, MLAConfig

from ._cases import assert_close, expected, make_case, make_pool
from .fakes import install_fake_flashinfer


@pytest.fixture(scope="module")
def reg():
    return load_registry(autoload=False)


def backend(reg, cfg: MLAConfig, versions=None, **options: object):
    from attnreg.backends.flashinfer_mla import FlashInferMLABackend

    caps = reg.declaration("flashinfer_mla", "cuda:sm90", versions)
    return FlashInferMLABackend(cfg, capabilities=caps, **options)


@pytest.mark.parametrize("version", ["0.6", "0.7"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_and_extend_match_reference(reg, monkeypatch, version: str,
                                           page_size: int) -> None:
    calls = install_fake_flashinfer(monkeypatch, version=version)
    cfg = MLAConfig(num_heads=4, page_size=page_size)
    fi = backend(reg, cfg)
    assert fi.kernels.plan_style == ("metadata" if version == "0.7" else "positional")
    pool = make_pool(cfg, 600)
    dec = make_case(cfg, pool, [0, 40, 77], [1, 1, 1], decode=True, seed=1)
    got = fi.forward_decode(dec.q, dec.latent_new, dec.rope_new, pool, dec.batch)
    assert_close(got, expected(cfg, dec), what="decode")
    ext = make_case(cfg, pool, [0, 33], [9, 20], seed=2)
    got = fi.forward_extend(ext.q, ext.latent_new, ext.rope_new, pool, ext.batch)
    assert_close(got, expected(cfg, ext), what="extend")
    assert [p["causal"] for p in calls.mla_plans] == [False, True]
    assert all(not p["graph"] for p in calls.mla_plans)


def test_one_plan_per_batch_for_all_layers(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=16)
    fi = backend(reg, cfg)
    pool = make_pool(cfg, 200)
    case = make_case(cfg, pool, [5, 60], [1, 1], decode=True)
    fi.init_forward_metadata(case.batch)
    for _layer in range(3):
        fi.forward_decode(case.q, None, None, pool, case.batch)
    assert len(calls.mla_plans) == 1 and len(calls.mla_runs) == 3


def test_mha_ragged_prefill_with_prefix_matches_reference(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=16)
    fi = backend(reg, cfg)
    pool = make_pool(cfg, 200)
    case = make_case(cfg, pool, [0, 21], [7, 5], mha=True, seed=3)
    got = fi.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch,
                            method=ForwardMethod.MHA, k=case.k, v=case.v)
    assert_close(got, expected(cfg, case, ForwardMethod.MHA), what="mha")
    assert [(p["causal"], p["head_dims"]) for p in calls.ragged_plans] == [(True, (192, 128))]


def _capture_and_replay(fi, cfg, pool, *, decode: bool, bs: int, num_tokens: int,
                        first, replays, zero_stale_inputs: bool = True):
    """Graph use on the CPU through the GraphRunner (no device graph: capture runs the
    step once under capturing(), each replay runs it again after the metadata replay).

    ``zero_stale_inputs=False`` leaves the rows of earlier, larger batches in the static
    inputs, as an engine does: only the batch's own rows are rewritten.
    """
    mode = GraphMode.FULL if decode else GraphMode.BREAKABLE
    phase = "decode" if decode else "prefill"
    fi.init_cuda_graph_state(bs, num_tokens, max_seq_len=512, graph_modes={phase: mode})
    rows = bs if decode else num_tokens
    q = torch.zeros(rows, cfg.num_heads, cfg.kv_row_dim, dtype=torch.bfloat16)
    lat = torch.zeros(num_tokens, cfg.kv_lora_rank, dtype=torch.bfloat16)
    rope = torch.zeros(num_tokens, cfg.qk_rope_head_dim, dtype=torch.bfloat16)
    out = torch.zeros(rows, cfg.num_heads, cfg.kv_lora_rank, dtype=torch.bfloat16)

    def step():
        if decode:
            fi.forward_decode(q, lat, rope, pool, out=out)
        else:
            fi.forward_extend(q, lat, rope, pool, method=ForwardMethod.MLA, out=out)

    def load(case):
        t = case.batch.num_tokens
        if zero_stale_inputs:
            q.zero_(), lat.zero_(), rope.zero_()
        q[: case.q.shape[0]].copy_(case.q)
        lat[:t].copy_(case.latent_new)
        rope[:t].copy_(case.rope_new)

    runner = GraphRunner("cpu")
    fi.init_forward_metadata_capture(bs, num_tokens, first.batch)
    load(first)
    graph = runner.capture(step, mode)
    results = [(first, out[: first.q.shape[0]].clone(), out.clone())]
    for case in replays:
        fi.init_forward_metadata_replay(bs, num_tokens, case.batch)
        load(case)
        out.fill_(float("nan"))
        graph.replay()
        results.append((case, out[: case.q.shape[0]].clone(), out.clone()))
    return [(case, got) for case, got, _ in results], [whole for _, _, whole in results]


def test_captured_decode_keeps_its_grid_for_smaller_batches(reg, monkeypatch) -> None:
    """128 heads: a plan over the real sequences alone would switch from 2-CTA to
    1-CTA clusters when fewer than half the captured slots are used, and the
    graph would replay the new schedule on the captured grid."""
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=128, page_size=16)
    fi = backend(reg, cfg)
    pool = make_pool(cfg, 2000)
    first = make_case(cfg, pool, [10, 20, 30, 40, 50, 60, 70, 80], [1] * 8, decode=True)
    replays = [make_case(cfg, pool, [300], [1], decode=True, seed=5),
               make_case(cfg, pool, [3, 150, 9], [1, 1, 1], decode=True, seed=6)]
    pairs, _ = _capture_and_replay(fi, cfg, pool, decode=True, bs=8, num_tokens=8,
                                   first=first, replays=replays)
    for case, got in pairs:
        assert_close(got, expected(cfg, case), what=f"replay {case.batch.seq_lens_cpu}")
    graph_plans = [p for p in calls.mla_plans if p["graph"]]
    assert len(graph_plans) == 3
    assert {p["grid"] for p in graph_plans} == {(2, 66)}
    # decode pads with one-row requests that attend no key (no filler request): 8 of each
    assert all(p["requests"] == 8 and p["rows"] == 8 for p in graph_plans)
    assert [p["kv_lens"] for p in graph_plans[1:]] == [[301] + [0] * 7, [4, 151, 10] + [0] * 5]
    assert len({id(p["wrapper"]) for p in graph_plans}) == 1


def test_captured_extend_replays_other_lengths_and_prefixes(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=4, page_size=16)
    fi = backend(reg, cfg)
    pool = make_pool(cfg, 2000)
    first = make_case(cfg, pool, [0, 0, 0], [20, 20, 24], seed=7)
    replays = [make_case(cfg, pool, [100, 7], [30, 2], seed=8),
               make_case(cfg, pool, [250], [1], seed=9),
               make_case(cfg, pool, [0, 5, 17], [10, 30, 24], seed=10)]
    pairs, _ = _capture_and_replay(fi, cfg, pool, decode=False, bs=3, num_tokens=64,
                                   first=first, replays=replays)
    for case, got in pairs:
        assert_close(got, expected(cfg, case), what=f"replay {case.batch.seq_lens_cpu}")
    graph_plans = [p for p in calls.mla_plans if p["graph"]]
    assert all(p["rows"] == 64 and p["requests"] == 4 and p["causal"] for p in graph_plans)
    assert len({p["grid"] for p in graph_plans}) == 1


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "extend"])
def test_padded_replays_give_zero_rows_for_the_missing_sequences(reg, monkeypatch,
                                                                 decode: bool) -> None:
    """The issue's case (16 heads, page size 1, a graph for 8 sequences replaying 3) at cpu
    sizes: after the replay the padding rows must be exactly zero, as docs/runtime.md
    promises.  Extend: the filler request that keeps the launch grid fixed computes them
    over the padding page, and without the zeroing they are not zero (checked below, so
    this can fail).  Decode: each padding sequence is a request of one row and no key,
    which the kernel writes as zeros itself (the fake as the real one, measured on the
    H200), so the zeroing launch is not run at all."""
    install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=16, page_size=1)
    fi = backend(reg, cfg)
    pool = make_pool(cfg, 3000)
    # the padding page holds whatever earlier padded writes left there
    pool.buffer[0].copy_(torch.randn(pool.buffer[0].shape, generator=torch.Generator()
                                     .manual_seed(0)).to(pool.buffer.dtype))
    if decode:
        bs, nt = 8, 8
        first = make_case(cfg, pool, [40 + i for i in range(8)], [1] * 8, decode=True, seed=1)
        small = make_case(cfg, pool, [330, 50, 2], [1, 1, 1], decode=True, seed=2)
    else:
        bs, nt = 4, 24
        first = make_case(cfg, pool, [10, 20, 30, 5], [6, 6, 6, 6], seed=1)
        small = make_case(cfg, pool, [300, 7], [3, 2], seed=2)
    rows = small.q.shape[0]

    pairs, wholes = _capture_and_replay(fi, cfg, pool, decode=decode, bs=bs, num_tokens=nt,
                                        first=first, replays=[small], zero_stale_inputs=False)
    assert_close(pairs[1][1], expected(cfg, small), what="the real rows")
    padding = wholes[1][rows:].float()
    assert padding.shape[0] == (bs if decode else nt) - rows
    assert torch.count_nonzero(padding) == 0, "padding rows must be exactly zero"

    zeroings: list[int] = []
    monkeypatch.setattr(type(fi), "zero_padded_rows",
                        lambda self, out, md: zeroings.append(out.shape[0]))
    fi2 = backend(reg, cfg)
    _, unzeroed = _capture_and_replay(fi2, cfg, pool, decode=decode, bs=bs, num_tokens=nt,
                                      first=first, replays=[small], zero_stale_inputs=False)
    if decode:
        assert zeroings == [] and torch.count_nonzero(unzeroed[1][rows:].float()) == 0, \
            "decode's padding requests attend no key: zero rows with no zeroing launch"
    else:
        assert zeroings and \
            torch.count_nonzero(unzeroed[1][rows:].float().nan_to_num(1.0)) > 0, \
            "without the zeroing the filler's rows are not zero: the check above means something"


def test_graph_refuses_a_forward_dtype_it_was_not_planned_for(reg, monkeypatch) -> None:
    install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=16, q_dtype="bf16", kv_dtype="bf16")
    fi = backend(reg, cfg)
    pool = cfg.make_pool(64)
    fi.init_cuda_graph_state(2, 2, max_seq_len=64, graph_modes={"decode": "full"})
    fi.init_forward_metadata_capture(2, 2)
    q = torch.zeros(2, 2, 576, dtype=torch.float16)
    fp16_pool = MLAConfig(num_heads=2, page_size=16, kv_dtype="fp16").make_pool(64)
    with capturing(GraphMode.FULL), pytest.raises(UnsupportedError, match="planned for"):
        fi.forward_decode(q, None, None, fp16_pool)
    assert pool.buffer.abs().sum() == 0


def test_fp8_pool_is_refused_on_flashinfer_0_6(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch, version="0.6")
    cfg = MLAConfig(num_heads=2, page_size=16, kv_dtype="fp8_e4m3")
    fi = backend(reg, cfg, versions={"flashinfer-python": "0.6.13"})
    pool = make_pool(cfg, 100)
    case = make_case(cfg, pool, [10], [1], decode=True)
    with pytest.raises(UnsupportedError, match="fp8"):
        fi.forward_decode(case.q, case.latent_new, case.rope_new, pool, case.batch)
    assert calls.mla_plans == [] and calls.mla_runs == []


def test_fp8_pool_runs_with_kv_scales_on_flashinfer_0_7(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch, version="0.7")
    cfg = MLAConfig(num_heads=2, page_size=16, kv_dtype="fp8_e4m3")
    fi = backend(reg, cfg, versions={"flashinfer-python": "0.7.0"})
    pool = make_pool(cfg, 100)
    case = make_case(cfg, pool, [10, 50], [1, 1], decode=True)
    got = fi.forward_decode(case.q, case.latent_new, case.rope_new, pool, case.batch)
    assert_close(got, expected(cfg, case), what="fp8 decode")
    assert calls.mla_runs[-1]["ckv_scale"] == pytest.approx(pool.scale)
    assert calls.mla_plans[-1]["kv_dtype"] == torch.float8_e4m3fn


def test_fp8_with_the_fa2_kernel_is_refused_even_on_0_7(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch, version="0.7")
    cfg = MLAConfig(num_heads=2, page_size=16, kv_dtype="fp8_e4m3")
    fi = backend(reg, cfg, versions={"flashinfer-python": "0.7.0"}, mla_backend="fa2")
    pool = make_pool(cfg, 100)
    case = make_case(cfg, pool, [10], [1], decode=True)
    with pytest.raises(UnsupportedError, match="fa3"):
        fi.forward_decode(case.q, case.latent_new, case.rope_new, pool, case.batch)
    assert calls.mla_runs == []


def test_unknown_mla_backend_option_is_an_error(reg, monkeypatch) -> None:
    install_fake_flashinfer(monkeypatch)
    with pytest.raises(ValueError, match="mla_backend"):
        backend(reg, MLAConfig(num_heads=2), mla_backend="fa9")


def _fake_jit(monkeypatch, fail: str = "") -> list[tuple]:
    """A fake ``flashinfer.jit.attention`` whose specs record what was built."""
    import sys
    import types

    built: list[tuple] = []

    class Spec:
        def __init__(self, *key: object) -> None:
            self.key, self.name = key, "_".join(map(str, key))

        def build(self, verbose: bool) -> None:
            if fail and fail in self.name:
                raise RuntimeError("nvcc failed")
            built.append(self.key)

    attention = types.ModuleType("flashinfer.jit.attention")
    attention.gen_batch_mla_module = lambda kernel, dt, *rest: Spec("mla", kernel, dt)
    attention.gen_batch_prefill_module = (
        lambda kernel, dt, _kv, _o, _idx, qk, vo, *rest: Spec("ragged", kernel, dt, qk, vo))
    for name, mod in (("flashinfer", types.ModuleType("flashinfer")),
                      ("flashinfer.jit", types.ModuleType("flashinfer.jit")),
                      ("flashinfer.jit.attention", attention)):
        monkeypatch.setitem(sys.modules, name, mod)
    return built


def test_warm_jit_cache_builds_the_variants_auto_picks(monkeypatch) -> None:
    from attnreg.backends.flashinfer_mla import warm_jit_cache

    built = _fake_jit(monkeypatch)
    result = warm_jit_cache(90)
    bf16, fp16 = torch.bfloat16, torch.float16
    assert sorted(map(str, built)) == sorted(map(str, [
        ("mla", "fa3", bf16), ("mla", "fa3", fp16), ("mla", "fa2", bf16),
        ("ragged", "fa3", bf16, 192, 128), ("ragged", "fa3", fp16, 192, 128),
        ("ragged", "fa3", bf16, 128, 128)]))
    assert set(result.values()) == {"ok"}
    built.clear()
    warm_jit_cache(100, mha=())
    assert sorted(map(str, built)) == sorted(map(str, [("mla", "fa2", bf16),
                                                       ("mla", "fa2", fp16)]))


def test_warm_jit_cache_reports_a_failed_build_instead_of_raising(monkeypatch) -> None:
    from attnreg.backends.flashinfer_mla import warm_jit_cache

    _fake_jit(monkeypatch, fail="ragged")
    result = warm_jit_cache(90)
    failed = {k: v for k, v in result.items() if v != "ok"}
    assert len(failed) == 3 and all("nvcc failed" in v for v in failed.values())


def test_warm_jit_cache_without_flashinfer_says_so(monkeypatch) -> None:
    import sys

    from attnreg.backends.flashinfer_mla import warm_jit_cache

    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert "not importable" in warm_jit_cache(90)["flashinfer.jit.attention"]

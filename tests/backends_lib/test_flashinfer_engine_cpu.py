"""flashinfer_mla's engine contract on a CPU machine, against the fake flashinfer:
speculative batches (the MLA wrapper planned causal over several tokens per request,
eagerly and in FULL decode graphs), LSE outputs (base 2 in the library, natural
logs out), chunked-prefix MHA (a ragged wrapper per prefix chunk, causal=False,
planned once for every layer), and layers."""

from __future__ import annotations

import pytest
import torch

from attnreg.registry import GraphMode, load_registry
from attnreg.runtime import (
    GraphRunner,
    MLAConfig,
    decode_batch,
    draft_extend_batch,
    extend_batch,
    verify_batch,
)

from .fakes import install_fake_flashinfer

H = 4


@pytest.fixture(scope="module")
def reg():
    return load_registry(autoload=False)


def make(reg, cfg):  # type: ignore[no-untyped-def]
    from attnreg.backends.flashinfer_mla import FlashInferMLABackend

    return FlashInferMLABackend(cfg, capabilities=reg.declaration("flashinfer_mla", "cuda:sm90"))


def filled_pool(cfg, pages, layers=1, seed=0):  # type: ignore[no-untyped-def]
    pool = cfg.make_pool(pages, num_layers=layers)
    g = torch.Generator().manual_seed(seed)
    for layer in pool.layers:
        layer.buffer.copy_(torch.randn(layer.buffer.shape, generator=g).bfloat16())
    return pool


@pytest.mark.parametrize("version", ["0.6", "0.7"])
def test_verify_and_draft_extend_plan_causal_over_several_tokens(reg, monkeypatch,
                                                                 version: str) -> None:
    calls = install_fake_flashinfer(monkeypatch, version=version)
    cfg = MLAConfig(num_heads=H, page_size=16)
    fi, ref = make(reg, cfg), reg.create("reference", cfg)
    pool = filled_pool(cfg, 30)
    for batch in (verify_batch(pool, [0, 40, 17], 4), draft_extend_batch(pool, [9, 3], [3, 1])):
        q = torch.randn(batch.num_tokens, H, 576).bfloat16()
        got, lse = fi.forward_extend(q, None, None, pool, batch, return_lse=True)
        want, want_lse = ref.forward_extend(q, None, None, pool, batch, return_lse=True)
        assert torch.allclose(got.float(), want.float(), atol=2e-2)
        assert torch.allclose(lse, want_lse, atol=1e-3), "natural-log LSE"
    plans = calls.mla_plans
    assert [p["causal"] for p in plans] == [True, True]
    assert [p["rows"] for p in plans] == [12, 4]
    assert all(r["lse"] for r in calls.mla_runs)


def test_decode_lse_is_converted_when_the_library_cannot(reg, monkeypatch) -> None:
    install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=H, page_size=16)
    fi, ref = make(reg, cfg), reg.create("reference", cfg)
    fi.kernels.run_lse_base_e = False          # an older run() without return_lse_base_on_e
    pool = filled_pool(cfg, 10)
    step = decode_batch(pool, [30, 5])
    q = torch.randn(2, H, 576).bfloat16()
    _, lse = fi.forward_decode(q, None, None, pool, step, return_lse=True)
    _, want = ref.forward_decode(q, None, None, pool, step, return_lse=True)
    assert torch.allclose(lse, want, atol=1e-3)


def test_verify_graphs_are_captured_per_forward_mode_and_replay(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=H, page_size=16, max_context_len=256)
    fi, ref = make(reg, cfg), reg.create("reference", cfg)
    pool = filled_pool(cfg, 40, layers=2)
    bs, q_len = 3, 2
    fi.init_cuda_graph_state(bs, bs * q_len, max_seq_len=256, graph_modes={"decode": "full"})
    q = torch.zeros(bs * q_len, H, 576, dtype=torch.bfloat16)
    outs = [torch.zeros(bs * q_len, H, 512, dtype=torch.bfloat16) for _ in range(2)]
    runner = GraphRunner("cpu")

    def verify() -> None:
        for i in range(2):
            fi.forward_extend(q, None, None, pool, None, layer_id=i, out=outs[i])

    fi.init_forward_metadata_capture(bs, bs * q_len, forward_mode="target_verify")
    runner.capture(verify, GraphMode.FULL, key="verify")
    fi.init_forward_metadata_capture(bs, bs, forward_mode="decode")
    graph_wrappers = [p["wrapper"] for p in calls.mla_plans if p["graph"]]
    assert len(set(map(id, graph_wrappers))) == 2, "one graph wrapper per forward mode"
    batch = verify_batch(pool, [100, 7], q_len)
    q[:4] = torch.randn(4, H, 576)
    fi.init_forward_metadata_replay(bs, bs * q_len, batch)
    runner["verify"].replay()
    for i in range(2):
        want = ref.forward_extend(q[:4], None, None, pool, batch, layer_id=i)
        assert torch.allclose(outs[i][:4].float(), want.float(), atol=2e-2)
        assert bool((outs[i][4:] == 0).all()), "the filler request's rows are zeroed"
    replans = [p for p in calls.mla_plans if p["graph"] and p["causal"]]
    assert replans[-1]["requests"] == bs + 1 and replans[-1]["rows"] == bs * q_len


def test_chunked_prefix_plans_each_chunk_once_for_every_layer(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=H, page_size=16)
    fi, ref = make(reg, cfg), reg.create("reference", cfg)
    pool = filled_pool(cfg, 20, layers=2)
    batch = extend_batch(pool, [20, 9], [3, 2])
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(5, H, 192, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(5, H, 128, generator=g).bfloat16()
    w = torch.randn(576, H * 320, generator=g) / 24

    def decompress(latent, rope):  # type: ignore[no-untyped-def]
        x = torch.cat([latent, rope], -1).float() @ w
        return (x[:, :H * 192].reshape(-1, H, 192).bfloat16(),
                x[:, H * 192:].reshape(-1, H, 128).bfloat16())

    fi.init_forward_metadata(batch)
    results = [fi.forward_extend(q, None, None, pool, batch, method="mha_chunked_kv", k=k, v=v,
                                 decompress=decompress, chunk_tokens=8, return_lse=True,
                                 layer_id=i) for i in range(2)]
    ref.init_forward_metadata(batch)
    for i, (out, lse) in enumerate(results):
        want, want_lse = ref.forward_extend(q, None, None, pool, batch, method="mha_chunked_kv",
                                            k=k, v=v, decompress=decompress, chunk_tokens=8,
                                            return_lse=True, layer_id=i)
        assert torch.allclose(out.float(), want.float(), atol=2e-2)
        assert torch.allclose(lse, want_lse, atol=1e-3)
    # new tokens (causal) + 3 prefix chunks (20 = 8 + 8 + 4), planned once for both layers
    assert [p["causal"] for p in calls.ragged_plans] == [True, False, False, False]
    assert [p["kv_lens"] for p in calls.ragged_plans[1:]] == [[8, 8], [8, 1], [4, 0]]

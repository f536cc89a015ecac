"""The engine contract on a GPU, with real CUDA graphs: a model step of several layers
captured once for decode and once for target verify (one graph state), replayed for
other batches; LSE outputs and chunked-prefix MHA against the reference.  Run for each
of triton and flashinfer_mla that is available (the conformance suite with
``--device cuda`` proves the same claims per declared configuration)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attnreg.registry import GraphMode, get_registry  # noqa: E402
from attnreg.runtime import (  # noqa: E402
    GraphRunner,
    MLAConfig,
    decode_batch,
    extend_batch,
    verify_batch,
)

pytestmark = pytest.mark.gpu

H, LAYERS, DRAFTS, MAX_BS, CONTEXT = 16, 3, 4, 8, 2048


def _backend(name: str, cfg: MLAConfig):  # type: ignore[no-untyped-def]
    reg = get_registry()
    avail = reg.availability(name)
    if not avail.available:
        pytest.skip(f"{name}: {avail.reason}")
    return reg.create(name, cfg)


def _pool(cfg: MLAConfig, seed: int = 0):  # type: ignore[no-untyped-def]
    pool = cfg.make_pool(MAX_BS * (CONTEXT // cfg.page_size) + 2, num_layers=LAYERS)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for layer in pool.layers:
        layer.buffer.copy_(torch.randn(layer.buffer.shape, generator=g, device="cuda")
                           .to(layer.buffer.dtype))
    return pool


@pytest.mark.parametrize("name", ["triton", "flashinfer_mla"])
def test_decode_and_verify_graphs_of_a_multi_layer_step_replay_other_batches(name: str) -> None:
    cfg = MLAConfig(num_heads=H, page_size=64, device="cuda", max_context_len=CONTEXT)
    backend = _backend(name, cfg)
    reference = get_registry().create("reference", cfg)
    pool = _pool(cfg)
    rows = MAX_BS * DRAFTS
    q = [torch.zeros(rows, H, 576, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    out = [torch.zeros(rows, H, 512, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    backend.init_cuda_graph_state(MAX_BS, rows, max_seq_len=CONTEXT,
                                  graph_modes={"decode": "full"})
    runner = GraphRunner("cuda")

    def step(n: int, forward) -> None:  # type: ignore[no-untyped-def]
        for i in range(LAYERS):
            forward(q[i][:n], None, None, pool, None, layer_id=i, out=out[i][:n])

    backend.init_forward_metadata_capture(MAX_BS, rows, forward_mode="target_verify")
    runner.capture(lambda: step(rows, backend.forward_extend), GraphMode.FULL, key="verify")
    backend.init_forward_metadata_capture(MAX_BS, MAX_BS, forward_mode="decode")
    runner.capture(lambda: step(MAX_BS, backend.forward_decode), GraphMode.FULL, key="decode")
    pages = pool.allocate([CONTEXT] * MAX_BS, shuffle=3)
    g = torch.Generator(device="cuda").manual_seed(1)
    for prefixes in ([1900, 5, 700], [64, 1000, 3, 2000, 17, 129, 512, 1]):
        n_seq = len(prefixes)
        for mode in ("verify", "decode"):
            batch = verify_batch(pool, prefixes, DRAFTS, pages=pages[:n_seq]) \
                if mode == "verify" else decode_batch(pool, [p + 1 for p in prefixes],
                                                      pages=pages[:n_seq])
            n = batch.num_tokens
            for i in range(LAYERS):
                q[i][:n] = torch.randn(n, H, 576, generator=g, device="cuda")
                out[i].fill_(float("nan"))
            backend.init_forward_metadata_replay(MAX_BS, rows if mode == "verify" else MAX_BS,
                                                 batch)
            runner[mode].replay()
            torch.cuda.synchronize()
            for i in range(LAYERS):
                want = reference.forward(q[i][:n], None, None, pool, batch, layer_id=i)
                assert torch.allclose(out[i][:n].float(), want.float(), atol=2e-2), \
                    (mode, prefixes, i)
                padded = rows if mode == "verify" else MAX_BS
                assert bool((out[i][n:padded] == 0).all()), "padding rows are zero"


@pytest.mark.parametrize("name", ["triton", "flashinfer_mla"])
def test_lse_and_chunked_prefix_mha_match_the_reference(name: str) -> None:
    cfg = MLAConfig(num_heads=H, page_size=64, device="cuda", max_context_len=CONTEXT)
    backend = _backend(name, cfg)
    reference = get_registry().create("reference", cfg)
    pool = _pool(cfg, seed=2)
    g = torch.Generator(device="cuda").manual_seed(3)
    step = decode_batch(pool, [1500, 3, 700])
    qd = torch.randn(3, H, 576, generator=g, device="cuda").bfloat16()
    _, lse = backend.forward_decode(qd, None, None, pool, step, layer_id=2, return_lse=True)
    _, want = reference.forward_decode(qd, None, None, pool, step, layer_id=2, return_lse=True)
    assert torch.allclose(lse, want, atol=2e-3)
    batch = extend_batch(pool, [1000, 0, 300], [40, 7, 3])
    t = batch.num_tokens
    q, k = (torch.randn(t, H, 192, generator=g, device="cuda").bfloat16() for _ in range(2))
    v = torch.randn(t, H, 128, generator=g, device="cuda").bfloat16()
    w = torch.randn(576, H * 320, generator=g, device="cuda") / 24

    def decompress(latent, rope):  # type: ignore[no-untyped-def]
        x = torch.cat([latent, rope], -1).float() @ w
        return (x[:, :H * 192].reshape(-1, H, 192).bfloat16(),
                x[:, H * 192:].reshape(-1, H, 128).bfloat16())

    kwargs = dict(method="mha_chunked_kv", k=k, v=v, decompress=decompress, chunk_tokens=256,
                  return_lse=True, layer_id=1)
    out, lse = backend.forward_extend(q, None, None, pool, batch, **kwargs)
    want, want_lse = reference.forward_extend(q, None, None, pool, batch, **kwargs)
    assert torch.allclose(out.float(), want.float(), atol=2e-2)
    assert torch.allclose(lse, want_lse, atol=2e-3)

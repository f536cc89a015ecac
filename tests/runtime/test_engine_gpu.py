"""The engine contract on a GPU, with real CUDA graphs: a step of several layers captured
by one GraphSession for decode and for target verify (one graph state), replayed for
other batches; LSE outputs and chunked-prefix MHA against the reference.  Run for each
of triton and flashinfer_mla that is available (the conformance suite with
``--device cuda`` proves the same claims per declared configuration)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attnreg.registry import get_registry  # noqa: E402
from attnreg.runtime import (  # noqa: E402
    GraphSession,
    MLAConfig,
    StepInputs,
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
    # one session: decode and verify graphs of one bucket over one graph state
    session = GraphSession(backend, pool, phase="decode", mode="full", buckets=[MAX_BS],
                           layers=LAYERS, writes_kv=False, max_seq_len=CONTEXT,
                           forward_modes={"decode": 1, "target_verify": DRAFTS})
    session.capture()
    assert all(g.device_graphs for g in (session.graph(k) for k in session.keys))
    pages = pool.allocate([CONTEXT] * MAX_BS, shuffle=3)
    g = torch.Generator(device="cuda").manual_seed(1)
    for prefixes in ([1900, 5, 700], [64, 1000, 3, 2000, 17, 129, 512, 1]):
        n_seq = len(prefixes)
        for mode in ("verify", "decode"):
            batch = verify_batch(pool, prefixes, DRAFTS, pages=pages[:n_seq]) \
                if mode == "verify" else decode_batch(pool, [p + 1 for p in prefixes],
                                                      pages=pages[:n_seq])
            n = batch.num_tokens
            inputs = StepInputs([torch.randn(n, H, 576, generator=g, device="cuda").bfloat16()
                                 for _ in range(LAYERS)])
            for out in session.statics.outs:
                out.fill_(float("nan"))
            res = session.run(batch, inputs)
            torch.cuda.synchronize()
            assert res.replayed and res.bucket == MAX_BS, res.reason
            padded = MAX_BS * (DRAFTS if mode == "verify" else 1)
            for i in range(LAYERS):
                want = reference.forward(inputs.q[i], None, None, pool, batch, layer_id=i)
                assert torch.allclose(res.outputs[i].float(), want.float(), atol=2e-2), \
                    (mode, prefixes, i)
                assert bool((session.statics.outs[i][n:padded] == 0).all()), \
                    "padding rows are zero"
    assert session.counts.replays == 4 and session.counts.eager_runs == 0


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

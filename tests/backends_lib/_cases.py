"""Inputs for the kernel-library backend tests: a pool with prefixes written, a
batch of new tokens over it, random queries, and the reference to compare with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnreg.backends.reference import ReferenceBackend, causal_attention, gather_sequence
from attnreg.registry import ForwardMethod, ForwardMode, get_registry
from attnreg.runtime import ForwardBatch, MLAConfig, MLAKVPool, decode_batch, extend_batch

#: fp8 pools use this scale, so unit-scale inputs use much of the e4m3 range.
FP8_SCALE = 0.02


@dataclass
class Case:
    pool: MLAKVPool
    batch: ForwardBatch
    q: torch.Tensor                 # MLA [rows, H, 576]; MHA [T, H, 192]
    latent_new: torch.Tensor        # [T, 512]
    rope_new: torch.Tensor          # [T, 64]
    k: torch.Tensor | None = None   # MHA [Tk, H, 192]
    v: torch.Tensor | None = None   # MHA [Tk, H, 128]


def make_pool(cfg: MLAConfig, tokens: int) -> MLAKVPool:
    """A pool with room for ``tokens`` tokens of whole pages, plus slack."""
    pages = tokens // cfg.page_size + 64
    scale = FP8_SCALE if cfg.kv_dtype.value == "fp8_e4m3" else 1.0
    return cfg.make_pool(pages, scale=scale)


def make_case(cfg: MLAConfig, pool: MLAKVPool, prefix_lens: list[int],
              extend_lens: list[int], *, decode: bool = False, mha: bool = False,
              seed: int = 0, forward_mode: ForwardMode = ForwardMode.EXTEND) -> Case:
    """Write random prefixes into ``pool`` and build a batch of new tokens after them
    (``forward_mode`` for a non-decode batch: EXTEND, TARGET_VERIFY, DRAFT_EXTEND).

    Query dtype is ``cfg.q_dtype``; pages are taken from the pool in shuffled order,
    so a backend that assumes contiguous pages is caught.
    """
    gen = torch.Generator().manual_seed(seed)
    dev, q_dtype = cfg.device, _torch_dtype(cfg)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=q_dtype, device=dev)

    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages = pool.allocate(seq_lens, shuffle=seed + 1)
    for owned, p in zip(pages, prefix_lens):
        if p:
            slots = torch.tensor(pool.slots(owned, range(p)), dtype=torch.int32, device=dev)
            pool.write(slots, rand(p, cfg.kv_lora_rank), rand(p, cfg.qk_rope_head_dim))
    if decode:
        batch = decode_batch(pool, seq_lens, pages=pages)
    else:
        batch = extend_batch(pool, prefix_lens, extend_lens, pages=pages,
                             forward_mode=forward_mode)
    t, h = batch.num_tokens, cfg.num_heads
    latent, rope = rand(t, cfg.kv_lora_rank), rand(t, cfg.qk_rope_head_dim)
    if mha:
        qk, dv = cfg.mha_head_dims
        return Case(pool, batch, rand(t, h, qk), latent, rope,
                    rand(batch.num_kv_tokens, h, qk), rand(batch.num_kv_tokens, h, dv))
    return Case(pool, batch, rand(t, h, cfg.kv_row_dim), latent, rope)


def _torch_dtype(cfg: MLAConfig) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        cfg.q_dtype.value]


def reference(cfg: MLAConfig) -> ReferenceBackend:
    caps = get_registry().declaration("reference", "cpu")
    return ReferenceBackend(cfg, capabilities=caps)


def expected(cfg: MLAConfig, case: Case, method: ForwardMethod | None = None) -> torch.Tensor:
    """The reference output for ``case`` (its new tokens must already be in the pool).

    The reference backend's own functions serve page sizes its declaration
    does not list (128, for flash-attn-4's TMA pages).
    """
    caps = get_registry().declaration("reference", "cpu")
    if (method or ForwardMethod.MLA) is ForwardMethod.MLA and caps.check_request(
            "mla", "prefill", page_size=cfg.page_size):
        return _expected_mla(cfg, case)  # the reference refuses that page size when created
    ref = reference(cfg)
    if case.batch.is_decode:
        return ref.forward_decode(case.q, None, None, case.pool, case.batch)
    return ref.forward_extend(case.q, None, None, case.pool, case.batch,
                              method=method or ForwardMethod.MLA, k=case.k, v=case.v)


def _expected_mla(cfg: MLAConfig, case: Case) -> torch.Tensor:
    b, latent = case.batch, cfg.kv_lora_rank
    out, row = [], 0
    for i, (length, extend) in enumerate(zip(b.seq_lens_cpu, b.extend_lens_cpu)):
        kv = gather_sequence(case.pool, b.page_table[i], length)[:, None, :]
        out.append(causal_attention(case.q[row:row + extend], kv, kv[:, :, :latent],
                                    cfg.softmax_scale))
        row += extend
    return torch.cat(out).to(case.q.dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor, *, atol: float = 2e-2,
                 rtol: float = 2e-2, what: str = "") -> None:
    """Elementwise ``|got - want| <= atol + rtol * |want|`` with the worst offender named."""
    got, want = got.float().cpu(), want.float().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    excess = (got - want).abs() - (atol + rtol * want.abs())
    worst = excess.max().item()
    assert worst <= 0, (f"{what}: max |got - want| exceeds tolerance by {worst:.3g} "
                        f"(max abs error {(got - want).abs().max().item():.3g})")

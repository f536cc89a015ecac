"""Shared pieces of the built-in declarations."""

from __future__ import annotations

from attnreg.registry import DType, ForwardMode, ForwardModeSupport, Requirement

MLA_DIMS = ((576, 512),)
MHA_DIMS = ((192, 128), (128, 128))
HALF = frozenset({DType.BF16, DType.FP16})
HALF_AND_FP8 = frozenset({DType.BF16, DType.FP16, DType.FP8_E4M3})

# Requirements of the built-in backends (listed in their BackendSpec, builtin.py).
TORCH = Requirement("torch", "torch", "2.4", extra="torch")
TRITON = Requirement("triton", "triton", "3.2", extra="triton")
FLASHINFER = Requirement("flashinfer", "flashinfer-python", "0.6.13", extra="flashinfer")
FLASH_ATTN_CUTE = Requirement("flash_attn.cute", "flash-attn-4", extra="flash-attn-cute")

#: Draft tokens per sequence the built-in backends declare for speculative batches
#: (TARGET_VERIFY, DRAFT_EXTEND): MTP / EAGLE chains of up to 8 drafts.
MAX_DRAFT_TOKENS = 8

#: What a decode-phase graph (or the eager path) of a built-in backend that
#: implements speculative decoding serves: one-token decode, target-verify batches
#: of up to MAX_DRAFT_TOKENS tokens per sequence (uniform: every sequence verifies
#: the same number), draft-extend batches of 1..MAX_DRAFT_TOKENS accepted tokens.
SPECULATIVE_DECODE_MODES = (
    ForwardModeSupport(ForwardMode.DECODE, 1, True),
    ForwardModeSupport(ForwardMode.TARGET_VERIFY, MAX_DRAFT_TOKENS, True),
    ForwardModeSupport(ForwardMode.DRAFT_EXTEND, MAX_DRAFT_TOKENS, False),
)
#: The eager forward modes of such a backend: the above and ragged extend.
SPECULATIVE_EAGER_MODES = SPECULATIVE_DECODE_MODES + (
    ForwardModeSupport(ForwardMode.EXTEND, None, False),)

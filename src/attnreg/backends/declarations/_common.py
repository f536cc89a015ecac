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
def speculative_modes(max_draft_tokens: int
                      ) -> tuple[tuple[ForwardModeSupport, ...], tuple[ForwardModeSupport, ...]]:
    """(decode-phase graph modes, eager modes) of a backend serving up to
    ``max_draft_tokens`` drafts: see SPECULATIVE_DECODE_MODES / SPECULATIVE_EAGER_MODES."""
    decode = (
        ForwardModeSupport(ForwardMode.DECODE, 1, True),
        ForwardModeSupport(ForwardMode.TARGET_VERIFY, max_draft_tokens, True),
        ForwardModeSupport(ForwardMode.DRAFT_EXTEND, max_draft_tokens, False),
    )
    return decode, decode + (ForwardModeSupport(ForwardMode.EXTEND, None, False),)


#: ...and SPECULATIVE_EAGER_MODES, the eager forward modes of such a backend: the
#: above and ragged extend.
SPECULATIVE_DECODE_MODES, SPECULATIVE_EAGER_MODES = speculative_modes(MAX_DRAFT_TOKENS)

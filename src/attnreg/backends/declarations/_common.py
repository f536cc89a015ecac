"""Shared pieces of the built-in declarations."""

from __future__ import annotations

from attnreg.registry import DType, Requirement

MLA_DIMS = ((576, 512),)
MHA_DIMS = ((192, 128), (128, 128))
HALF = frozenset({DType.BF16, DType.FP16})
HALF_AND_FP8 = frozenset({DType.BF16, DType.FP16, DType.FP8_E4M3})

TORCH = Requirement("torch", "torch", "torch", "2.4")
TRITON = Requirement("triton", "triton", "triton", "3.2")
FLASHINFER = Requirement("flashinfer", "flashinfer-python", "flashinfer", "0.6.13")
FLASH_ATTN_CUTE = Requirement("flash_attn.cute", "flash-attn-4", "flash-attn-cute")

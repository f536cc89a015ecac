"""Shared pieces of the built-in declarations."""

from __future__ import annotations

from attnreg.registry import DType, Requirement

MLA_DIMS = ((576, 512),)
MHA_DIMS = ((192, 128), (128, 128))
HALF = frozenset({DType.BF16, DType.FP16})
HALF_AND_FP8 = frozenset({DType.BF16, DType.FP16, DType.FP8_E4M3})

# Requirements of the built-in backends (listed in their BackendSpec, builtin.py).
TORCH = Requirement("torch", "torch", "2.4", extra="torch")
TRITON = Requirement("triton", "triton", "3.2", extra="triton")
FLASHINFER = Requirement("flashinfer", "flashinfer-python", "0.6.13", extra="flashinfer")
FLASH_ATTN_CUTE = Requirement("flash_attn.cute", "flash-attn-4", extra="flash-attn-cute")

"""The built-in plugin: registers the five built-in backends through the same
hook third-party plugins use.  Imports only declarations (no torch)."""

from __future__ import annotations

from collections.abc import Callable

from attnreg.registry import BackendSpec, hookimpl

from .declarations import flash_attn_cute, flashinfer_mla, reference, triton, trtllm_mla
from .declarations._common import FLASH_ATTN_CUTE, FLASHINFER, TORCH, TRITON


@hookimpl(trylast=True)
def attnreg_register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(BackendSpec(
        name="reference", summary="float32 torch MLA/MHA: simple enough to trust, the cpu fallback",
        capabilities=reference.capabilities,
        runtime="attnreg.backends.reference:ReferenceBackend", requires=(TORCH,)))
    register(BackendSpec(
        name="triton", summary="attnreg's Triton MLA kernels, capture-safe split-KV",
        capabilities=triton.capabilities,
        runtime="attnreg.backends.triton_mla:TritonMLABackend", requires=(TORCH, TRITON)))
    register(BackendSpec(
        name="flashinfer_mla", summary="flashinfer paged MLA (fa3/fa2) + ragged MHA prefill",
        capabilities=flashinfer_mla.capabilities,
        runtime="attnreg.backends.flashinfer_mla:FlashInferMLABackend",
        requires=(TORCH, FLASHINFER)))
    register(BackendSpec(
        name="trtllm_mla", summary="TRT-LLM-gen MLA decode + ragged prefill (Blackwell)",
        capabilities=trtllm_mla.capabilities,
        runtime="attnreg.backends.trtllm_mla:TRTLLMMLABackend", requires=(TORCH, FLASHINFER)))
    register(BackendSpec(
        name="flash_attn_cute", summary="flash-attn-4 varlen prefill; absorbed qv on sm100+",
        capabilities=flash_attn_cute.capabilities,
        runtime="attnreg.backends.flash_attn_cute:FlashAttnCuteBackend",
        requires=(TORCH, FLASH_ATTN_CUTE)))

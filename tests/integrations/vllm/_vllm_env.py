"""vLLM 0.33 engines on this CPU machine, as far as its CUDA-graph resolution reads them.

:func:`engine` builds what vLLM's model runner holds when it resolves the
cudagraph mode: vLLM's real ``CompilationConfig`` (VLLM_COMPILE, attention
as a splitting op, the user's ``cudagraph_mode`` or vLLM's O2 default
filled in as ``VllmConfig.__post_init__`` does) and ``CacheConfig``, a
model config with the fields the step reads (a real ``ModelConfig`` /
``VllmConfig`` cannot be built here: vLLM cannot infer a device on this
machine), the real metadata builder class and a KV-cache spec.
:func:`runner_step` is ``GPUModelRunner._check_and_update_cudagraph_mode``
for one backend: the builder's ``get_cudagraph_support`` and
``CompilationConfig.resolve_cudagraph_mode_and_sizes``.

FLASHINFER_MLA's module needs flashinfer and CUTLASS_MLA's asserts CUDA at
import, so their builders are stand-ins in those modules' names carrying
the support vLLM 0.33 states for them (checked against the installed source).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from vllm.config import CacheConfig, CompilationConfig
from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.mla.flashmla import FlashMLAMetadataBuilder
from vllm.v1.attention.backends.mla.triton_mla import TritonMLAMetadataBuilder

from attnreg.integrations.vllm import hooks
from attnreg.integrations.vllm.backend import backend_classes
from attnreg.integrations.vllm.registration import register_backends, vllm_name

_MLA = "vllm.v1.attention.backends.mla"


def _stand_in(module: str, cls_name: str, support: AttentionCGSupport) -> type:
    return type(cls_name, (MLACommonMetadataBuilder,),
                {"__module__": f"{_MLA}.{module}", "_cudagraph_support": support})


#: vLLM backend name -> (its metadata builder, the source line stating its support).
BUILDERS: dict[str, tuple[type, str]] = {
    "TRITON_MLA": (TritonMLAMetadataBuilder, "AttentionCGSupport.UNIFORM_BATCH"),
    "FLASHMLA": (FlashMLAMetadataBuilder, "AttentionCGSupport.UNIFORM_BATCH"),
    "FLASHINFER_MLA": (_stand_in("flashinfer_mla", "FlashInferMLAMetadataBuilder",
                                 AttentionCGSupport.ALWAYS),
                       "AttentionCGSupport.ALWAYS"),
    "CUTLASS_MLA": (_stand_in("cutlass_mla", "CutlassMLAMetadataBuilder",
                              AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
                    "AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE"),
}


def stated_in_source(backend: str) -> bool:
    """Whether the installed vLLM's builder module states the support the stand-in carries."""
    builder, stated = BUILDERS[backend]
    spec = importlib.util.find_spec(_MLA)
    assert spec is not None and spec.submodule_search_locations
    path = Path(list(spec.submodule_search_locations)[0]) / f"{builder.__module__.rsplit('.', 1)[1]}.py"
    text = path.read_text()
    start = text.index(f"class {builder.__name__}(")
    return stated in text[start:start + 800]

#: attnreg's own backends as vLLM backends ``ATTNREG_<NAME>`` (vLLM's real
#: ``register_backend``): their real adapter builders (attnreg.integrations.vllm.backend),
#: which state NEVER (the adapter runs attnreg eagerly).
for _name in ("reference", "triton"):
    BUILDERS[vllm_name(_name)] = (backend_classes(_name)[1], "")


def register_reference() -> None:
    """Register ``ATTNREG_REFERENCE`` and ``ATTNREG_TRITON`` with vLLM (idempotent)."""
    register_backends(["reference", "triton"])


@dataclass(frozen=True)
class Engine:
    """One configuration: vLLM's backend, the GPU, KV dtype, draft tokens, explicit mode."""

    backend: str
    sm: int
    kv: str = "auto"
    draft: int = 0
    explicit: str | None = None

    @property
    def label(self) -> str:
        return (f"{self.backend}-sm{self.sm}-{self.kv}-spec{self.draft}-"
                f"{self.explicit or 'default'}")


def engine(e: Engine) -> tuple[Any, type, Any]:
    """(vllm_config, builder class, kv_cache_spec) for ``e``."""
    cc = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        cudagraph_mode=CUDAGraphMode[e.explicit] if e.explicit else None,
        splitting_ops=list(CompilationConfig._attention_ops),
        cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256],
        max_cudagraph_capture_size=256)
    # VllmConfig.__post_init__: the bridge's wrapper records the lock first, then
    # vLLM fills in its O2 default.
    hooks.record_lock(cc)
    if cc.cudagraph_mode is None:
        cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    model = SimpleNamespace(
        use_mla=True, dtype=torch.bfloat16, max_model_len=32768, is_multimodal_model=False,
        hf_text_config=SimpleNamespace(model_type="deepseek_v3"),
        get_num_attention_heads=lambda parallel_config: 128)
    spec = SimpleNamespace(num_speculative_tokens=e.draft) if e.draft else None
    vllm_config = SimpleNamespace(
        model_config=model, cache_config=CacheConfig(cache_dtype=e.kv, block_size=64),
        scheduler_config=SimpleNamespace(max_num_seqs=256), speculative_config=spec,
        parallel_config=SimpleNamespace(), compilation_config=cc)
    kv_cache_spec = SimpleNamespace(block_size=64)
    return vllm_config, BUILDERS[e.backend][0], kv_cache_spec


@contextlib.contextmanager
def simulated_gpu(sm: int | None) -> Iterator[None]:
    """vLLM's ``current_platform`` reports one CUDA GPU of capability ``sm`` (None: as is)."""
    if sm is None:
        yield
        return
    with mock.patch.object(current_platform, "is_cuda", return_value=True), \
            mock.patch.object(current_platform, "get_device_capability",
                              return_value=DeviceCapability(*divmod(sm, 10))):
        yield


def runner_step(vllm_config: Any, builder: type, kv_cache_spec: Any) -> str:
    """vLLM's resolution for one backend (``_check_and_update_cudagraph_mode``)."""
    support = builder.get_cudagraph_support(vllm_config, kv_cache_spec)
    draft = vllm_config.speculative_config.num_speculative_tokens \
        if vllm_config.speculative_config else 0
    mode = vllm_config.compilation_config.resolve_cudagraph_mode_and_sizes(
        support, builder.__name__, 1 + draft)
    return mode.name

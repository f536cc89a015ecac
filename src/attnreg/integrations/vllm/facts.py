"""Read a ``VllmConfig`` (and one KV-cache spec) into the facts attnreg's policy reads.

Everything comes from the config vLLM's model runner holds when it asks a
metadata builder for its CUDA-graph support: the model (``use_mla``,
``dtype``, heads per rank, ``max_model_len``), the KV cache (``cache_dtype``,
the spec's ``block_size``), the scheduler (``max_num_seqs``), speculative
decoding (``num_speculative_tokens``) and the capture sizes; the platform
from ``vllm.platforms.current_platform``.

A fact attnreg cannot represent (a non-MLA model, a KV dtype attnreg does
not declare, vLLM's FULL mode) is not guessed: it is named in
:attr:`VllmFacts.gaps` and vLLM's own stated support decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnreg.graph_policy import EngineFacts, GraphConfig, ModelFacts, ServerFeatures
from attnreg.registry.capabilities import DType, GraphMode
from attnreg.registry.platform import Platform

from .names import BackendMapping, kv_dtype_from_vllm, map_backend
from .vocabulary import requested_modes

__all__ = ["ADAPTER_DECODE_MODES", "HOST_MODES", "VllmFacts", "read_facts", "read_platform"]

#: The attnreg modes vLLM 0.33 has, per phase (vocabulary.MODES): no breakable prefill.
HOST_MODES = {
    "prefill": frozenset({GraphMode.TC_PIECEWISE, GraphMode.DISABLED}),
    "decode": frozenset({GraphMode.FULL, GraphMode.DISABLED}),
}

#: The decode modes vLLM has for attnreg's own backends behind the adapter
#: (``ATTNREG_*``, :mod:`.backend`): it runs them eagerly, so no full decode graph.
ADAPTER_DECODE_MODES = frozenset({GraphMode.DISABLED})

_MODEL_DTYPES = {"torch.bfloat16": DType.BF16, "torch.float16": DType.FP16}


@dataclass(frozen=True)
class VllmFacts:
    """What attnreg knows about one vLLM engine when a metadata builder is asked.

    ``model`` and ``config`` are None when a gap prevents them; ``gaps`` says
    why.  ``requested`` is vLLM's ``cudagraph_mode`` before resolution and
    ``locked`` whether the user set it.
    """

    platform: Platform
    backend: BackendMapping
    requested: str
    locked: bool
    model: ModelFacts | None
    config: GraphConfig | None
    features: ServerFeatures
    engine: EngineFacts
    gaps: tuple[str, ...]

    @property
    def decidable(self) -> bool:
        return not self.gaps

    def to_dict(self) -> dict[str, object]:
        return {"platform": str(self.platform), "backend": self.backend.vllm,
                "attnreg": self.backend.attnreg, "requested": self.requested,
                "locked": self.locked, "engine": self.engine.to_dict(),
                "gaps": list(self.gaps)}


def read_platform() -> Platform:
    """attnreg's platform for vLLM's ``current_platform`` (cuda:smXY, rocm, xpu, cpu)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        cap = current_platform.get_device_capability()
        return Platform.parse(f"cuda:sm{cap.major}{cap.minor}")
    if current_platform.is_rocm():
        return Platform.parse("rocm")
    if current_platform.is_xpu():
        return Platform.parse("xpu")
    return Platform.parse("cpu")


def read_facts(vllm_config: Any, backend_name: str, kv_cache_spec: Any, *,
               requested: str, locked: bool) -> VllmFacts:
    """The facts of one engine for vLLM's backend ``backend_name``."""
    gaps: list[str] = []
    mapping = map_backend(backend_name)
    if not mapping.mapped:
        gaps.append(f"backend {backend_name}: {mapping.reason}")
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    spec = vllm_config.speculative_config
    k = int(spec.num_speculative_tokens or 0) if spec is not None else 0
    # A verify step carries the last accepted token and the k drafts per request (vLLM's
    # uniform_decode_query_len = 1 + num_speculative_tokens): the query tokens attnreg's
    # num_draft_tokens counts, as sglang's speculative_num_draft_tokens does.
    draft = 1 + k if k else 0
    page_size = getattr(kv_cache_spec, "block_size", None) or cache_config.block_size
    engine = EngineFacts(
        page_size=page_size,
        max_context_len=model_config.max_model_len,
        max_running_requests=vllm_config.scheduler_config.max_num_seqs,
        num_draft_tokens=draft,
        prefill_graph_modes=HOST_MODES["prefill"],
        decode_graph_modes=ADAPTER_DECODE_MODES if mapping.exact else HOST_MODES["decode"])
    features = ServerFeatures(speculative_decoding=draft > 0)

    model = None
    if not model_config.use_mla:
        gaps.append("the model does not use MLA")
    act = _MODEL_DTYPES.get(str(model_config.dtype))
    if act is None:
        gaps.append(f"model dtype {model_config.dtype} has no attnreg equivalent")
    kv = kv_dtype_from_vllm(cache_config.cache_dtype, act or DType.BF16)
    if kv is None:
        gaps.append(f"KV cache dtype {cache_config.cache_dtype!r} has no attnreg equivalent")
    if not gaps:
        hf = model_config.hf_text_config
        model = ModelFacts(
            attention="mla", kv_dtype=kv, act_dtype=act,
            num_heads=model_config.get_num_attention_heads(vllm_config.parallel_config),
            dsa_sparse=getattr(hf, "index_topk", None) is not None,
            multimodal=bool(model_config.is_multimodal_model),
            # vLLM compiles piecewise only models that support torch.compile (else
            # its piecewise_capture_available check strips piecewise itself).
            piecewise_validated=True,
            label=str(getattr(hf, "model_type", "vllm")))

    config = None
    modes = requested_modes(requested)
    if modes is None:
        gaps.append(f"cudagraph_mode {requested}: full graphs of mixed batches have no "
                    f"attnreg equivalent (attnreg has no full prefill)")
    else:
        sizes = sorted(set(vllm_config.compilation_config.cudagraph_capture_sizes or ()))
        kwargs = {"decode_batch_sizes": tuple(sizes)} if sizes else {}
        prefill, decode = modes
        if locked:
            config = GraphConfig.from_user(prefill=prefill, decode=decode, **kwargs)
        else:
            # vLLM's unresolved mode is the engine's default: soft rules may change it.
            config = GraphConfig(prefill_mode=prefill, decode_mode=decode, **kwargs)
    return VllmFacts(read_platform(), mapping, requested, locked, model,
                     config if not gaps else None, features, engine, tuple(gaps))

"""attnreg's backends behind vLLM 0.33's MLA attention-backend interface.

vLLM's ``MLAAttention`` layer (``vllm.model_executor.layers.attention.mla_attention``)
does everything around attention itself: it writes the step's new latent and
rope rows into the layer's paged cache, splits the step into decode tokens
(first) and prefill tokens, and for the decode tokens absorbs ``W_UK`` into
the query before it calls the impl's ``forward_mqa``; after it, it applies
``W_UV``.  So the bridge adapts at the impl, where vLLM's own MLA backends
differ from each other (``triton_mla.py``, ``flashmla.py``):

| vLLM (one role per class) | attnreg |
|---|---|
| ``Attnreg_<name>_Backend(MLACommonBackend)``: name ``ATTNREG_<NAME>``, dtypes, block sizes | the declaration of ``<name>`` on this platform |
| ``Attnreg_<name>_MetadataBuilder(MLACommonMetadataBuilder)``: vLLM's split and metadata, then per step | one attnreg backend instance per part, shared by every layer: ``init_forward_metadata`` of the decode batch and of the prefill batch (:mod:`.batches`) |
| ``Attnreg_<name>_Impl(MLACommonImpl).forward_mqa(q, kv_cache, md, layer)``: absorbed q ``[B, H, 512 + 64]`` | ``forward`` (DECODE: ``forward_decode``; TARGET_VERIFY: ``forward_extend``, method MLA) over a zero-copy view of the layer's cache, new rows already written (``latent_new=None``) |
| ``forward_mha(q, kv_c_normed, k_pe, kv_cache, md, k_scale, output)``: prefill | ``forward_extend(method=MHA_CHUNKED_KV)``: k / v of the new tokens from the layer's ``kv_b_proj``, the cached prefix decompressed by it in chunks of vLLM's chunked-prefill workspace; a backend without that kernel leaves prefill to vLLM's own (``MLACommonImpl.forward_mha``) |

vLLM's cache of one MLA layer is ``[num_blocks, block_size, 576]`` (latent
then rope per token; fp8 as ``float8_e4m3fn`` storing ``value / k_scale``);
block 0 is vLLM's null block, never given to a request.  That is attnreg's
``MLAKVPool`` layer exactly (page 0 the padding page), so the impl views it
without a copy (``MLAKVPool.wrap``).  The backend asks vLLM for a
layer-outermost KV-cache layout (``supported_kv_cache_layouts``: LBNHC,
LBHNC), where each layer's cache is one contiguous region; a cache that is
not contiguous anyway (a block-outermost layout forced with
``VLLM_KV_CACHE_LAYOUT``, a padded page) or not 576 wide is refused.

CUDA graphs: the adapter runs attnreg eagerly (attnreg's host planning per
step), so its builders state ``AttentionCGSupport.NEVER`` and the bridge's
decision gives the ``ATTNREG_*`` backends no full decode graph
(``engine.mode_unsupported``); vLLM's piecewise graphs keep attention
outside the graph and run.  Everything attnreg's declaration does not serve
is refused with :class:`~attnreg.registry.UnsupportedError` (a ``ValueError``)
when vLLM builds the builder or impl, before a kernel launch.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.kv_cache_layout import KVCacheLayout

from attnreg.registry import (
    Capabilities,
    DType,
    ForwardMethod,
    ForwardMode,
    Phase,
    UnsupportedError,
    get_registry,
)
from attnreg.runtime import AttentionBackend, ForwardBatch, MLAConfig, MLAKVPool, torch_dtype
from attnreg.runtime import dtype_from_torch as _dtype_from_torch

from .batches import to_attnreg_batches
from .names import kv_dtype_from_vllm
from .registration import backend_class_name, vllm_name

__all__ = ["AttnregMLAMetadata", "Planned", "backend_classes"]

#: vLLM ``cache_dtype`` names of attnreg's KV dtypes (``auto`` is always accepted).
_CACHE_DTYPE_NAMES = {DType.BF16: ("bfloat16",), DType.FP16: ("float16",),
                      DType.FP8_E4M3: ("fp8", "fp8_e4m3")}


@dataclass(frozen=True)
class Planned:
    """One part of a step (decode or prefill) as attnreg planned it for every layer.

    ``method``: the attnreg forward method the part runs (MLA for decode, the
    chunked-prefix MHA for prefill); ``chunk_tokens``: prefix rows decompressed at once.
    """

    backend: AttentionBackend[Any, Any]
    batch: ForwardBatch
    method: ForwardMethod
    chunk_tokens: int | None = None


@dataclass
class AttnregMLAMetadata(MLACommonMetadata[MLACommonDecodeMetadata]):
    """vLLM's MLA metadata plus attnreg's plan of the decode and the prefill part
    (None: the part is empty, or prefill runs vLLM's own kernels)."""

    attnreg_decode: Planned | None = None
    attnreg_prefill: Planned | None = None


def _refuse(vname: str, what: str, reasons: list[str] | str, hint: str) -> UnsupportedError:
    return UnsupportedError(vname, what, reasons, hint)


def _declaration(name: str) -> Capabilities:
    from .facts import read_platform

    return get_registry().declaration(name, read_platform())


def _mla_decode_kernels(caps: Capabilities) -> list[Any]:
    return list(caps.kernels_for(ForwardMethod.MLA, Phase.DECODE))


def _serves_verify(caps: Capabilities, query_len: int) -> bool:
    served = caps.eager_serving(ForwardMode.TARGET_VERIFY)
    return served is not None and served.serves_query_len(query_len)


# ----------------------------------------------------------------------------------
# metadata builder
# ----------------------------------------------------------------------------------
class AttnregMLAMetadataBuilder(MLACommonMetadataBuilder[AttnregMLAMetadata]):
    """vLLM's MLA metadata builder, plus attnreg's plan of each step (see the module doc).

    Subclassed per attnreg backend by :func:`backend_classes` (``attnreg_name``).
    """

    attnreg_name: ClassVar[str] = ""
    vllm_backend_name: ClassVar[str] = ""
    # The adapter runs attnreg eagerly: no vLLM full graph of its forwards.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        vname = self.vllm_backend_name
        caps = _declaration(self.attnreg_name)
        spec = vllm_config.speculative_config
        draft = int(spec.num_speculative_tokens or 0) if spec is not None else 0
        # vLLM's decode part holds 1 + draft tokens per request only where the decode
        # pipeline says UNIFORM; attnreg's verify batches are uniform and causal.
        self.query_len_support = (QueryLenSupport.UNIFORM if draft and _serves_verify(
            caps, 1 + draft) else QueryLenSupport.SINGLE_ONLY)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device,
                         metadata_cls=AttnregMLAMetadata)
        if self.dcp_world_size > 1 or self.use_pcp:
            raise _refuse(vname, "decode / prefill context parallelism",
                          "attnreg's forwards attend a whole sequence on one rank",
                          "set decode_context_parallel_size=1 and "
                          "prefill_context_parallel_size=1")
        layer = vllm_config.compilation_config.static_forward_context[layer_names[0]]
        model = vllm_config.model_config
        q_dtype = _dtype_from_torch(model.dtype)
        kv_dtype = kv_dtype_from_vllm(vllm_config.cache_config.cache_dtype,
                                      q_dtype or DType.BF16)
        if q_dtype is None or kv_dtype is None:
            raise _refuse(vname, f"model dtype {model.dtype}, KV cache dtype "
                          f"{vllm_config.cache_config.cache_dtype!r}",
                          "attnreg has no name for it", "serve in bf16 / fp16 with an auto, "
                          "bf16, fp16 or fp8_e4m3 KV cache")
        dims = self.mla_dims
        self.attnreg_config = MLAConfig(
            num_heads=int(self.num_heads), kv_lora_rank=dims.kv_lora_rank,
            qk_rope_head_dim=dims.qk_rope_head_dim, qk_nope_head_dim=dims.qk_nope_head_dim,
            v_head_dim=dims.v_head_dim, page_size=int(kv_cache_spec.block_size),
            kv_dtype=kv_dtype, q_dtype=q_dtype, device=str(device),
            sm_scale=float(layer.scale), max_context_len=int(model.max_model_len))
        cfg = self.attnreg_config
        reasons = [f"decode: {r}" for r in caps.check_request(
            ForwardMethod.MLA, Phase.DECODE, head_dims=cfg.mla_head_dims, q_dtype=cfg.q_dtype,
            kv_dtype=cfg.kv_dtype, page_size=cfg.page_size, num_heads=cfg.num_heads)]
        if reasons:
            raise _refuse(vname, "this engine's model and KV cache", reasons,
                          "choose the block size / KV cache dtype `attnreg backends` declares "
                          "for it, or another attention backend")
        registry = get_registry()
        self.attnreg_decode = registry.create(self.attnreg_name, cfg)
        # Prefill through attnreg where it has the chunked-prefix MHA kernel for this
        # model (vLLM's prefill is MHA over kv_b_proj-decompressed rows); else vLLM's own.
        self.attnreg_prefill = None
        if not caps.check_request(ForwardMethod.MHA_CHUNKED_KV, Phase.PREFILL,
                                  head_dims=cfg.mha_head_dims, q_dtype=cfg.q_dtype,
                                  kv_dtype=cfg.q_dtype, num_heads=cfg.num_heads):
            self.attnreg_prefill = registry.create(self.attnreg_name, cfg)
        # Host lengths are exact except for decode rows under async speculative decoding.
        self.exact_decode_lens = not (draft and getattr(vllm_config.scheduler_config,
                                                        "async_scheduling", False))

    def build(self, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> AttnregMLAMetadata:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if not md.causal:
            raise _refuse(self.vllm_backend_name, "a non-causal decode block",
                          "attnreg's decode-phase batches are causal among their tokens",
                          "use a vLLM backend with non-causal multi-token decode")
        parts = to_attnreg_batches(common_attn_metadata, num_decodes=md.num_decodes,
                                   num_decode_tokens=md.num_decode_tokens,
                                   num_prefills=md.num_prefills,
                                   exact_decode_lens=self.exact_decode_lens)
        if parts.decode is not None:
            self.attnreg_decode.init_forward_metadata(parts.decode)
            md.attnreg_decode = Planned(self.attnreg_decode, parts.decode, ForwardMethod.MLA)
        if parts.prefill is not None and self.attnreg_prefill is not None:
            self.attnreg_prefill.init_forward_metadata(parts.prefill)
            md.attnreg_prefill = Planned(self.attnreg_prefill, parts.prefill,
                                         ForwardMethod.MHA_CHUNKED_KV,
                                         int(self.chunked_prefill_workspace_size))
        return md


# ----------------------------------------------------------------------------------
# impl
# ----------------------------------------------------------------------------------
class AttnregMLAImpl(MLACommonImpl[AttnregMLAMetadata]):
    """One layer's attention: vLLM's ``MLACommonImpl`` with attnreg's forwards.

    ``forward_mqa`` and ``forward_mha`` run the plan the builder made for the step
    (:class:`Planned`) over this layer's cache, viewed as a one-layer
    :class:`~attnreg.runtime.MLAKVPool` (made once per cache tensor: the layer's
    fp8 ``k_scale`` is read then, after vLLM loaded the weights).
    """

    attnreg_name: ClassVar[str] = ""
    vllm_backend_name: ClassVar[str] = ""
    can_return_lse_for_decode: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None, attn_type: str,
                 kv_sharing_target_layer_name: str | None, **mla_args: Any) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, **mla_args)
        asked = [what for what, value in (("ALiBi slopes", alibi_slopes),
                                          ("a sliding window", sliding_window),
                                          ("logit soft-capping", logits_soft_cap),
                                          ("a DSA indexer", mla_args.get("indexer")))
                 if value]
        if attn_type != AttentionType.DECODER:
            asked.append(f"attention type {attn_type}")
        if asked:
            raise _refuse(self.vllm_backend_name, ", ".join(asked),
                          "attnreg's MLA backends run causal decoder attention without them",
                          "use one of vLLM's own MLA backends for this model")
        # attnreg takes the absorbed query in the activations' dtype (an fp8 cache is
        # dequantised inside its kernels): no fp8 query from the layer.
        self.supports_quant_query_input = False
        self._pool: MLAKVPool | None = None
        self._pool_key: tuple[Any, ...] | None = None

    def fused_output_quant_supported(self, quant_key: Any) -> bool:
        return False  # attnreg writes the attention output in the activations' dtype

    def _pool_for(self, kv_cache: torch.Tensor, k_scale: torch.Tensor | float) -> MLAKVPool:
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)
        if self._pool is not None and self._pool_key == key:
            return self._pool
        row = self.kv_lora_rank + self.qk_rope_head_dim
        kv_dtype = _dtype_from_torch(kv_cache.dtype)
        if kv_cache.dim() != 3 or kv_cache.shape[2] != row or not kv_cache.is_contiguous() \
                or kv_dtype is None:
            raise _refuse(self.vllm_backend_name,
                          f"KV cache {kv_cache.dtype} {tuple(kv_cache.shape)} strides "
                          f"{kv_cache.stride()}",
                          f"attnreg views a contiguous [num_blocks, block_size, {row}] MLA "
                          "cache without a copy; this layout is another",
                          "use vLLM's plain MLA KV cache (no padded page stride)")
        scale = float(k_scale) if kv_dtype is DType.FP8_E4M3 else 1.0
        self._pool = MLAKVPool.wrap([kv_cache], int(kv_cache.shape[1]), kv_dtype=kv_dtype,
                                    scale=scale, kv_lora_rank=self.kv_lora_rank,
                                    rope_dim=self.qk_rope_head_dim)
        self._pool_key = key
        return self._pool

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: AttnregMLAMetadata,
                    layer: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        planned = attn_metadata.attnreg_decode
        assert planned is not None, "vLLM calls forward_mqa only for a decode part"
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        pool = self._pool_for(kv_c_and_k_pe_cache, layer._k_scale)
        n = planned.batch.num_tokens
        result = planned.backend.forward(q[:n], None, None, pool, planned.batch,
                                         return_lse=self.can_return_lse_for_decode)
        if self.can_return_lse_for_decode:
            out, lse = result
            return out, lse
        return result, None

    def forward_mha(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: AttnregMLAMetadata,
                    k_scale: torch.Tensor, output: torch.Tensor,
                    output_scale: torch.Tensor | None = None) -> None:
        planned = attn_metadata.attnreg_prefill
        if planned is None:  # no attnreg prefill kernel for this model: vLLM's own
            return super().forward_mha(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache,
                                       attn_metadata, k_scale, output, output_scale)
        if output_scale is not None:
            raise _refuse(self.vllm_backend_name, "a fused quantised attention output",
                          "attnreg writes the output in the activations' dtype",
                          "turn off vLLM's attention + quant fusion")
        pool = self._pool_for(kv_c_and_k_pe_cache, k_scale)
        n = planned.batch.num_tokens
        k, v = self._decompress(kv_c_normed[:n], k_pe[:n])
        out = planned.backend.forward_extend(
            q[:n], None, None, pool, planned.batch, method=planned.method, k=k, v=v,
            decompress=self._decompress, chunk_tokens=planned.chunk_tokens)
        heads_out = output.view(output.shape[0], self.num_heads, self.v_head_dim)
        heads_out[:n].copy_(out)
        heads_out[n:].zero_()  # rows vLLM padded past the step's tokens

    def _decompress(self, latent: torch.Tensor, rope: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k ``[n, H, nope + rope]`` and v ``[n, H, v]`` of latent / rope rows, through this
        layer's ``kv_b_proj`` (what vLLM's own prefill computes)."""
        kv = self.kv_b_proj(latent)[0].view(-1, self.num_heads,
                                             self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        rope = rope.reshape(rope.shape[0], 1, self.qk_rope_head_dim)
        return self._concat_k_nope_k_pe(k_nope, rope), v.contiguous()


# ----------------------------------------------------------------------------------
# backend
# ----------------------------------------------------------------------------------
class AttnregMLABackend(MLACommonBackend):
    """vLLM's static surface of one attnreg backend, from its declaration."""

    attnreg_name: ClassVar[str] = ""
    block_sizes: ClassVar[list[int]] = []

    @classmethod
    def get_name(cls) -> str:  # type: ignore[override]
        return vllm_name(cls.attnreg_name)

    @classmethod
    def get_impl_cls(cls) -> type[AttnregMLAImpl]:  # type: ignore[override]
        return backend_classes(cls.attnreg_name)[2]

    @classmethod
    def get_builder_cls(cls) -> type[AttnregMLAMetadataBuilder]:  # type: ignore[override]
        return backend_classes(cls.attnreg_name)[1]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [576]

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec: Any = None) -> list[Any]:
        return list(cls.block_sizes)

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or not cls.block_sizes or block_size in cls.block_sizes

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Layer-outermost layouts: each layer's cache is one contiguous
        # [num_blocks, block_size, 576] region (H = 1 for MLA), which the impl views
        # as an MLAKVPool layer without a copy.  Block-outermost layouts interleave
        # the layers' pages, a stride attnreg's kernels do not take.
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        plat = f"cuda:sm{capability.major}{capability.minor}"
        return get_registry().availability(cls.attnreg_name, plat,
                                           assume_installed=True).available


_CLASS_NAME = re.compile(r"^Attnreg_(?P<name>.+)_(?P<role>Backend|MetadataBuilder|Impl)$")


@functools.lru_cache(maxsize=None)
def backend_classes(name: str) -> tuple[type[AttnregMLABackend],
                                        type[AttnregMLAMetadataBuilder],
                                        type[AttnregMLAImpl]]:
    """(backend, metadata builder, impl) classes of attnreg backend ``name`` for vLLM,
    with what its declaration says on this process's platform."""
    caps = _declaration(name)
    kernels = _mla_decode_kernels(caps)
    q_dtypes = {dt for k in kernels for dt in k.q_dtypes}
    kv_dtypes = {dt for k in kernels for dt in k.kv_dtypes}
    sizes = sorted({p for k in kernels for p in (k.page_sizes or ())})
    vname = vllm_name(name)
    base = backend_class_name(name)[:-len("Backend")]
    module = __name__

    def make(role: str, parent: type, attrs: dict[str, Any]) -> Any:
        cls_name = base + role
        return type(cls_name, (parent,), {"__module__": module, "__qualname__": cls_name,
                                          "attnreg_name": name, **attrs})

    backend = make("Backend", AttnregMLABackend, {
        "supported_dtypes": [torch_dtype(d) for d in sorted(q_dtypes, key=str)
                             if d in (DType.BF16, DType.FP16)],
        "supported_kv_cache_dtypes": ["auto"] + [n for d in sorted(kv_dtypes, key=str)
                                                 for n in _CACHE_DTYPE_NAMES.get(d, ())],
        "block_sizes": sizes})
    builder = make("MetadataBuilder", AttnregMLAMetadataBuilder, {"vllm_backend_name": vname})
    impl = make("Impl", AttnregMLAImpl, {
        "vllm_backend_name": vname,
        "can_return_lse_for_decode": bool(kernels) and all(k.lse for k in kernels)})
    return backend, builder, impl


def __getattr__(attr: str) -> Any:
    """``Attnreg_<name>_Backend`` (what vLLM resolves for ``ATTNREG_<NAME>``), ``..._MetadataBuilder``
    and ``..._Impl``, built on first use (and by pickle, in vLLM's worker processes)."""
    match = _CLASS_NAME.match(attr)
    if match is None:
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
    roles = ("Backend", "MetadataBuilder", "Impl")
    return backend_classes(match["name"])[roles.index(match["role"])]

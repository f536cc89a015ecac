"""sglang's names for attention backends and graph modes, and attnreg's.

Pure data, no sglang import: the plugin entry point and docs read it.

A backend maps only where sglang's backend runs the kernels the attnreg
declaration describes for an MLA model; the mapping then asserts that
sglang's implementation behaves as attnreg's declaration says (attnreg's
conformance suite proves attnreg's own implementation, not sglang's).  The
``attnreg_<name>`` backends of the bridge are attnreg's implementations, so
their mapping is exact.  See docs/decisions.md ("sglang backend names").

:func:`map_backend` answers from the name alone.  :func:`map_phase` answers
for one phase of one server: a backend declared by a plugin (``flashmla``:
the ``attnreg-flashmla`` plugin) maps only when that plugin is registered,
and sglang's sparse ``dsa`` backend maps per phase by the kernel its
``--dsa-<phase>-backend`` runs over the pool sglang resolved
(:func:`dsa_kernel_use`), to the declaration whose sparse kernels read that
row format in that phase.  The declarations come from a lookup the caller
passes (the bridge's registry), so this module stays pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from attnreg.registry.capabilities import (
    Capabilities,
    DType,
    GraphMode,
    Phase,
    SparseKVFormat,
)

__all__ = [
    "BRIDGE_PREFIX",
    "DSA_BACKENDS",
    "DSA_OTHER_KERNELS",
    "MAPPED_BACKENDS",
    "PLUGIN_BACKENDS",
    "UNMAPPED_BACKENDS",
    "BackendMapping",
    "DeclarationLookup",
    "DsaKernelUse",
    "PluginMapping",
    "dsa_kernel_use",
    "graph_mode_from_sglang",
    "graph_mode_to_sglang",
    "kv_dtype_from_sglang",
    "map_backend",
    "map_phase",
]

#: sglang attention-backend names registered by the backend bridge.
BRIDGE_PREFIX = "attnreg_"

#: sglang backend (MLA model) -> attnreg backend whose declaration describes its kernels.
MAPPED_BACKENDS: dict[str, str] = {
    # TRT-LLM-gen MLA decode + ragged prefill; under capture extend falls back
    # to flashinfer's paged MLA (seed 002), exactly what attnreg declares.
    "trtllm_mla": "trtllm_mla",
    # sglang's "flashinfer" builds FlashInferMLAAttnBackend for MLA models.
    "flashinfer": "flashinfer_mla",
    # sglang's Triton MLA decode/extend kernels (the models of attnreg's).
    "triton": "triton",
    # sglang's fa4 is flash_attn.cute (FlashAttention 4), attnreg's flash_attn_cute.
    "fa4": "flash_attn_cute",
}

#: sglang's sparse (DSA) attention backends; ``nsa`` is sglang 0.5.23's deprecated alias
#: of ``dsa`` (``attention_registry.py``: the same ``DeepseekSparseAttnBackend``).
DSA_BACKENDS = frozenset({"dsa", "nsa"})

_DSA_GAP = ("sparse (DSA) attention: sglang runs the kernel its --dsa-prefill-backend / "
            "--dsa-decode-backend picks (flashmla_sparse, flashmla_kv, fa3, tilelang, "
            "triton, trtllm, ...); the name alone maps to nothing: per phase, the sub-backend "
            "maps where an attnreg declaration's sparse kernels describe it (map_phase; "
            "docs/sparse.md)")

#: sglang MLA-capable backends attnreg has no declaration for, with why.
UNMAPPED_BACKENDS: dict[str, str] = {
    "fa3": "FlashAttention 3 (flash_attn_interface, sm90): attnreg declares no FA3 backend",
    # Declared by a plugin, not built in: PLUGIN_BACKENDS maps it when the plugin is
    # registered; this reason is the name-only answer.
    "flashmla": "FlashMLA: declared by the attnreg-flashmla plugin, not by attnreg itself "
                "(pip install attnreg-flashmla)",
    "cutlass_mla": "CUTLASS MLA: no attnreg declaration",
    "cutedsl_mla": "CuTe-DSL MLA decode: no attnreg declaration",
    "aiter": "AMD aiter: no attnreg declaration for ROCm kernels",
    # sglang 0.5.23's dsa (nsa: its deprecated alias) runs the kernels its
    # --dsa-prefill-backend / --dsa-decode-backend pick: map_phase maps them per phase.
    "nsa": _DSA_GAP,
    "dsa": _DSA_GAP,
    "qsa": "sparse attention backends are outside attnreg's declarations",
    "dsv4": "DeepSeek-V4 attention is outside attnreg's declarations",
    "torch_native": "torch native attention: sglang disables graphs for it itself",
    "flex_attention": "flex attention: sglang disables graphs for it itself",
}


@dataclass(frozen=True)
class BackendMapping:
    """What one sglang attention-backend name is to attnreg.

    ``attnreg`` is None when attnreg has no declaration for it; ``reason``
    then says why (it goes into the bridge's decision).
    """

    sglang: str | None
    attnreg: str | None
    reason: str = ""
    exact: bool = False
    #: For sglang's ``dsa`` / ``nsa``: the phase's ``--dsa-<phase>-backend`` sglang resolved.
    dsa_backend: str | None = None

    @property
    def mapped(self) -> bool:
        return self.attnreg is not None

    @property
    def label(self) -> str:
        """sglang's backend as a log line names it (``dsa (flashmla_kv)`` for a DSA phase)."""
        if self.dsa_backend is None:
            return str(self.sglang)
        return f"{self.sglang} ({self.dsa_backend})"


def map_backend(name: str | None) -> BackendMapping:
    """The attnreg backend declared for sglang's attention backend ``name``.

    Examples
    --------
    >>> map_backend("flashinfer").attnreg
    'flashinfer_mla'
    >>> map_backend("attnreg_triton").exact
    True
    >>> map_backend("fa3").mapped
    False
    """
    if name is None:
        return BackendMapping(None, None, "sglang resolved no attention backend")
    if name.startswith(BRIDGE_PREFIX):
        return BackendMapping(name, name[len(BRIDGE_PREFIX):],
                              "attnreg's own implementation behind sglang's interface",
                              exact=True)
    if name in MAPPED_BACKENDS:
        target = MAPPED_BACKENDS[name]
        return BackendMapping(name, target, f"sglang's {name} runs the kernels attnreg's "
                                            f"{target} declares")
    why = UNMAPPED_BACKENDS.get(name, "attnreg has no declaration for this sglang backend")
    return BackendMapping(name, None, why)


#: What :func:`map_phase` asks for an attnreg backend: its declaration on the server's
#: platform, or why there is none (not registered, its plugin failed to load).
DeclarationLookup = Callable[[str], "Capabilities | str"]


@dataclass(frozen=True)
class PluginMapping:
    """An sglang backend whose kernels an attnreg *plugin* declares, not attnreg itself.

    It maps, in ``phases``, only when the plugin's backend ``attnreg`` is
    registered; ``reason`` says what it runs there, ``other_phases`` why the
    other phase stays a gap.
    """

    attnreg: str
    distribution: str
    phases: frozenset[Phase]
    reason: str
    other_phases: str


#: sglang backend (MLA model) -> the plugin declaration that describes its kernels.
PLUGIN_BACKENDS: dict[str, PluginMapping] = {
    # sglang 0.5.23 layers/attention/flashmla_backend.py: FlashMLABackend decodes and
    # verifies (fixed-q, causal) with flash_mla_interface.flash_mla_with_kvcache, the
    # sgl-flash-mla wheel's legacy sm90 kernels (use_legacy defaults to True): bf16 q
    # over a bf16 cache, or q quantized to fp8 with one per-tensor scale over an fp8
    # cache; page size 64.  EXTEND batches go to its parent FlashInferMLAAttnBackend.
    "flashmla": PluginMapping(
        "flashmla", "attnreg-flashmla", frozenset({Phase.DECODE}),
        "sglang's flashmla decodes and verifies draft tokens with FlashMLA's dense "
        "flash_mla_with_kvcache (sgl-flash-mla's legacy sm90 kernels: bf16 q over a bf16 "
        "pool, or q rounded to fp8 per tensor over an fp8 pool; page size 64), the kernels "
        "the attnreg-flashmla plugin declares",
        "sglang's flashmla runs EXTEND batches through the FlashInfer MLA prefill its "
        "FlashMLABackend inherits (FlashInferMLAAttnBackend); attnreg's flashmla declares "
        "decode only"),
}


@dataclass(frozen=True)
class DsaKernelUse:
    """A kernel sglang 0.5.23's dsa backend calls in one phase over the pool's own rows.

    ``function`` is the kernel library's entry point (``flash_mla_interface``),
    ``kv_format`` the row format it reads straight from sglang's pool, and
    ``attnreg`` the backend whose sparse kernels would describe it (declared by
    the ``distribution`` plugin).
    """

    function: str
    kv_format: SparseKVFormat
    attnreg: str = "flashmla"
    distribution: str = "attnreg-flashmla"
    #: Said after the mapping's reason: how sglang calls it in this phase.
    how: str = ""


#: FlashMLA's sparse decode on DeepSeek-V3.2's FP8 rows (``_forward_flashmla_kv``).
_FLASHMLA_FP8 = ("flash_mla_with_kvcache(indices=..., is_fp8_kvcache=True, kv_format='V32')")
#: FlashMLA's sparse attention over bf16 rows (``_forward_flashmla_sparse``).
_FLASHMLA_BF16 = "flash_mla_sparse_fwd"

#: What a prefill mapping adds: sglang's dsa prefill is not the sparse kernel alone.
_DENSE_SHORT_PREFILL = (
    "; eagerly, extend batches whose longest KV is at most "
    "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD (sglang sets it to the model's "
    "index_topk) run dense MHA instead (FA3's flash_attn_varlen_func on sm90, TRT-LLM's "
    "ragged kernel on sm100), never under a prefill graph (set_dsa_prefill_impl forces "
    "use_mha off there)")

#: The sub-backends no attnreg declaration describes, each with the kernel sglang runs.
DSA_OTHER_KERNELS: dict[str, str] = {
    "fa3": "FlashAttention 3's flash_attn_with_kvcache over the top-k slots as a page table "
           "of page size 1: attnreg declares no FA3 backend",
    "trtllm": "FlashInfer's TRT-LLM-gen sparse MLA (trtllm_batch_decode_with_kv_cache_mla "
              "with sparse_mla_top_k) over the raw MLA rows: attnreg's trtllm_mla declares "
              "dense kernels only",
    "tilelang": "sglang's TileLang sparse MLA (tilelang_sparse_fwd): no attnreg declaration",
    "triton": "sglang's Triton sparse MLA (ROCm only in sglang 0.5.23): no attnreg declaration",
    "triton_sparse_mla": "sglang's Triton sparse MLA prefill (triton_sparse_mla_fwd over "
                         "dequantized bf16 rows): no attnreg declaration",
    "flashinfer_sparse_mla": "FlashInfer's sparse MLA (flashinfer_sparse_mla_forward): no "
                             "attnreg declaration",
    "flashmla_sparse_q8": "flash_mla_sparse_fwd's FP8-compute path (q and KV cast to fp8 "
                          "per call, sm90 prefill only): no attnreg declaration",
    "aiter": "AMD aiter sparse MLA: no attnreg declaration for ROCm kernels",
    "intel_xpu": "Intel XPU sparse kernels: no attnreg declaration",
}


def dsa_kernel_use(dsa_backend: str | None, phase: Phase, pool: DType | None, *,
                   rope_dim: int = 64, blackwell: bool = False) -> DsaKernelUse | str:
    """What sglang 0.5.23's dsa backend runs for ``phase`` with sub-backend ``dsa_backend``
    over a pool of ``pool`` rows: a kernel reading the pool's own rows, or why not one.

    From ``layers/attention/dsa_backend.py``: ``flashmla_kv`` calls FlashMLA's
    sparse decode on the pool's 656-byte FP8 rows (``fp8_e4m3``: sglang's
    ``DSATokenToKVPool`` stores them, ``dsa_kv_cache_store_fp8``), in prefill
    with each extend token as a one-token query; over a bf16 pool it
    quantizes the whole cache every call.  ``flashmla_sparse`` calls
    ``flash_mla_sparse_fwd`` on the bf16 pool rows through the top-k slots;
    over an fp8 pool its prefill reads a dequantized bf16 copy.
    ``flashmla_auto`` is a per-batch prefill choice between the two.
    """
    if dsa_backend is None:
        return f"sglang resolved no --dsa-{phase.value}-backend"
    sub = dsa_backend
    if sub == "flashmla_auto":
        if phase is Phase.DECODE:
            return ("flashmla_auto is a per-batch prefill choice: sglang 0.5.23's dsa "
                    "forward_decode has no kernel for it")
        if pool is DType.BF16:
            sub = "flashmla_sparse"  # set_dsa_prefill_impl: a bf16 pool always takes it
        elif blackwell:
            return ("flashmla_auto over an fp8 pool on Blackwell picks flashmla_kv or "
                    "flashmla_sparse per batch (by KV and query tokens): no one kernel "
                    "describes the phase")
        else:
            sub = "flashmla_kv"  # set_dsa_prefill_impl: an fp8 pool before Blackwell
    if sub == "flashmla_kv":
        if rope_dim == 0:
            return ("flashmla_kv on a model without RoPE reads FlashMLA's V32_NO_ROPE rows "
                    "(528 bytes): no attnreg row format")
        if pool is not DType.FP8_E4M3:
            return (f"over a {pool} pool sglang's flashmla_kv quantizes the whole cache into "
                    f"fp8_ds_mla rows on every call (quantize_k_cache) before "
                    f"{_FLASHMLA_FP8}: attnreg's declarations read the pool's own rows")
        how = ("" if phase is Phase.DECODE else
               " (each extend token as a one-token query of FlashMLA's sparse decode)")
        return DsaKernelUse(_FLASHMLA_FP8, SparseKVFormat.FP8_DS_MLA, how=how)
    if sub == "flashmla_sparse":
        if pool is not DType.BF16:
            if phase is Phase.PREFILL:
                return (f"over a {pool} pool sglang's flashmla_sparse prefill dequantizes "
                        f"the fp8_ds_mla rows it reads into a bf16 copy "
                        f"(dequantize_k_cache_paged_dsa) and runs {_FLASHMLA_BF16} on the "
                        f"copy: attnreg's declarations read the pool's own rows")
            return (f"{_FLASHMLA_BF16} reads bf16 rows and a {pool} pool holds fp8_ds_mla "
                    "rows: no attnreg declaration describes that decode")
        return DsaKernelUse(_FLASHMLA_BF16, SparseKVFormat.BF16)
    return DSA_OTHER_KERNELS.get(sub, f"a DSA sub-backend the bridge does not know "
                                      f"(sglang 0.5.23 lists no {sub!r})")


def _dsa_mapping(name: str, phase: Phase, dsa_backend: str | None, pool: DType | None,
                 lookup: DeclarationLookup | None, rope_dim: int,
                 blackwell: bool) -> BackendMapping:
    option = f"--dsa-{phase.value}-backend {dsa_backend}"
    use = dsa_kernel_use(dsa_backend, phase, pool, rope_dim=rope_dim, blackwell=blackwell)
    if isinstance(use, str):
        return BackendMapping(name, None, f"{option}: {use}", dsa_backend=dsa_backend)
    runs = (f"{option} runs FlashMLA's {use.function} over the pool's {use.kv_format} "
            f"rows{use.how}")
    caps = lookup(use.attnreg) if lookup is not None else \
        f"no attnreg registry was consulted for {use.attnreg!r}"
    if isinstance(caps, str):
        return BackendMapping(name, None,
                              f"{runs}; attnreg's {use.attnreg}, from the {use.distribution} "
                              f"plugin, would describe it: {caps} (pip install "
                              f"{use.distribution})", dsa_backend=dsa_backend)
    fitting = [k for k in caps.sparse_kernels_for(phase) if k.kv_format is use.kv_format]
    if not fitting:
        declared = sorted({k.kv_format.value for k in caps.sparse_kernels_for(phase)})
        have = (f"its sparse {phase} kernels read {', '.join(declared)} rows" if declared
                else f"it declares no sparse {phase} kernel")
        where = f"; {caps.platform_reason}" if caps.platform_reason else ""
        return BackendMapping(name, None,
                              f"{runs}; attnreg's {use.attnreg} declares no sparse {phase} "
                              f"kernel over {use.kv_format} rows on {caps.platform} ({have}"
                              f"{where})", dsa_backend=dsa_backend)
    kernels = ", ".join(k.kernel or "sparse mla" for k in fitting)
    note = _DENSE_SHORT_PREFILL if phase is Phase.PREFILL else ""
    return BackendMapping(name, use.attnreg,
                          f"{runs}, the sparse kernel attnreg's {use.attnreg} declares "
                          f"({kernels}){note}", dsa_backend=dsa_backend)


def _plugin_mapping(name: str, phase: Phase, lookup: DeclarationLookup | None) -> BackendMapping:
    plugin = PLUGIN_BACKENDS[name]
    if phase not in plugin.phases:
        return BackendMapping(name, None, plugin.other_phases)
    caps = lookup(plugin.attnreg) if lookup is not None else \
        f"no attnreg registry was consulted for {plugin.attnreg!r}"
    if isinstance(caps, str):
        return BackendMapping(name, None,
                              f"{UNMAPPED_BACKENDS.get(name, name)}: {caps}; install "
                              f"{plugin.distribution} to map it to attnreg's {plugin.attnreg}")
    return BackendMapping(name, plugin.attnreg, plugin.reason)


def map_phase(name: str | None, phase: Phase | str, *, dsa_backend: str | None = None,
              kv_dtype: DType | None = None, sparse_top_k: int | None = None,
              rope_dim: int = 64, blackwell: bool = False,
              lookup: DeclarationLookup | None = None) -> BackendMapping:
    """The attnreg backend declared for sglang's ``name`` in ``phase`` of one server.

    ``dsa_backend`` is sglang's ``--dsa-<phase>-backend`` (for ``dsa`` /
    ``nsa``), ``kv_dtype`` the pool's dtype, ``sparse_top_k`` the model's
    top-k (None: dense), ``rope_dim`` its ``qk_rope_head_dim``,
    ``blackwell`` whether the GPU is sm100 or newer, ``lookup`` the
    declarations of the server's platform by attnreg name.  Names that need
    none of these map as :func:`map_backend` maps them, except that a dense
    sglang backend never maps for a sparse model: sglang runs its dense
    kernels, and attnreg plans a sparse model only on declared sparse kernels.

    Examples
    --------
    >>> map_phase("triton", "decode").attnreg
    'triton'
    >>> map_phase("dsa", "decode", dsa_backend="fa3", kv_dtype=DType.BF16).mapped
    False
    """
    ph = Phase.parse(phase)
    if name in DSA_BACKENDS:
        return _dsa_mapping(name, ph, dsa_backend, kv_dtype, lookup, rope_dim, blackwell)
    mapping = _plugin_mapping(name, ph, lookup) if name in PLUGIN_BACKENDS \
        else map_backend(name)
    if mapping.mapped and not mapping.exact and sparse_top_k is not None:
        return BackendMapping(name, None,
                              f"sglang's {name} runs dense MLA kernels (they take no top-k "
                              f"indices), but the model's attention is sparse (top-k "
                              f"{sparse_top_k}): attnreg plans a sparse model only on declared "
                              f"sparse kernels, which sglang runs through its dsa backend")
    return mapping

#: sglang ``cuda_graph_config[phase].backend`` strings <-> attnreg graph modes.
_MODES = {
    "disabled": GraphMode.DISABLED,
    "full": GraphMode.FULL,
    "breakable": GraphMode.BREAKABLE,
    "tc_piecewise": GraphMode.TC_PIECEWISE,
}


def graph_mode_from_sglang(backend: str) -> GraphMode:
    """attnreg's mode for a sglang graph backend string (``"breakable"``)."""
    try:
        return _MODES[str(backend)]
    except KeyError:
        raise ValueError(f"unknown sglang cuda-graph backend {backend!r}; known: "
                         f"{', '.join(_MODES)}") from None


def graph_mode_to_sglang(mode: GraphMode) -> str:
    """sglang's graph backend string for an attnreg mode (the enum values agree)."""
    return GraphMode.parse(mode).value  # type: ignore[union-attr]


#: sglang ``--kv-cache-dtype`` values attnreg declares (``auto`` = the model dtype).
_KV_DTYPES = {
    "bf16": DType.BF16,
    "bfloat16": DType.BF16,
    "fp16": DType.FP16,
    "float16": DType.FP16,
    "fp8_e4m3": DType.FP8_E4M3,
}


def kv_dtype_from_sglang(kv_cache_dtype: str, model_dtype: DType) -> DType | None:
    """attnreg's KV dtype for sglang's ``kv_cache_dtype``; None when attnreg has none
    (fp8_e5m2, fp4 / nvfp4 / mxfp8 pools)."""
    if kv_cache_dtype in ("auto", None):
        return model_dtype
    return _KV_DTYPES.get(str(kv_cache_dtype))

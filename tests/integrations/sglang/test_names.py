"""What runs without sglang: the name mappings, the switch, and the import boundary.

These run in `make test` too (no sglang there).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from attnreg.integrations.sglang import ENV_SWITCH, plugin
from attnreg.integrations.sglang.decisions import BridgeDecision
from attnreg.integrations.sglang.names import (
    DSA_BACKENDS,
    DSA_OTHER_KERNELS,
    MAPPED_BACKENDS,
    PLUGIN_BACKENDS,
    UNMAPPED_BACKENDS,
    BackendMapping,
    DsaKernelUse,
    dsa_kernel_use,
    graph_mode_from_sglang,
    graph_mode_to_sglang,
    kv_dtype_from_sglang,
    map_backend,
    map_phase,
)
from attnreg.registry import get_registry
from attnreg.registry.capabilities import (
    Capabilities,
    DType,
    GraphMode,
    Phase,
    SparseKernel,
    SparseKVFormat,
)
from attnreg.registry.platform import Platform, Vendor

SRC = Path(__file__).resolve().parents[3] / "src" / "attnreg"


def test_every_mapped_backend_is_registered_in_attnreg() -> None:
    names = set(get_registry().names())
    assert set(MAPPED_BACKENDS.values()) <= names


@pytest.mark.parametrize(("sglang", "attnreg", "exact"), [
    ("trtllm_mla", "trtllm_mla", False), ("flashinfer", "flashinfer_mla", False),
    ("triton", "triton", False), ("fa4", "flash_attn_cute", False),
    ("attnreg_triton", "triton", True), ("fa3", None, False), ("flashmla", None, False),
    ("something_new", None, False), (None, None, False)])
def test_map_backend(sglang: str | None, attnreg: str | None, exact: bool) -> None:
    mapping = map_backend(sglang)
    assert (mapping.attnreg, mapping.exact) == (attnreg, exact)
    assert mapping.reason  # mapped or not, the decision says why


def test_graph_modes_round_trip() -> None:
    for text in ("disabled", "full", "breakable", "tc_piecewise"):
        assert graph_mode_to_sglang(graph_mode_from_sglang(text)) == text
    with pytest.raises(ValueError, match="unknown sglang cuda-graph backend"):
        graph_mode_from_sglang("piecewise")


def test_kv_dtypes() -> None:
    assert kv_dtype_from_sglang("auto", DType.BF16) is DType.BF16
    assert kv_dtype_from_sglang("fp8_e4m3", DType.BF16) is DType.FP8_E4M3
    assert kv_dtype_from_sglang("fp8_e5m2", DType.BF16) is None
    assert kv_dtype_from_sglang("fp4_e2m1", DType.BF16) is None


def test_bridge_decisions_refuse_unknown_ids() -> None:
    assert BridgeDecision("sglang.engine_rule:x", None, None, None, "m").rule
    with pytest.raises(ValueError, match="unknown bridge rule id"):
        BridgeDecision("sglang.made_up", None, None, None, "m")
    d = BridgeDecision("sglang.declared", None, GraphMode.BREAKABLE, GraphMode.DISABLED, "m")
    assert d.changed and "breakable -> disabled" in d.describe()


def test_register_does_nothing_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("", "0", "false"):
        monkeypatch.setenv(ENV_SWITCH, value)
        assert not plugin.enabled()
        plugin.register()  # imports no sglang, registers nothing
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert plugin.enabled()


def test_plugin_module_imports_no_sglang_or_torch() -> None:
    tree = ast.parse((SRC / "integrations" / "sglang" / "plugin.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith(("sglang", "torch"))]


def test_nothing_in_core_imports_the_integrations() -> None:
    offenders = []
    for path in SRC.rglob("*.py"):
        if "integrations" in path.relative_to(SRC).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and "integrations" in (node.module or ""):
                offenders.append(str(path.relative_to(SRC)))
            if isinstance(node, ast.Import) and any("integrations" in a.name
                                                    for a in node.names):
                offenders.append(str(path.relative_to(SRC)))
    assert offenders == []
    assert "sglang" not in sys.modules or "attnreg.integrations.sglang.steps" in sys.modules


DOC = SRC.parents[1] / "docs" / "integrations" / "sglang.md"


def test_doc_lists_every_bridge_rule_and_backend_name() -> None:
    from attnreg.integrations.sglang.decisions import BRIDGE_RULES

    text = DOC.read_text()
    missing = [f"`{rule}`" for rule in BRIDGE_RULES if f"`{rule}`" not in text]
    missing += [f"`{name}`" for name in (*MAPPED_BACKENDS, *MAPPED_BACKENDS.values(),
                                         *UNMAPPED_BACKENDS, *PLUGIN_BACKENDS,
                                         *DSA_OTHER_KERNELS, "flashmla_kv", "flashmla_sparse",
                                         "flashmla_auto") if f"`{name}`" not in text]
    assert missing == [], f"docs/integrations/sglang.md does not name {missing}"
    assert f"`{ENV_SWITCH}`" in text


@pytest.mark.parametrize("name", ["dsa", "nsa"])
def test_sglang_dsa_backends_by_name_alone_are_a_gap_that_says_why(name: str) -> None:
    # sglang's dsa runs its --dsa-*-backend kernels: the name alone maps to nothing,
    # map_phase maps each phase by its sub-backend (docs/integrations/sglang.md)
    mapping = map_backend(name)
    assert not mapping.mapped
    assert "--dsa-decode-backend" in mapping.reason and "map_phase" in mapping.reason


# -- map_phase: one phase of one server, with the declarations of its platform --------

SM90 = Platform.parse("cuda:sm90")


def _sparse_flashmla(decode: SparseKVFormat | None = SparseKVFormat.FP8_DS_MLA,
                     prefill: SparseKVFormat | None = SparseKVFormat.BF16,
                     platform_reason: str = "") -> Capabilities:
    """A ``flashmla`` declaration with sparse kernels as issue 32 describes FlashMLA's
    (test data: the mapping reads only the phases and row formats)."""
    kernels = tuple(
        SparseKernel(frozenset({phase}), frozenset({DType.BF16}), fmt, page_sizes=(64,),
                     head_counts=(64, 128), top_k_sizes=(2048,), kernel=f"test {phase} kernel")
        for phase, fmt in ((Phase.DECODE, decode), (Phase.PREFILL, prefill)) if fmt is not None)
    return Capabilities(backend="flashmla", platform=SM90, vendors=frozenset({Vendor.CUDA}),
                        kernels=(), graph_modes=(), sparse_kernels=kernels,
                        platform_reason=platform_reason)


def _lookup(caps: Capabilities | None) -> Callable[[str], Capabilities | str]:
    def lookup(name: str) -> Capabilities | str:
        if caps is not None and name == caps.backend:
            return caps
        return f"no attnreg backend {name!r} is registered"
    return lookup


def _dsa(phase: str, sub: str, pool: DType, caps: Capabilities | None = None,
         **kw: object) -> BackendMapping:
    return map_phase("dsa", phase, dsa_backend=sub, kv_dtype=pool, sparse_top_k=2048,
                     lookup=_lookup(caps if caps is not None else _sparse_flashmla()),
                     **kw)  # type: ignore[arg-type]


def test_dsa_flashmla_kv_decode_over_an_fp8_pool_maps_to_flashmla() -> None:
    mapping = _dsa("decode", "flashmla_kv", DType.FP8_E4M3)
    assert (mapping.attnreg, mapping.dsa_backend, mapping.label) == \
        ("flashmla", "flashmla_kv", "dsa (flashmla_kv)")
    assert "flash_mla_with_kvcache" in mapping.reason and "fp8_ds_mla" in mapping.reason
    assert "test decode kernel" in mapping.reason  # the declared kernel that describes it


def test_dsa_flashmla_sparse_prefill_over_a_bf16_pool_maps_and_says_what_runs_eagerly() -> None:
    mapping = _dsa("prefill", "flashmla_sparse", DType.BF16)
    assert mapping.attnreg == "flashmla"
    assert "flash_mla_sparse_fwd" in mapping.reason
    # sglang's short extend batches run dense MHA eagerly, never under a prefill graph
    assert "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD" in mapping.reason
    # flashmla_auto over a bf16 pool always picks flashmla_sparse
    assert _dsa("prefill", "flashmla_auto", DType.BF16).attnreg == "flashmla"


@pytest.mark.parametrize(("phase", "sub", "pool", "says"), [
    # the kernel reads rows the declaration has no kernel for in this phase
    ("prefill", "flashmla_kv", DType.FP8_E4M3, "no sparse prefill kernel over fp8_ds_mla rows"),
    ("decode", "flashmla_sparse", DType.BF16, "no sparse decode kernel over bf16 rows"),
    ("prefill", "flashmla_auto", DType.FP8_E4M3, "no sparse prefill kernel over fp8_ds_mla"),
    # sglang converts rows per call: the kernel does not read the pool's own rows
    ("decode", "flashmla_kv", DType.BF16, "quantizes the whole cache"),
    ("prefill", "flashmla_sparse", DType.FP8_E4M3, "dequantize_k_cache_paged_dsa"),
    ("decode", "flashmla_sparse", DType.FP8_E4M3, "reads bf16 rows"),
    # kernels no attnreg declaration describes
    ("decode", "fa3", DType.BF16, "attnreg declares no FA3 backend"),
    ("decode", "trtllm", DType.FP8_E4M3, "attnreg's trtllm_mla declares dense kernels only"),
    ("prefill", "tilelang", DType.BF16, "tilelang_sparse_fwd"),
    ("prefill", "flashmla_sparse_q8", DType.BF16, "FP8-compute"),
    ("decode", "flashmla_auto", DType.FP8_E4M3, "per-batch prefill choice"),
    ("decode", "made_up", DType.BF16, "does not know"),
    ("decode", None, DType.BF16, "resolved no --dsa-decode-backend"),
])
def test_dsa_combinations_without_a_describing_declaration_are_gaps_naming_the_sub_backend(
        phase: str, sub: str | None, pool: DType, says: str) -> None:
    mapping = _dsa(phase, sub, pool)  # type: ignore[arg-type]
    assert not mapping.mapped and mapping.dsa_backend == sub
    assert says in mapping.reason, mapping.reason
    if sub is not None:
        assert f"--dsa-{phase}-backend {sub}" in mapping.reason


def test_dsa_mapping_needs_the_flashmla_plugin_registered_and_declared_here() -> None:
    missing = map_phase("dsa", "decode", dsa_backend="flashmla_kv", kv_dtype=DType.FP8_E4M3,
                        lookup=_lookup(None))
    assert not missing.mapped and "pip install attnreg-flashmla" in missing.reason
    assert not map_phase("dsa", "decode", dsa_backend="flashmla_kv",
                         kv_dtype=DType.FP8_E4M3).mapped  # no lookup: nothing is registered
    elsewhere = _sparse_flashmla(decode=None, prefill=None,
                                 platform_reason="FlashMLA runs on sm90 only")
    gap = _dsa("decode", "flashmla_kv", DType.FP8_E4M3, elsewhere)
    assert not gap.mapped and "declares no sparse decode kernel" in gap.reason
    assert "FlashMLA runs on sm90 only" in gap.reason
    # a model without RoPE has FlashMLA's 528-byte rows, which attnreg has no format for
    assert "V32_NO_ROPE" in _dsa("decode", "flashmla_kv", DType.FP8_E4M3, rope_dim=0).reason
    # flashmla_auto over an fp8 pool is one kernel before Blackwell, a per-batch choice on it
    assert "per batch" in _dsa("prefill", "flashmla_auto", DType.FP8_E4M3,
                               blackwell=True).reason
    assert map_phase("nsa", "decode", dsa_backend="flashmla_kv", kv_dtype=DType.FP8_E4M3,
                     lookup=_lookup(_sparse_flashmla())).attnreg == "flashmla"


def test_sglang_flashmla_maps_to_the_plugin_when_registered_decode_only() -> None:
    dense = Capabilities(backend="flashmla", platform=SM90, vendors=frozenset({Vendor.CUDA}),
                         kernels=(), graph_modes=())
    decode = map_phase("flashmla", "decode", lookup=_lookup(dense))
    assert decode.attnreg == "flashmla" and "flash_mla_with_kvcache" in decode.reason
    prefill = map_phase("flashmla", "prefill", lookup=_lookup(dense))
    assert not prefill.mapped and "FlashInferMLAAttnBackend" in prefill.reason
    unregistered = map_phase("flashmla", "decode", lookup=_lookup(None))
    assert not unregistered.mapped and "install attnreg-flashmla" in unregistered.reason


@pytest.mark.parametrize("name", ["triton", "trtllm_mla", "flashinfer", "fa4", "flashmla"])
def test_a_dense_sglang_backend_never_maps_for_a_sparse_model(name: str) -> None:
    dense = Capabilities(backend="flashmla", platform=SM90, vendors=frozenset({Vendor.CUDA}),
                         kernels=(), graph_modes=())
    assert map_phase(name, "decode", lookup=_lookup(dense)).mapped  # a dense model
    mapping = map_phase(name, "decode", sparse_top_k=2048, lookup=_lookup(dense))
    assert not mapping.mapped and "dense MLA kernels" in mapping.reason
    assert "top-k 2048" in mapping.reason
    # attnreg's own implementations stay exact (the policy judges their declarations)
    assert map_phase("attnreg_reference", "decode", sparse_top_k=2048).exact


def test_map_phase_agrees_with_map_backend_for_every_name_it_needs_nothing_else_for() -> None:
    for name in (*MAPPED_BACKENDS, *UNMAPPED_BACKENDS, "attnreg_triton", "something", None):
        if name in DSA_BACKENDS or name in PLUGIN_BACKENDS:
            continue
        for phase in ("prefill", "decode"):
            assert map_phase(name, phase) == map_backend(name)


def test_dsa_kernel_use_names_flashmla_kernels_by_their_row_format() -> None:
    use = dsa_kernel_use("flashmla_kv", Phase.DECODE, DType.FP8_E4M3)
    assert isinstance(use, DsaKernelUse) and use.kv_format is SparseKVFormat.FP8_DS_MLA
    assert use.kv_format.row_bytes == 656
    use = dsa_kernel_use("flashmla_sparse", Phase.PREFILL, DType.BF16)
    assert isinstance(use, DsaKernelUse) and use.kv_format is SparseKVFormat.BF16
    assert isinstance(dsa_kernel_use("fa3", Phase.DECODE, DType.BF16), str)
    assert set(DSA_OTHER_KERNELS) >= {"fa3", "trtllm", "tilelang", "triton"}


def test_the_sglang_facts_carry_the_dsa_top_k() -> None:
    from types import SimpleNamespace

    pytest.importorskip("sglang", reason="the facts module reads sglang's config types")
    from attnreg.integrations.sglang.facts import _index_topk

    assert _index_topk(SimpleNamespace(index_topk=2048)) == 2048
    assert _index_topk(SimpleNamespace(text_config=SimpleNamespace(index_topk=512))) == 512
    assert _index_topk(SimpleNamespace()) is None

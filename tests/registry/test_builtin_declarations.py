"""The five built-in declarations hold the hardware facts of SEEDS.md and gpu/README.md."""

from __future__ import annotations

import pytest

from attnreg.registry import (
    Cost,
    ForwardMethod,
    GraphMode,
    Phase,
    SplitKV,
    load_registry,
    validate_capabilities,
)

PLATFORMS = ["cpu", "cuda:sm80", "cuda:sm90", "cuda:sm100", "cuda:sm103", "rocm:gfx942", "npu"]
BUILTINS = ["reference", "triton", "flashinfer_mla", "trtllm_mla", "flash_attn_cute"]


@pytest.fixture(scope="module")
def reg():
    return load_registry(autoload=False)


def test_all_builtins_register_without_errors(reg):
    assert reg.names() == sorted(BUILTINS)
    assert reg.errors == []
    assert all(reg.get(n).plugin == "attnreg.builtin" for n in BUILTINS)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_declarations_validate_everywhere(reg, name, platform):
    assert validate_capabilities(reg.declaration(name, platform), name) == []


def test_trtllm_is_blackwell_only_and_says_so(reg):
    a = reg.availability("trtllm_mla", "cuda:sm90", assume_installed=True)
    assert not a.available and "Blackwell" in a.reason
    assert reg.availability("trtllm_mla", "cuda:sm100", assume_installed=True).available


def test_trtllm_ragged_kernel_takes_only_mha_head_dims(reg):
    caps = reg.declaration("trtllm_mla", "cuda:sm100")
    ragged = caps.kernels_for(ForwardMethod.MHA, Phase.PREFILL)
    assert ragged and all((576, 512) not in k.head_dims for k in ragged)
    assert caps.check_request("mha", "prefill", head_dims=(576, 512))


@pytest.mark.parametrize("mode", [GraphMode.BREAKABLE, GraphMode.TC_PIECEWISE])
def test_trtllm_extend_under_capture_falls_back_high_for_fp8(reg, mode):
    support = reg.declaration("trtllm_mla", "cuda:sm100").graph_support(Phase.PREFILL, mode)
    assert support.capture.is_fallback and support.capture.fallback_to == "flashinfer_mla"
    assert support.capture.cost_for("fp8_e4m3") is Cost.HIGH
    assert support.capture.cost_for("bf16") is Cost.LOW
    assert support.pinned_method is ForwardMethod.MLA


def test_flash_attn_cute_absorbed_path_is_blackwell_only(reg):
    sm90 = reg.declaration("flash_attn_cute", "cuda:sm90")
    assert sm90.methods(Phase.PREFILL) == (ForwardMethod.MHA,)
    assert sm90.graph_support("prefill", "breakable").pinned_method is None
    assert any("Blackwell" in r for _, r in sm90.unavailable_kernels)
    sm100 = reg.declaration("flash_attn_cute", "cuda:sm100")
    assert ForwardMethod.MLA in sm100.methods(Phase.PREFILL)
    breakable = sm100.graph_support("prefill", "breakable")
    assert breakable.pinned_method is ForwardMethod.MLA
    assert breakable.split_kv is SplitKV.SINGLE


def test_reference_refuses_device_capture_but_not_piecewise(reg):
    caps = reg.declaration("reference", "cuda:sm90")
    assert caps.graph_support("decode", "full").capture.is_unsupported
    assert caps.graph_support("prefill", "breakable").capture.is_unsupported
    assert caps.graph_support("prefill", "tc_piecewise").capture.is_native


def test_triton_on_cpu_needs_the_interpreter(reg, monkeypatch):
    from attnreg.backends.declarations import triton
    from attnreg.registry import Platform
    from attnreg.registry.spec import DeclarationContext

    off = triton.capabilities(DeclarationContext(Platform.parse("cpu"), triton_interpreter=False))
    assert "TRITON_INTERPRET=1" in off.platform_reason and not off.kernels
    on = triton.capabilities(DeclarationContext(Platform.parse("cpu"), triton_interpreter=True))
    assert on.kernels and not on.platform_reason


def test_missing_library_is_an_install_hint_not_a_crash(reg):
    a = reg.availability("flashinfer_mla", "cuda:sm90",
                         versions={"flashinfer-python": None})
    if a.available:  # flashinfer happens to be importable here
        pytest.skip("flashinfer is installed in this environment")
    assert "install attnreg[flashinfer]" in a.reason


@pytest.mark.parametrize("platform", ["cuda:sm90", "cuda:sm100"])
def test_triton_decode_entries_split_exactly_where_its_launch_config_changes(reg, platform):
    """The conformance suite claims each decode entry of the declaration at its own
    configurations (captured too), so an entry must not hide a launch configuration
    (``triton_sizing.decode_config``) that computes differently.  At every declared page
    size, head count 1..128 and (q, kv) pair one entry serves the request; over an fp8
    cache entries and configs correspond one to one (two points of one entry run one
    config: 1-16 heads below 64-token pages, 1-16 from them (whole-page tiles, five
    stages), 17-32, 33-128); for every cache two page sizes of one head count share an
    entry exactly when they share a config (a 16-bit cache's config ignores the page).
    A 16-bit cache keeps one entry over its head classes: same dots, q exact."""
    from attnreg.backends.declarations.triton import PAGE_SIZES
    from attnreg.backends.declarations.triton_sizing import decode_config
    from attnreg.registry import DType

    kernels = reg.declaration("triton", platform).kernels_for(ForwardMethod.MLA, Phase.DECODE)
    for q in (DType.BF16, DType.FP16):
        for kv in (q, DType.FP8_E4M3):
            served: dict[tuple[int, int], int] = {}
            for heads in range(1, 129):
                for page in PAGE_SIZES:
                    at = [i for i, k in enumerate(kernels) if q in k.q_dtypes
                          and kv in k.kv_dtypes and page in k.page_sizes
                          and k.accepts_heads(heads)]
                    assert len(at) == 1, (q, kv, heads, page, at)
                    served[heads, page] = at[0]
                    # q rounded to fp8 exactly where the config takes fp8 score dots
                    assert (kernels[at[0]].q_compute_dtype is DType.FP8_E4M3) == \
                        decode_config(heads, kv, page).fp8_scores
            configs: dict[int, set[object]] = {}
            for (heads, page), i in served.items():
                configs.setdefault(i, set()).add(decode_config(heads, kv, page))
            if kv is DType.FP8_E4M3:
                assert all(len(c) == 1 for c in configs.values()), configs
                assert len({next(iter(c)) for c in configs.values()}) == len(configs)
                assert len(configs) == 4
            else:
                assert len(configs) == 1  # one entry, 1..128 heads, every page size
            for heads in range(1, 129):
                for p1 in PAGE_SIZES:
                    for p2 in PAGE_SIZES:
                        same_entry = served[heads, p1] == served[heads, p2]
                        same_config = decode_config(heads, kv, p1) == \
                            decode_config(heads, kv, p2)
                        assert same_entry == same_config, (q, kv, heads, p1, p2)

"""The shape of the runtime package: what it exports, the deprecated re-exports, one
home per fact, one place that captures graphs, typed state instead of string keys, and
the registry's create() taking the platform from the config's device."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import attnreg.runtime as runtime
from attnreg.registry import Vendor, load_registry

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "attnreg"

#: What engines and backends import (issue 15), all from attnreg.runtime.
CONTRACT = ("AttentionBackend", "MLAConfig", "MLAKVPool", "ForwardBatch", "ForwardMetadata",
            "GraphState", "GraphRunner", "decode_batch", "extend_batch")
#: Files that still capture graphs themselves until they are ported onto the runner
#: (issue 15, the lead's part): each entry must still need it, so the list shrinks.
PENDING_PORT = {"src/attnreg/commands/calibrate.py"}
_CAPTURE = re.compile(r"torch\.cuda\.graph\(|CUDAGraph\(")


def test_the_contract_is_exported_from_attnreg_runtime() -> None:
    assert set(CONTRACT) <= set(runtime.__all__)
    for name in runtime.__all__:
        assert getattr(runtime, name) is not None, name


@pytest.mark.parametrize("module, names", [
    ("attnreg.backends.base", ("AttentionBackend", "MLAConfig", "ForwardMetadata",
                               "GraphState", "KernelErrors")),
    ("attnreg.backends.kv_pool", ("MLAKVPool", "PADDING_PAGE", "torch_dtype")),
    ("attnreg.backends.batch", ("ForwardBatch", "decode_batch", "extend_batch")),
])
def test_old_modules_warn_and_re_export_the_same_objects(module: str,
                                                        names: tuple[str, ...]) -> None:
    sys.modules.pop(module, None)
    with pytest.warns(DeprecationWarning, match="import .* from attnreg.runtime"):
        old = importlib.import_module(module)
    for name in names:
        assert getattr(old, name) is getattr(runtime, name), name


def test_base_is_a_thin_shim() -> None:
    assert len((SRC / "backends" / "base.py").read_text().splitlines()) <= 60


def test_nothing_in_src_imports_the_deprecated_modules() -> None:
    absolute = re.compile(r"attnreg\.backends\.(base|kv_pool|batch)\b")
    relative = re.compile(r"from \.(base|kv_pool|batch) import")  # inside attnreg.backends
    shims = {SRC / "backends" / f"{n}.py" for n in ("base", "kv_pool", "batch")}
    pending = {REPO / p for p in PENDING_PORT}
    hits = [f"{p.relative_to(REPO)}:{n}" for p in SRC.rglob("*.py")
            if p not in shims and p not in pending
            for n, line in enumerate(p.read_text().splitlines(), 1)
            if absolute.search(line) or (p.parent.name == "backends" and relative.search(line))]
    assert hits == []


def test_graphs_are_captured_only_by_the_runtime() -> None:
    files = [p for root in ("src", "tests") for p in (REPO / root).rglob("*.py")]
    found = {str(p.relative_to(REPO)) for p in files if _CAPTURE.search(p.read_text())}
    found.discard("tests/runtime/test_package.py")  # this file names the pattern
    allowed = {"src/attnreg/runtime/graph_runner.py"}
    assert found - allowed - PENDING_PORT == set(), "capture through attnreg.runtime.GraphRunner"
    # a ported file leaves the pending list (so the exception cannot outlive the port)
    assert PENDING_PORT <= found, "remove ported files from PENDING_PORT"


def test_no_backend_state_is_kept_under_string_keys() -> None:
    hits = [f"{p.relative_to(REPO)}:{n}" for p in SRC.rglob("*.py")
            for n, line in enumerate(p.read_text().splitlines(), 1) if "extras[" in line]
    assert hits == []


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out.add(("." * node.level) + (node.module or ""))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_flash_attn_cute_does_not_import_the_flashinfer_backend() -> None:
    imports = _imports(SRC / "backends" / "flash_attn_cute.py")
    assert not {m for m in imports if "flashinfer" in m}, imports


@pytest.mark.parametrize("name, where", [
    ("QV_MIN_SM", "declarations/flash_attn_cute.py"),
    ("FLOAT_WORKSPACE_BYTES", "declarations/flashinfer_mla.py"),
    ("TABLE_ALIGN", "declarations/trtllm_mla.py"),
    ("MIN_CHUNK_TOKENS", "declarations/triton_sizing.py"),
    ("EXTEND_MIN_CHUNK_TOKENS", "declarations/triton_sizing.py"),
])
def test_a_constant_has_one_home(name: str, where: str) -> None:
    defined = re.compile(rf"^{name}\s*=", re.MULTILINE)
    homes = [str(p.relative_to(SRC / "backends")) for p in (SRC / "backends").rglob("*.py")
             if defined.search(p.read_text())]
    assert homes == [where]


def test_the_workspace_sizes_are_the_declared_ones() -> None:
    """128 MiB is written once (the flashinfer float workspace and trtllm-gen's workspace
    are two facts, each declared once), never as a literal in a runtime module."""
    literal = re.compile(r"128 \* 1024 \* 1024|128 << 20|134217728")
    runtimes = [p for p in (SRC / "backends").glob("*.py")]
    assert [p.name for p in runtimes if literal.search(p.read_text())] == []


def test_create_takes_the_platform_from_the_configs_device(monkeypatch) -> None:
    from attnreg.registry import Platform

    monkeypatch.delenv("ATTNREG_PLATFORM", raising=False)
    # a GPU machine: detection says cuda, but a cpu config runs on the cpu
    monkeypatch.setattr(Platform, "detect", classmethod(lambda cls: cls.parse("cuda:sm90")))
    reg = load_registry(autoload=False)
    backend = reg.create("reference", runtime.MLAConfig(num_heads=2, device="cpu"))
    assert isinstance(backend, runtime.AttentionBackend)
    assert backend.capabilities.platform.vendor is Vendor.CPU
    explicit = reg.create("reference", runtime.MLAConfig(num_heads=2), platform="cuda:sm90")
    assert explicit.capabilities.platform.vendor is Vendor.CUDA
    # a simulated platform (the benchmarks' dry runs, docs) still wins over the device
    monkeypatch.setenv("ATTNREG_PLATFORM", "cuda:sm90")
    simulated = reg.create("reference", runtime.MLAConfig(num_heads=2, device="cpu"))
    assert simulated.capabilities.platform.vendor is Vendor.CUDA


def test_mla_config_default_context_is_the_policys_estimate_length() -> None:
    from attnreg.graph_policy.config import DEFAULT_MAX_SEQ_LEN

    assert runtime.MLAConfig(num_heads=1).max_context_len == DEFAULT_MAX_SEQ_LEN


def test_typed_state_replaces_the_extras_dicts() -> None:
    for cls in (runtime.ForwardMetadata, runtime.GraphState):
        fields = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
        assert "extras" not in fields and ({"plan"} & fields or {"buffers"} & fields), cls
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.import_module("attnreg.runtime")

"""graph_policy reads declarations, not names, and imports no torch."""

from __future__ import annotations

import ast
import doctest
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnreg import graph_policy

PACKAGE = Path(graph_policy.__file__).parent
#: Presets are data: the one module allowed to name architectures.
DATA_ONLY = {"presets.py"}
ARCHITECTURES = ("deepseek", "kimi", "llama", "qwen", "minimax", "mistral", "mixtral", "glm",
                 "gemma", "nemotron")
BACKENDS = ("trtllm", "flashinfer", "triton", "flash_attn", "flash-attn", "reference", "cutlass",
            "flashmla", "fa3", "fa4")


def rule_sources() -> list[Path]:
    files = sorted(p for p in PACKAGE.glob("*.py") if p.name not in DATA_ONLY)
    assert len(files) >= 10, files  # the package is really being scanned
    return files


@pytest.mark.parametrize("word", ARCHITECTURES + BACKENDS)
def test_no_architecture_or_backend_name_in_policy_code(word: str) -> None:
    pattern = re.compile(re.escape(word), re.IGNORECASE)
    hits = [f"{p.name}:{n}: {line.strip()}" for p in rule_sources()
            for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == [], f"{word!r} appears in graph_policy rule code:\n" + "\n".join(hits)


def test_no_platform_proxy_in_policy_code() -> None:
    for p in rule_sources():
        assert "is_cuda(" not in p.read_text(), p.name


def test_presets_are_the_only_place_with_names() -> None:
    text = (PACKAGE / "presets.py").read_text().lower()
    assert "kimi" in text and "deepseek" in text  # the exclusion above is not vacuous


def _imported_modules(code: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code],
                          capture_output=True, text=True, check=True)
    names = []
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.append(line.rsplit("|", 1)[1].strip())
    assert any(n.startswith("attnreg") for n in names), proc.stderr[-2000:]
    return names


@pytest.mark.parametrize("code", ["import attnreg.graph_policy",
                                  "import attnreg.commands.compat",
                                  "import attnreg.graph_policy as g; g.vote(True)"])
def test_import_pulls_in_no_torch(code: str) -> None:
    heavy = [n for n in _imported_modules(code)
             if n.split(".")[0] in {"torch", "triton", "flashinfer", "numpy"}]
    assert heavy == []


@pytest.mark.parametrize("module", ["resolve", "capture", "config"])
def test_docstring_examples_run(module: str) -> None:
    mod = importlib.import_module(f"attnreg.graph_policy.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0



# -- DESIGN.md "who imports whom" ------------------------------------------------------
_LAYERS = {
    # package -> the attnreg subpackages it must never import (at any point, lazily or not)
    "registry": ("graph_policy", "backends", "testing", "commands", "cli"),
    "graph_policy": ("backends", "testing", "commands", "cli"),
}


def _attnreg_imports(path: Path, package: str) -> list[tuple[int, str]]:
    """``attnreg...`` names imported by a module of ``attnreg.<package>``; for
    ``from M import n`` both ``M`` and ``M.n`` (``n`` may be a submodule)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = ["attnreg", package][: 3 - node.level] if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            out += [(node.lineno, base)]
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return [(n, m) for n, m in out if m == "attnreg" or m.startswith("attnreg.")]


@pytest.mark.parametrize("package", sorted(_LAYERS))
def test_package_imports_only_the_layers_below(package: str) -> None:
    root = PACKAGE.parent / package
    files = sorted(root.glob("*.py"))
    assert len(files) >= 5, files
    forbidden = [f"attnreg.{name}" for name in _LAYERS[package]]
    imported = [(f"{p.name}:{n}", m) for p in files for n, m in _attnreg_imports(p, package)]
    assert any(m.startswith("attnreg.registry") for _, m in imported)  # the scan sees imports
    hits = [f"{where}: {m}" for where, m in imported
            if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert hits == [], f"attnreg.{package} imports a layer above it:\n" + "\n".join(hits)

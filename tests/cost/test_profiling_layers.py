"""attnreg.profiling's place in the layering (DESIGN.md): below commands, torch passed in."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import attnreg.profiling as profiling

PACKAGE = Path(profiling.__file__).parent
REPO = PACKAGE.parents[2]


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def test_profiling_imports_neither_commands_nor_benchmarks() -> None:
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) >= 6, files
    hits = [f"{p.name}: {m}" for p in files for m in _imports(p)
            if m.startswith(("attnreg.commands", "attnreg.cli", "benchmarks"))]
    assert hits == []


def test_no_benchmark_imports_a_command_module() -> None:
    files = sorted((REPO / "benchmarks").glob("*.py"))
    assert len(files) >= 10, files
    hits = [f"{p.name}: {m}" for p in files for m in _imports(p)
            if m.startswith("attnreg.commands")]
    assert hits == []


def test_importing_every_profiling_module_imports_no_torch() -> None:
    code = ("import sys, attnreg.profiling as p\n"
            "[getattr(p, n) for n in p.__all__]\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'triton', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_the_lazy_exports_are_the_public_names() -> None:
    assert sorted(profiling.__all__) == sorted(profiling._WHERE)
    for name in profiling.__all__:
        assert getattr(profiling, name) is not None
    with pytest.raises(AttributeError):
        profiling.not_a_name  # noqa: B018

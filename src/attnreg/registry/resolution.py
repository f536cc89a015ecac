"""Does a runtime dotted path (``package.module:ClassName``) resolve, without importing it?

A backend names its runtime class by dotted path so that listing backends
never imports torch.  That also means a typo in the path, or a module left out
of the wheel, would show only when an engine instantiates the backend.  This
module answers the question at startup cost: it locates the module through
the import system's finders without executing any module code (not even the
parent packages' ``__init__``), then checks that the module's source defines
the name.  When it cannot tell without importing (an extension module, a
module that builds its names dynamically), it says "not checked" rather than
guess.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from importlib.machinery import ModuleSpec
from typing import Any

from .strenum import StrEnum

__all__ = ["RuntimeCheck", "RuntimeState", "check_runtime", "locate_module"]


class RuntimeState(StrEnum):
    RESOLVES = "resolves"
    MISSING = "missing"            # known not to resolve
    NOT_CHECKED = "not_checked"    # cannot tell without importing the module


@dataclass(frozen=True)
class RuntimeCheck:
    """The answer for one dotted path: a state and, unless it resolves, why."""

    runtime: str
    state: RuntimeState
    detail: str = ""

    @property
    def missing(self) -> bool:
        return self.state is RuntimeState.MISSING

    def describe(self) -> str:
        if self.state is RuntimeState.RESOLVES:
            return "resolves"
        if self.state is RuntimeState.MISSING:
            return f"does not resolve: {self.detail}"
        return f"not checked: {self.detail}"

    def to_dict(self) -> dict[str, str]:
        return {"state": self.state.value, "detail": self.detail}


def locate_module(name: str) -> ModuleSpec | None:
    """The spec of module ``name``, found without executing any module code.

    ``importlib.util.find_spec("a.b")`` imports ``a`` first; a plugin package
    whose ``__init__`` imports torch would then be imported into the caller.
    Here each parent is looked up through its spec's search locations instead
    (or through the already-imported parent).  Returns None when the module
    does not exist.  Raises nothing for bad names (returns None).
    """
    if name in sys.modules:
        module = sys.modules[name]
        return getattr(module, "__spec__", None) or ModuleSpec(name, None)
    parts = name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    for i in range(1, len(parts)):
        if spec is None:
            return None
        parent = ".".join(parts[:i])
        loaded = sys.modules.get(parent)
        path = getattr(loaded, "__path__", None) if loaded is not None else \
            spec.submodule_search_locations
        if path is None:
            return None  # the parent is a plain module, not a package
        fullname = ".".join(parts[: i + 1])
        if fullname in sys.modules:
            spec = getattr(sys.modules[fullname], "__spec__", None) or ModuleSpec(fullname, None)
            continue
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, list(path))
        except (ImportError, ValueError):
            return None
    return spec


def check_runtime(runtime: str) -> RuntimeCheck:
    """Whether ``"package.module:ClassName"`` names something that exists (cached per path)."""
    return _check(runtime, _is_imported(runtime))


def _is_imported(runtime: str) -> bool:
    # Whether the module is imported already: an import since the last check
    # makes the definitive attribute check possible.
    return runtime.partition(":")[0] in sys.modules


@lru_cache(maxsize=256)
def _check(runtime: str, _imported: bool) -> RuntimeCheck:
    module_name, _, attr = runtime.partition(":")
    if not module_name or not attr:
        return RuntimeCheck(runtime, RuntimeState.MISSING,
                            "not of the form 'package.module:ClassName'")
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        if _has_path(loaded, attr):
            return RuntimeCheck(runtime, RuntimeState.RESOLVES)
        return RuntimeCheck(runtime, RuntimeState.MISSING,
                            f"module {module_name!r} has no attribute {attr!r}")
    spec = locate_module(module_name)
    if spec is None:
        return RuntimeCheck(runtime, RuntimeState.MISSING, f"no module named {module_name!r}")
    origin = spec.origin or ""
    if not origin.endswith(".py"):
        return RuntimeCheck(runtime, RuntimeState.NOT_CHECKED,
                            f"module {module_name!r} is found but has no Python source to "
                            "read, and importing it could import heavy libraries")
    try:
        with open(origin, encoding="utf-8") as fh:
            source = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        return RuntimeCheck(runtime, RuntimeState.NOT_CHECKED,
                            f"cannot read {module_name!r}: {exc}")
    return _check_source(runtime, module_name, attr, source)


def _has_path(obj: object, attr: str) -> bool:
    for part in attr.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _check_source(runtime: str, module_name: str, attr: str, source: str) -> RuntimeCheck:
    top = attr.split(".")[0]
    # Fast path: a top-level class/def/assignment of the name, or an import of it.
    quick = re.compile(rf"^(?:class|def|async def)\s+{re.escape(top)}\b|^{re.escape(top)}\s*[:=]"
                       rf"|^(?:from\s+\S+\s+)?import\s.*\b{re.escape(top)}\b", re.MULTILINE)
    if quick.search(source):
        return RuntimeCheck(runtime, RuntimeState.RESOLVES)
    import ast  # only when the quick look fails: not on the startup path of a healthy plugin

    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return RuntimeCheck(runtime, RuntimeState.MISSING,
                            f"module {module_name!r} has a syntax error (line {exc.lineno})")
    names: set[str] = set()
    dynamic = False
    for node in _top_level(tree.body):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    dynamic = True
                names.add((alias.asname or alias.name).split(".")[0])
    if top in names:
        return RuntimeCheck(runtime, RuntimeState.RESOLVES)
    if dynamic or "__getattr__" in names or "globals" in source:
        return RuntimeCheck(runtime, RuntimeState.NOT_CHECKED,
                            f"module {module_name!r} may define {top!r} dynamically "
                            "(star import, module __getattr__ or globals())")
    return RuntimeCheck(runtime, RuntimeState.MISSING,
                        f"module {module_name!r} defines no {top!r}")


def _top_level(body: list[Any]) -> list[Any]:
    """Statements at module level, including those inside if/try blocks (optional imports)."""
    import ast

    out: list[Any] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            out.extend(_top_level(node.body) + _top_level(node.orelse))
        elif isinstance(node, ast.Try):
            out.extend(_top_level(node.body) + _top_level(node.orelse)
                       + _top_level(node.finalbody))
            for handler in node.handlers:
                out.extend(_top_level(handler.body))
        elif isinstance(node, (ast.With,)):
            out.extend(_top_level(node.body))
    return out

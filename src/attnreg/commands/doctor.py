"""``attnreg doctor``: what is installed, the detected platform, plugins and their errors.

Every plugin attnreg tried to load is listed, also one that failed to
import, with its distribution and version, what its import and hook call
cost, and the heavy libraries it pulled in.  Every backend is listed with
its plugin, distribution and whether its runtime dotted path resolves
(checked without importing it).  Each plugin error comes with the line that
silences the plugin.

JSON keys: ``platform``, ``libraries``, ``environment``, ``limits
{slow_seconds, heavy_modules}``, ``plugins[PluginInfo.to_dict()]``,
``disabled``, ``backends{name: {plugin, distribution, version, runtime,
runtime_check{state, detail}}}``, ``errors[{plugin, distribution, version,
backend, kind, cause, silence, traceback}]``, ``warnings[{plugin, kind,
message}]``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from attnreg.registry import Platform
from attnreg.registry.spec import installed_version

from ._common import (
    add_json_argument,
    add_plugin_argument,
    add_registry_arguments,
    print_json,
    registry_from,
    table,
)

LIBRARIES = ("attnreg", "pluggy", "torch", "triton", "numpy", "flashinfer-python",
             "flash-attn-4", "nvidia-cutlass-dsl")
ENV_VARS = ("ATTNREG_PLUGINS", "ATTNREG_DISABLE", "ATTNREG_DISABLE_PLUGIN_AUTOLOAD",
            "ATTNREG_SLOW_PLUGIN_SECONDS", "ATTNREG_HEAVY_MODULES", "TRITON_INTERPRET",
            "CUDA_VISIBLE_DEVICES")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_registry_arguments(parser)
    add_plugin_argument(parser)
    add_json_argument(parser)
    parser.add_argument("--traceback", action="store_true",
                        help="show the full traceback of each plugin error")


def collect(args: argparse.Namespace) -> dict[str, Any]:
    # The warnings are part of the report here, not extra lines on stderr.
    reg = registry_from(args, warn=False, report_errors=False)
    backends = {}
    for name in reg.names():
        spec = reg.get(name)
        check = reg.runtime_check(name)
        backends[name] = {"plugin": spec.plugin, "distribution": spec.distribution,
                          "version": spec.distribution_version, "runtime": spec.runtime,
                          "runtime_check": check.to_dict()}
    return {
        "platform": str(Platform.detect()),
        "libraries": {name: installed_version(name) for name in LIBRARIES},
        "environment": {k: os.environ.get(k) for k in ENV_VARS},
        "limits": {"slow_seconds": reg.limits.slow_seconds,
                   "heavy_modules": list(reg.limits.heavy_modules)},
        "plugins": [p.to_dict() for p in reg.plugins],
        "disabled": reg.disabled,
        "backends": backends,
        "errors": [dict(e.to_dict(), silence=e.silence_hint, traceback=e.traceback_text)
                   for e in reg.errors],
        "warnings": [w.to_dict() for w in reg.startup_warnings()],
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _dist(row: dict[str, Any]) -> str:
    return f"{row['distribution']} {row['version']}".strip() or "-"


def _status(plugin: dict[str, Any], errors: list[dict[str, Any]]) -> str:
    if not plugin["loaded"]:
        return "failed"
    return "error" if any(e["plugin"] == plugin["name"] for e in errors) else "ok"


def run(args: argparse.Namespace) -> int:
    data = collect(args)
    if args.json:
        print_json(data)
        return 0
    print(f"platform (detected): {data['platform']}")
    print("\nlibraries")
    print(table(("distribution", "version"),
                [(k, v or "not installed") for k, v in data["libraries"].items()]))
    print("\nenvironment")
    print(table(("variable", "value"),
                [(k, "(unset)" if v is None else repr(v)) for k, v in data["environment"].items()]))
    limits = data["limits"]
    print(f"\nplugins (startup limits: {limits['slow_seconds']:g} s per plugin; heavy "
          f"libraries: {', '.join(limits['heavy_modules']) or 'none'})")
    print(table(("plugin", "distribution", "module", "status", "import", "hook",
                 "heavy imports", "hooks"),
                [(p["name"], _dist(p), p["module"], _status(p, data["errors"]),
                  _ms(p["import_seconds"]),
                  _ms(p["hook_seconds"]) if p["call_order"] is not None else "-",
                  ", ".join(p["heavy_imports"]) or "-", ",".join(p["hooks"]) or "-")
                 for p in data["plugins"]]))
    print("\nbackends")
    print(table(("backend", "plugin", "distribution", "runtime", "resolves"),
                [(name, b["plugin"], _dist(b), b["runtime"],
                  b["runtime_check"]["state"].replace("_", " ")
                  + (f": {b['runtime_check']['detail']}" if b["runtime_check"]["detail"]
                     else ""))
                 for name, b in data["backends"].items()]))
    if data["disabled"]:
        print(f"\ndisabled: {', '.join(data['disabled'])}")
    if data["warnings"]:
        print(f"\nwarnings and notes: {len(data['warnings'])}")
        for w in data["warnings"]:
            print(f"  - {w['message']}")
    print(f"\nplugin errors: {len(data['errors'])}")
    for err in data["errors"]:
        who = f"{err['plugin']} ({_dist(err) if err['distribution'] else 'no distribution found'})"
        if err["backend"]:
            who += f", backend {err['backend']!r}"
        print(f"  - {who}: {err['kind']}: {err['cause']}")
        print(f"    silence it: {err['silence']}")
        if args.traceback and err["traceback"]:
            print("    " + err["traceback"].rstrip().replace("\n", "\n    "))
    return 0

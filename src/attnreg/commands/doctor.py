"""``attnreg doctor``: what is installed, the detected platform, plugins and their errors."""

from __future__ import annotations

import argparse
import os
from typing import Any

from attnreg.registry import Platform
from attnreg.registry.spec import installed_version

from ._common import add_json_argument, add_registry_arguments, print_json, registry_from, table

LIBRARIES = ("attnreg", "pluggy", "torch", "triton", "numpy", "flashinfer-python",
             "flash-attn-4", "nvidia-cutlass-dsl")
ENV_VARS = ("ATTNREG_PLUGINS", "ATTNREG_DISABLE", "ATTNREG_DISABLE_PLUGIN_AUTOLOAD",
            "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_registry_arguments(parser)
    add_json_argument(parser)
    parser.add_argument("--traceback", action="store_true",
                        help="show the full traceback of each plugin error")


def collect(args: argparse.Namespace) -> dict[str, Any]:
    reg = registry_from(args)
    return {
        "platform": str(Platform.detect()),
        "libraries": {name: installed_version(name) for name in LIBRARIES},
        "environment": {k: os.environ.get(k) for k in ENV_VARS},
        "plugins": [p.to_dict() for p in reg.plugins],
        "disabled": reg.disabled,
        "backends": {n: reg.get(n).plugin for n in reg.names()},
        "errors": [dict(e.to_dict(), traceback=e.traceback_text) for e in reg.errors],
    }


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
    print("\nplugins")
    print(table(("plugin", "module", "distribution", "hooks"),
                [(p["name"], p["module"], f"{p['distribution']} {p['version']}".strip(),
                  ",".join(p["hooks"])) for p in data["plugins"]]))
    if data["disabled"]:
        print(f"\ndisabled: {', '.join(data['disabled'])}")
    print(f"\nplugin errors: {len(data['errors'])}")
    for err in data["errors"]:
        who = err["plugin"] + (f" ({err['backend']})" if err["backend"] else "")
        print(f"  - {who}: {err['kind']}: {err['cause']}")
        if args.traceback and err["traceback"]:
            print("    " + err["traceback"].replace("\n", "\n    "))
    return 0

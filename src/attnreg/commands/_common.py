"""Helpers shared by CLI commands: registry options, tables, JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from attnreg.registry import BackendRegistry, Platform, load_registry
from attnreg.registry.resolution import locate_module


def add_registry_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disable", action="append", default=[], metavar="NAME",
                        help="block a plugin or backend by name (repeatable)")


def add_plugin_argument(parser: argparse.ArgumentParser) -> None:
    """``--plugin MODULE[:OBJ]``: try a plugin that is not installed as an entry point."""
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE[:OBJ]",
                        help="also load MODULE (or the object OBJ in it) as an attnreg plugin, "
                             "with the same isolation as an installed one: to try a plugin "
                             "before packaging it (repeatable; its name is the argument)")


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def registry_from(args: argparse.Namespace, *, warn: bool = True,
                  report_errors: bool = True) -> BackendRegistry:
    """The registry for a command's ``--disable`` and ``--plugin`` options.

    With ``warn``, each startup warning (a plugin that imported torch or was
    slow, a backend outranking every built-in) is printed to stderr as one
    line; with ``report_errors``, each plugin error too (commands that list
    errors themselves turn it off).  stderr, so ``--json`` output on stdout
    stays clean.  A ``--plugin`` module that does not exist is bad input: one
    line on stderr, exit 2.
    """
    plugins = list(getattr(args, "plugin", None) or [])
    for path in plugins:
        module = path.partition(":")[0]
        if not module or locate_module(module) is None:
            print(f"attnreg: error: --plugin {path}: no module named {module!r}; check the "
                  "name, or put its directory on PYTHONPATH", file=sys.stderr)
            raise SystemExit(2)
    reg = load_registry(disable=args.disable, extra_plugins=[(p, p) for p in plugins])
    if report_errors:
        for err in reg.errors:
            print(f"attnreg: warning: {err}", file=sys.stderr)
    if warn:
        for warning in reg.startup_warnings():
            print(warning.line(), file=sys.stderr)
    return reg


def parse_platform(text: str | None) -> tuple[Platform, bool]:
    """The platform to report on and whether it was simulated (given) or detected.

    A platform that does not parse is bad input: the message goes to stderr and
    the command exits 2, like an argparse error.
    """
    if text is None or text == "detect":
        return Platform.detect(), False
    try:
        return Platform.parse(text), True
    except ValueError as exc:
        print(f"attnreg: error: --platform: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table; cells are str()-ed, columns padded."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

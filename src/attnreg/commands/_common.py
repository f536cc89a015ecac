"""Helpers shared by CLI commands: registry options, tables, JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from attnreg.registry import BackendRegistry, Platform, load_registry


def add_registry_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disable", action="append", default=[], metavar="NAME",
                        help="block a plugin or backend by name (repeatable)")


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def registry_from(args: argparse.Namespace) -> BackendRegistry:
    return load_registry(disable=args.disable)


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

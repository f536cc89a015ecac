"""Helpers shared by CLI commands: registry options, tables, JSON output.

The conventions every command follows live here, so they cannot drift apart:
``--json`` prints the JSON document on stdout (nothing else goes there),
``-o/--output FILE`` writes it to a file, and tables and long lines fit
:data:`MAX_WIDTH` columns unless ``--wide`` asks for long cells whole.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from attnreg.registry import AttnregError, BackendRegistry, Platform, load_registry
from attnreg.registry.environment import EnvironmentValueError, env_value
from attnreg.registry.jsonfile import write_json
from attnreg.registry.resolution import locate_module


class UsageError(AttnregError):
    """Bad input a command finds itself (an option's value, a module that does not exist).

    ``attnreg``'s error boundary prints it as one line and exits 2.
    """


def check_plugin_modules(plugins: Sequence[str], option: str = "--plugin") -> None:
    """Each ``MODULE[:OBJ]`` of ``plugins`` names a module that exists (not imported here).

    Raises
    ------
    UsageError
        For the first that does not, with what to do.
    """
    for path in plugins:
        module = path.partition(":")[0]
        if not module or locate_module(module) is None:
            raise UsageError(f"{option} {path}: no module named {module!r}; check the name, "
                             "or put its directory on PYTHONPATH")


def check_output_path(path: str, what: str = "the JSON") -> None:
    """Fail early (before a long run) when ``-o PATH`` cannot be written: a directory, or
    a parent directory that cannot be made.

    Raises
    ------
    UsageError
        Naming the path and the problem.
    """
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"-o {path}: is a directory, not a file to write {what} to; give a "
                         "file name")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"-o {path}: cannot write {what} there: {exc.strerror or exc} "
                         f"({exc.filename or p.parent}); check the path") from None


def add_registry_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disable", action="append", default=[], metavar="NAME",
                        help="block a plugin or backend by name (repeatable)")


def add_plugin_argument(parser: argparse.ArgumentParser) -> None:
    """``--plugin MODULE[:OBJ]``: try a plugin that is not installed as an entry point."""
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE[:OBJ]",
                        help="also load MODULE (or the object OBJ in it) as an attnreg plugin, "
                             "with the same isolation as an installed one: to try a plugin "
                             "before packaging it (repeatable; its name is the argument)")


#: Columns a table or a wrapped line may take (``--wide`` lifts the limit).
MAX_WIDTH = 100

#: Where options are added: a parser or one of its argument groups.
Options = argparse.ArgumentParser | argparse._ArgumentGroup


def add_json_argument(parser: Options) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print machine-readable JSON on stdout instead of the table")


def add_output_arguments(parser: argparse.ArgumentParser, *, wide: bool = True) -> None:
    """``--json``, ``-o/--output FILE`` and (for commands that print tables) ``--wide``."""
    add_json_argument(parser)
    parser.add_argument("-o", "--output", default=None, metavar="FILE",
                        help="also write the JSON to FILE")
    if wide:
        add_wide_argument(parser)


def add_wide_argument(parser: Options) -> None:
    parser.add_argument("--wide", action="store_true",
                        help=f"do not wrap long cells and lines to {MAX_WIDTH} columns")


def width_of(args: argparse.Namespace) -> int | None:
    """The width tables and lines wrap to: None (no limit) with ``--wide``."""
    return None if getattr(args, "wide", False) else MAX_WIDTH


def emit_json(args: argparse.Namespace, data: Any) -> None:
    """Write ``data`` to ``--output`` (if given) and print it with ``--json``.

    The line naming the written file goes to stderr, so ``--json`` stdout
    stays one JSON document.  The file is replaced only once the whole
    document is written (a full disk leaves what was there); a failure is a
    ``JSONFileError`` naming the file.
    """
    if getattr(args, "output", None):
        path = write_json(args.output, data, what="the JSON")  # atomic: temp file + rename
        print(f"JSON written to {path}", file=sys.stderr)
    if getattr(args, "json", False):
        print_json(data)


def registry_from(args: argparse.Namespace, *, warn: bool = True,
                  report_errors: bool = True) -> BackendRegistry:
    """The registry for a command's ``--disable`` and ``--plugin`` options.

    With ``warn``, each startup warning (a plugin that imported torch or was
    slow, a backend outranking every built-in) is printed to stderr as one
    line; with ``report_errors``, each plugin error too (commands that list
    errors themselves turn it off).  stderr, so ``--json`` output on stdout
    stays clean.  A ``--plugin`` module that does not exist is bad input: a
    :class:`UsageError` (one line on stderr, exit 2).
    """
    plugins = list(getattr(args, "plugin", None) or [])
    check_plugin_modules(plugins)
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

    ``None`` or ``"detect"``: ``ATTNREG_PLATFORM`` when it is set (a simulated
    platform, as ``--platform`` would give), else this machine's.

    A simulated platform must have an arch attnreg knows (``Platform.arch_known``):
    declarations gate kernels by arch, so a plan for ``cuda:sm999`` would be a
    guess that looks like an answer (docs/policy.md, "Platforms").  A detected
    arch is used as it is.

    Raises
    ------
    UsageError
        ``text`` does not parse, or names an arch attnreg does not know (bad
        input: one line, exit 2).
    EnvironmentValueError
        ``ATTNREG_PLATFORM`` does not parse or names an unknown arch.
    """
    if text is None or text == "detect":
        from_env = env_value("ATTNREG_PLATFORM")
        if from_env is None:
            return Platform.detect(), False
        problem = _unknown_arch(from_env)
        if problem:
            raise EnvironmentValueError("ATTNREG_PLATFORM", os.environ["ATTNREG_PLATFORM"],
                                        problem)
        return from_env, True
    try:
        platform = Platform.parse(text)
    except ValueError as exc:
        raise UsageError(f"--platform: {exc}") from None
    problem = _unknown_arch(platform)
    if problem:
        raise UsageError(f"--platform {platform}: {problem}")
    return platform, True


def _unknown_arch(platform: Platform) -> str | None:
    if platform.arch_known:
        return None
    return (f"attnreg knows no {platform.vendor.value} architecture {platform.arch!r}, and no "
            "declaration was written for it (a plan would be a guess); give one of "
            f"{', '.join(platform.known_archs())}")


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


#: Where a word too long for its column may be broken: after these characters, and
#: only within a piece still too long, after ``_`` (``mha_chunked_kv`` stays whole
#: when the line can break at the ``/`` before it).
_BREAK_AFTER = re.compile(r"(?<=[.:,/=|>])")
_BREAK_AFTER_WEAK = re.compile(r"(?<=_)")
#: A wrapped column is never made narrower than this.
_MIN_WRAP_WIDTH = 16
_GAP = "  "


def wrap(text: str, width: int | None, indent: str = "") -> list[str]:
    """``text`` broken into lines of at most ``width`` characters (None: one line).

    Words break at spaces; a word longer than a line breaks after ``.``, ``:``,
    ``,``, ``/``, ``=``, ``|`` or ``>`` (dotted paths, ``key=value`` lists), then after
    ``_``, and only failing that inside the word.  The first line keeps ``text``'s leading
    spaces; the others start with ``indent`` (counted in ``width``).
    """
    if width is None or len(text) <= width:
        return [text]
    lead = text[:len(text) - len(text.lstrip())]
    # (piece, glued): a glued piece continues the previous one without a space
    tokens = [(piece, k > 0) for word in text.split()
              for k, piece in enumerate(_pieces(word, max(width - len(indent), 1)))]
    lines: list[str] = []
    line = lead
    for piece, glued in tokens:
        prefix = indent if lines else lead
        candidate = line + piece if glued or line == prefix else f"{line} {piece}"
        if len(candidate) <= width or line == prefix:
            line = candidate
        else:
            lines.append(line)
            line = indent + piece
    lines.append(line)
    return lines


def _pieces(word: str, width: int) -> list[str]:
    """``word`` as is when it fits ``width``, else cut at punctuation, else hard."""
    if len(word) <= width:
        return [word]
    parts = [q for p in _BREAK_AFTER.split(word) if p
             for q in ([p] if len(p) <= width else _BREAK_AFTER_WEAK.split(p)) if q]
    out: list[str] = []
    for part in parts:
        while len(part) > width:
            out.append(part[:width])
            part = part[width:]
        out.append(part)
    return out


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *,
          wrap_columns: Collection[str] = (), width: int | None = MAX_WIDTH) -> str:
    """A plain-text table; cells are str()-ed, columns padded.

    A cell may hold several lines (``"\\n"``).  When the table is wider than
    ``width``, the columns named in ``wrap_columns`` are narrowed (widest
    first, none below 16) and their lines wrapped onto continuation lines
    (indented by two); the other columns keep their width.  ``width=None``
    never wraps (``--wide``).
    """
    heads = [str(h) for h in headers]
    body = [[str(c) for c in r] for r in rows]
    widths = [max(len(line) for row in [heads, *body] for line in row[i].split("\n"))
              for i in range(len(heads))]
    wrappable = [i for i, h in enumerate(heads) if h in wrap_columns]
    if width is not None:
        _narrow(widths, wrappable, width, [len(h) for h in heads])
    lines = [_line(heads, widths), _GAP.join("-" * w for w in widths)]
    for row in body:
        cells = [[piece for line in cell.split("\n")
                  for piece in (wrap(line, widths[i], "  ") if i in wrappable else [line])]
                 for i, cell in enumerate(row)]
        for k in range(max(len(c) for c in cells)):
            lines.append(_line([c[k] if k < len(c) else "" for c in cells], widths))
    return "\n".join(lines)


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    return _GAP.join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def _narrow(widths: list[int], wrappable: list[int], width: int, floors: list[int]) -> None:
    """Shrink the wrappable columns until the table fits ``width``.

    The widest is shrunk first, down to the next widest, then both together,
    and so on; none below its floor (16, or its header).  A table that cannot
    fit stays wider.
    """
    def total() -> int:
        return sum(widths) + len(_GAP) * (len(widths) - 1)

    floor = {i: max(_MIN_WRAP_WIDTH, floors[i]) for i in wrappable}
    while total() > width:
        movable = [i for i in wrappable if widths[i] > floor[i]]
        if not movable:
            return
        top = max(widths[i] for i in movable)
        widest = [i for i in movable if widths[i] == top]
        below = max([widths[i] for i in movable if widths[i] < top]
                    + [max(floor[i] for i in widest)])
        # one column at a time, so the excess is never overshot
        cut = min(top - below, total() - width)
        widths[widest[0]] -= max(1, cut) if len(widest) == 1 else 1


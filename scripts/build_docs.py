#!/usr/bin/env python3
"""Regenerate the generated parts of docs/*.md, or check that they are current.

Four kinds of marked blocks are rewritten in place; everything between
markers is hand-written prose and left alone::

    <!-- embed: examples/attnreg-example-backend/src/attnreg_example_backend/plugin.py -->
    ...the file, in a fenced code block...
    <!-- /embed -->

    <!-- cli: backends -->          (a subcommand name, or "attnreg" for the top level)
    ...usage line and options table, built from the argparse parser...
    <!-- /cli -->

    <!-- output: attnreg compat --platform cuda:sm90 -->
    <!-- output[example]: attnreg backends --platform cpu -->
    ...the command and what it printed, from a real run...
    <!-- /output -->

    <!-- table: policy-rules -->     (a name in TABLES: policy-rules, feature-rules, gate-rules)
    ...a markdown table built from attnreg.graph_policy.RULES / FEATURE_RULES...
    <!-- /table -->

``output`` runs the command in a subprocess with a clean environment (no
``ATTNREG_*`` or ``TRITON_INTERPRET`` from the caller, plugin autoload off),
so the text does not depend on the machine; ``output[example]`` runs it with
the example plugin package (``examples/attnreg-example-backend``) installed
and autoloaded.  A command may start with ``VAR=value`` assignments.  The few
parts of an output that differ between machines and runs (library versions
in a conformance header, elapsed time, temporary directories) are replaced by
placeholders.

Usage::

    python scripts/build_docs.py           # rewrite the blocks and docs/capabilities.md
    python scripts/build_docs.py --check   # exit 1 and name the stale blocks

``tests/docs/test_generated_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
EXAMPLE = REPO / "examples" / "attnreg-example-backend"
EXAMPLE_DISTRIBUTION = "attnreg-example-backend"
EXAMPLE_PLUGIN = "example"

#: Environment variables that change what attnreg prints; outputs are rendered without them.
_SENSITIVE_ENV = ("ATTNREG_PLUGINS", "ATTNREG_DISABLE", "ATTNREG_DISABLE_PLUGIN_AUTOLOAD",
                  "ATTNREG_PLATFORM", "TRITON_INTERPRET", "COLUMNS", "PYTHONPATH")

_BLOCK_RE = re.compile(
    r"(?P<open><!-- (?P<kind>embed|cli|table|output(?:\[(?P<variant>[a-z]+)\])?): "
    r"(?P<arg>.+?) -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- /(?P<closekind>embed|cli|table|output) -->)",
    re.DOTALL)

_LANGUAGES = {".py": "python", ".toml": "toml", ".md": "markdown", ".json": "json",
              ".cfg": "ini", ".txt": "text"}


@dataclass(frozen=True)
class Block:
    """One marked block of one page."""

    page: Path
    kind: str  # embed | cli | table | output
    variant: str  # "" or "example" (output only)
    arg: str
    body: str
    start: int
    end: int

    @property
    def label(self) -> str:
        variant = f"[{self.variant}]" if self.variant else ""
        page = self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page
        return f"{page}: {self.kind}{variant}: {self.arg}"


def find_blocks(page: Path) -> list[Block]:
    """Every marked block of ``page``; a mismatched close marker is an error."""
    text = page.read_text()
    blocks = []
    for m in _BLOCK_RE.finditer(text):
        kind = m.group("kind").split("[")[0]
        if kind != m.group("closekind"):
            raise ValueError(f"{page}: block '{m.group('kind')}: {m.group('arg')}' is closed by "
                             f"'/{m.group('closekind')}'")
        blocks.append(Block(page, kind, m.group("variant") or "", m.group("arg").strip(),
                            m.group("body"), m.start("body"), m.end("body")))
    return blocks


def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


# ---------------------------------------------------------------------------------------
# embed
# ---------------------------------------------------------------------------------------
def render_embed(relpath: str) -> str:
    """The file at ``relpath`` (from the repo root) in a fenced block."""
    path = REPO / relpath
    if not path.is_file():
        raise FileNotFoundError(f"embed: {relpath} does not exist")
    text = path.read_text()
    lang = _LANGUAGES.get(path.suffix, "text")
    fence = "````" if "```" in text else "```"
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}\n"


# ---------------------------------------------------------------------------------------
# cli
# ---------------------------------------------------------------------------------------
def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from attnreg.cli import build_parser

    parser = build_parser()
    # argparse has no public accessor for subparsers; _actions is stable since 3.2.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {"attnreg": parser, **dict(action.choices)}
    return {"attnreg": parser}


def _flags(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return ", ".join(action.option_strings)
    if not action.option_strings:
        return action.metavar if isinstance(action.metavar, str) else action.dest.upper()
    metavar = _metavar(action)
    return ", ".join(action.option_strings) + (f" {metavar}" if metavar else "")


def _metavar(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if isinstance(action.metavar, str):
        name = action.metavar
    elif action.choices is not None:
        name = "{" + ",".join(str(c) for c in action.choices) + "}"
    else:
        name = action.dest.upper()
    if action.nargs in ("*", "+"):
        return f"{name} [{name} ...]"
    return name


def _usage_part(action: argparse.Action) -> str:
    if isinstance(action, argparse._SubParsersAction):
        return "COMMAND ..."
    if not action.option_strings:
        return _flags(action)
    if isinstance(action, argparse.BooleanOptionalAction):
        return "[" + " | ".join(action.option_strings) + "]"
    text = f"{action.option_strings[-1]} {_metavar(action)}".strip()
    return text if action.required else f"[{text}]"


def _usage(prog: str, parser: argparse.ArgumentParser, width: int = 96) -> str:
    """A usage line built from the actions, wrapped at ``width``.

    Built here rather than taken from ``format_usage()`` because argparse's
    wording and wrapping change between Python versions, and the staleness
    test must not fail on a different interpreter.
    """
    parts = [_usage_part(a) for a in parser._actions
             if not isinstance(a, (argparse._HelpAction, argparse._VersionAction))
             and a.help != argparse.SUPPRESS]
    lines, line = [], prog
    indent = " " * (len(prog) + 1)
    for part in parts:
        if len(line) + 1 + len(part) > width and line.strip():
            lines.append(line)
            line = indent + part
        else:
            line = f"{line} {part}"
    lines.append(line)
    return "\n".join(lines)


def _default(action: argparse.Action) -> str:
    d = action.default
    if d is None or d is False or d == [] or d == argparse.SUPPRESS or action.nargs == 0:
        return ""
    return f"`{d}`"


def _help(action: argparse.Action) -> str:
    text = (action.help or "").replace("%(default)s", str(action.default))
    if isinstance(action, argparse._AppendAction) and "repeatable" not in text:
        text += " (repeatable)"
    return " ".join(text.split()).replace("|", "/")


def render_cli(name: str) -> str:
    """Usage line and option tables of ``attnreg NAME`` (``attnreg``: the top level)."""
    parsers = _subparsers()
    if name not in parsers:
        raise KeyError(f"cli: no subcommand {name!r}; have {sorted(parsers)}")
    parser = parsers[name]
    prog = "attnreg" if name == "attnreg" else f"attnreg {name}"
    lines = ["```text", _usage(prog, parser), "```", ""]
    skip = (argparse._HelpAction, argparse._SubParsersAction)
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if not isinstance(a, skip) and a.help != argparse.SUPPRESS]
        if not actions:
            continue
        with_default = any(_default(a) for a in actions)
        title = group.title or "options"
        if title not in ("options", "optional arguments", "positional arguments"):
            lines += [f"*{title}*", ""]
        header = "| option | meaning |" + (" default |" if with_default else "")
        lines += [header, "|---|---|" + ("---|" if with_default else "")]
        for a in actions:
            row = f"| `{_flags(a)}` | {_help(a)} |"
            lines.append(row + (f" {_default(a)} |" if with_default else ""))
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# table
# ---------------------------------------------------------------------------------------
def _markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _rules_table(kinds: Sequence[str], columns: Sequence[str]) -> str:
    """The RULES entries of ``kinds``; a column not named here shows the description."""
    from attnreg.graph_policy import RULES

    rows = []
    for rule in RULES.values():
        if rule.kind in kinds:
            cells = {"rule id": f"`{rule.id}`", "severity": rule.severity,
                     "source": rule.source, "reads": rule.reads}
            rows.append([cells.get(c, rule.description) for c in columns])
    return _markdown_table(columns, rows)


def _feature_rules_table() -> str:
    """One row per (feature, severity, reason), its modes merged."""
    from attnreg.graph_policy import FEATURE_RULES

    merged: dict[tuple[str, str, str], list[str]] = {}
    for rule in FEATURE_RULES:
        key = (rule.rule_id, rule.severity.value, rule.reason)
        merged.setdefault(key, []).extend(sorted(m.value for m in rule.modes))
    rows = [[f"`{rule_id}`", ", ".join(sorted(modes)), severity, reason]
            for (rule_id, severity, reason), modes in merged.items()]
    return _markdown_table(("rule id", "mode", "severity", "why"), rows)


#: ``<!-- table: NAME -->`` generators.
TABLES: dict[str, Callable[[], str]] = {
    "policy-rules": lambda: _rules_table(("plan", "error"),
                                         ("rule id", "severity", "source", "reads", "effect")),
    "feature-rules": _feature_rules_table,
    "gate-rules": lambda: _rules_table(("gate",), ("rule id", "severity", "reads", "eager when")),
}


def render_table(name: str) -> str:
    if name not in TABLES:
        raise KeyError(f"table: no generator {name!r}; have {sorted(TABLES)}")
    return TABLES[name]()


# ---------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------
def clean_env(with_example: bool = False, site: Path | None = None) -> dict[str, str]:
    """The environment outputs are rendered in: none of the caller's attnreg settings.

    ``with_example``: autoload on with only the example plugin allowed, and
    ``site`` (the directory the example was installed into, None when it is
    installed in this interpreter already) on PYTHONPATH.  Otherwise autoload
    is off, so plugins installed on this machine cannot change the text.
    """
    env = {k: v for k, v in os.environ.items() if k not in _SENSITIVE_ENV}
    env["COLUMNS"] = "100"
    env["PYTHONIOENCODING"] = "utf-8"
    if not with_example:
        env["ATTNREG_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        return env
    env["ATTNREG_PLUGINS"] = EXAMPLE_PLUGIN
    if site is not None:
        env["PYTHONPATH"] = str(site)
    return env


def example_installed_in_environment() -> bool:
    """Whether this interpreter already has the example package installed (e.g. ``pip -e``)."""
    try:
        importlib.metadata.distribution(EXAMPLE_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def install_example(target: Path) -> None:
    """Install the example package, non-editable, into ``target`` (a throwaway directory).

    The sources are copied first so the in-tree build leaves no ``build/`` or
    ``*.egg-info`` in the repository.  Without network when setuptools is
    importable here (``--no-build-isolation``); otherwise pip fetches setuptools
    from the package index into an isolated build environment.
    """
    src = target.parent / f"{target.name}-src"
    shutil.copytree(EXAMPLE, src, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__",
                                                  ".pytest_cache"))
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--no-deps", "--target", str(target)]
    if importlib.util.find_spec("setuptools") is not None:
        cmd += ["--no-build-isolation", "--no-index"]
    cmd.append(str(src))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"installing the example package failed ({' '.join(cmd)}):\n"
                           f"{proc.stdout}\n{proc.stderr}")


class ExampleSite:
    """Lazily installs the example package once per process, for ``output[example]``."""

    def __init__(self) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._ready = False
        self._path: Path | None = None

    def path(self) -> Path | None:
        """The directory to put on PYTHONPATH; None when the example is installed here."""
        if not self._ready:
            if not example_installed_in_environment():
                self._tmp = tempfile.TemporaryDirectory(prefix="attnreg-example-")
                self._path = Path(self._tmp.name) / "site"
                install_example(self._path)
            self._ready = True
        return self._path

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def run_command(command: str, with_example: bool = False,
                site: Path | None = None) -> tuple[int, str]:
    """Run a documented ``attnreg ...`` command; (exit status, stdout + stderr)."""
    words = shlex.split(command)
    env = clean_env(with_example, site)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
        if key == "ATTNREG_PLUGINS":
            # The command names its plugins with an allowlist, so autoload can be
            # on without plugins installed on this machine leaking into the text.
            env.pop("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", None)
    if not words or words[0] != "attnreg":
        raise ValueError(f"output: only `attnreg ...` commands can be rendered, got {command!r}")
    proc = subprocess.run([sys.executable, "-m", "attnreg", *words[1:]], capture_output=True,
                          text=True, env=env, cwd=REPO, check=False)
    return proc.returncode, (proc.stdout + proc.stderr).rstrip()


#: Parts of real outputs that differ between machines and runs, and what replaces them
#: in the docs: installed library versions (conformance report header) and elapsed time.
_VOLATILE: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^libraries: .*$", re.MULTILINE), "libraries: <the installed versions>"),
    (re.compile(r" in \d+(\.\d+)?s$", re.MULTILINE), " in <elapsed>"),
    (re.compile(r"/[\w./-]*?/attnreg-conformance-\w+/"), "<tmp>/"),
)


def elide_volatile(text: str) -> str:
    """Replace versions and timings, so a rendered output is the same on every machine."""
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    return text


def render_output(command: str, with_example: bool = False, site: Path | None = None) -> str:
    status, text = run_command(command, with_example, site)
    text = elide_volatile(text)
    tail = f"\n(exit status {status})" if status else ""
    fence = "````" if "```" in text else "```"
    return f"{fence}text\n$ {command}\n{text}{tail}\n{fence}\n"


# ---------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------
def render_block(block: Block, example: ExampleSite) -> str:
    if block.kind == "embed":
        return render_embed(block.arg)
    if block.kind == "cli":
        return render_cli(block.arg)
    if block.kind == "table":
        return render_table(block.arg)
    if block.variant not in ("", "example"):
        raise ValueError(f"{block.label}: unknown output variant {block.variant!r}")
    if block.variant == "example":
        return render_output(block.arg, True, example.path())
    return render_output(block.arg)


ALL_KINDS = ("embed", "cli", "table", "output")


def iter_blocks(kinds: Sequence[str] = ALL_KINDS,
                pages: Sequence[Path] | None = None) -> Iterator[Block]:
    for page in pages if pages is not None else doc_pages():
        for block in find_blocks(page):
            if block.kind in kinds:
                yield block


def stale_blocks(kinds: Sequence[str] = ALL_KINDS,
                 pages: Sequence[Path] | None = None) -> list[tuple[Block, str]]:
    """(block, what it should contain) for every block whose text is not current."""
    example = ExampleSite()
    try:
        return [(b, new) for b in iter_blocks(kinds, pages)
                if (new := render_block(b, example)) != b.body]
    finally:
        example.close()


def rewrite(kinds: Sequence[str] = ALL_KINDS,
            pages: Sequence[Path] | None = None,
            log: Callable[[str], None] = print) -> int:
    """Rewrite the stale blocks in place; the number rewritten."""
    stale = stale_blocks(kinds, pages)
    by_page: dict[Path, list[tuple[Block, str]]] = {}
    for block, new in stale:
        by_page.setdefault(block.page, []).append((block, new))
    for page, items in by_page.items():
        text = page.read_text()
        # From the end, so earlier offsets stay valid.
        for block, new in sorted(items, key=lambda item: -item[0].start):
            text = text[:block.start] + new + text[block.end:]
            log(f"updated {block.label}")
        page.write_text(text)
    return len(stale)


def _capability_reference() -> object:
    spec = importlib.util.spec_from_file_location(
        "gen_capability_reference", Path(__file__).with_name("gen_capability_reference.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if any generated block or page is stale")
    parser.add_argument("--kind", action="append", choices=ALL_KINDS,
                        help="only these block kinds (repeatable; default: all)")
    args = parser.parse_args(argv)
    kinds = tuple(args.kind or ALL_KINDS)
    caps = _capability_reference()
    if args.check:
        stale = stale_blocks(kinds)
        for block, _ in stale:
            print(f"stale: {block.label}", file=sys.stderr)
        status = caps.main(["--check"])  # type: ignore[attr-defined]
        if stale:
            print("run `python scripts/build_docs.py` to regenerate", file=sys.stderr)
        return 1 if stale or status else 0
    rewrite(kinds)
    caps.main([])  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())

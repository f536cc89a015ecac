"""Find and run the code of the user docs: fenced blocks, their directives, inline commands.

What a page may contain, and how ``test_doc_snippets.py`` checks it:

* ```` ```pycon ```` blocks: ``>>>`` examples, run by doctest, output compared;
* ```` ```python ```` blocks: run (they must not raise); blocks of one page share
  one namespace, in page order, with its pycon blocks;
* ```` ```bash ```` blocks: every command runs (``attnreg ...``, ``python ...``,
  with ``VAR=value`` prefixes) and must exit 0; the commands of one page run in
  page order in one scratch directory, as a reader runs them, and a
  ``python -m pip install`` installs into a scratch directory that the page's
  later commands see (:func:`pip_install_argv`), never into the environment
  running the tests;
* blocks between generated markers (``<!-- output: ... -->`` and the other
  kinds of ``scripts/build_docs.py``) are checked by ``test_generated_docs.py``;
* any other language (``text``, ``toml``, ``json``) is data, not run, unless a
  directive says it is an excerpt of a command's output.

A directive is an HTML comment on the line right above the fence:

``<!-- doctest: skip: REASON -->``
    not run (it needs a GPU, say); the page must say so in words too.
``<!-- doctest: excerpt of: COMMAND -->``
    the block appears, as is, in what COMMAND prints (``...`` matches anything).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .conftest import DOCS, REPO

#: Pages being rewritten with the runtime (its own branch): their blocks are not run
#: here yet.  To enable one, delete it from this set and run
#: `python -m pytest tests/docs/test_doc_snippets.py`; fix what fails (or mark a
#: GPU-only block with `<!-- doctest: skip: REASON -->` and say so on the page).
PENDING: frozenset[str] = frozenset()

#: Languages that are run; every other fenced block is data (or an excerpt).
PYTHON = ("python", "pycon")
SHELL = ("bash", "sh", "shell", "console")

_FENCE = re.compile(r"^(?P<fence>```+)(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=fence)[ \t]*$",
                    re.DOTALL | re.MULTILINE)
_GENERATED = re.compile(r"<!-- (?:embed|cli|table|output(?:\[[a-z]+\])?): .+? -->\n.*?"
                        r"<!-- /(?:embed|cli|table|output) -->", re.DOTALL)
_DIRECTIVE = re.compile(r"<!-- doctest: (?P<kind>skip|excerpt of): (?P<arg>.*?) -->\s*$")
_INLINE = re.compile(r"(?<!`)`((?:\.venv/bin/)?attnreg [^`\n]+)`(?!`)")


@dataclass(frozen=True)
class Snippet:
    """One fenced block of a page."""

    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    directive: tuple[str, str] | None  # (kind, argument) or None
    generated: bool

    @property
    def label(self) -> str:
        return f"{self.page.name}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        if self.directive and self.directive[0] == "skip":
            return self.directive[1]
        return None


def doc_pages() -> list[Path]:
    """README.md and every page of docs/."""
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def checked_pages() -> list[Path]:
    return [p for p in doc_pages() if p.name not in PENDING]


def snippets(page: Path, text: str | None = None) -> list[Snippet]:
    """Every fenced block of ``page`` (``text``: its contents, when not read from disk)."""
    text = page.read_text() if text is None else text
    generated = [(m.start(), m.end()) for m in _GENERATED.finditer(text)]
    lines = text.split("\n")
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        above = lines[line - 2] if line >= 2 else ""
        d = _DIRECTIVE.search(above)
        out.append(Snippet(page, line, m.group("lang").lower(), m.group("body"),
                           (d.group("kind"), d.group("arg").strip()) if d else None,
                           any(s <= m.start() < e for s, e in generated)))
    return out


def shell_commands(text: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    commands = []
    for line in joined.split("\n"):
        words = shlex.split(line, comments=True)
        if words:
            commands.append(shlex.join(words))
    return commands


def inline_commands(page: Path, text: str | None = None) -> Iterator[tuple[int, str]]:
    """(line, command) for every inline code span that is a whole ``attnreg ...`` command.

    Spans outside fenced blocks only; one with a placeholder or an
    alternative (``[...]``, ``...``, ``|``, ``<...>``) is a usage sketch, not a
    command, and is left out.
    """
    text = page.read_text() if text is None else text
    fenced = [(m.start(), m.end()) for m in _FENCE.finditer(text)]
    for m in _INLINE.finditer(text):
        if any(s <= m.start() < e for s, e in fenced):
            continue
        command = m.group(1)
        if re.search(r"\[|\.\.\.|\||<|>", command):
            continue
        yield text.count("\n", 0, m.start()) + 1, command


def argv_of(command: str) -> tuple[dict[str, str], list[str]]:
    """(environment assignments, argv) of a documented command, ready to run here.

    ``attnreg`` runs as ``python -m attnreg`` and ``python``/``python3`` as this
    interpreter, so the commands run against the code under test.
    """
    words = shlex.split(command)
    env: dict[str, str] = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if not words:
        raise ValueError(f"no command in {command!r}")
    program = words[0].rsplit("/", 1)[-1] if words[0].startswith(".venv/bin/") else words[0]
    if program == "attnreg":
        return env, [sys.executable, "-m", "attnreg", *words[1:]]
    if program in ("python", "python3"):
        return env, [sys.executable, *words[1:]]
    raise ValueError(f"{command!r}: the doc tests run `attnreg` and `python` commands only; "
                     "mark the block `<!-- doctest: skip: REASON -->` if it cannot run here")


def workdir(tmp: Path) -> Path:
    """A scratch directory that looks like the repository root (its entries linked).

    Documented commands use repository paths (``examples/...``, ``tests/...``);
    files they write land in the scratch directory, not in the checkout.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    for entry in REPO.iterdir():
        if entry.name.startswith(".") or entry.name in ("build", "dist"):
            continue
        link = tmp / entry.name
        if not link.exists():
            link.symlink_to(entry, target_is_directory=entry.is_dir())
    return tmp


def is_pip_install(argv: list[str]) -> bool:
    return argv[1:4] == ["-m", "pip", "install"]


def _distribution_name(project: Path) -> str | None:
    """The ``[project] name`` of a source tree's pyproject.toml (None: not found)."""
    pyproject = project / "pyproject.toml"
    if not pyproject.is_file():
        return None
    found = re.search(r'^name\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
    return found.group(1) if found else None


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def pip_install_argv(argv: list[str], cwd: Path, site: Path) -> list[str] | None:
    """A documented ``python -m pip install ...`` as the doc tests run it (None: skip it).

    It installs into ``site`` (``--target``), never into the environment
    running the tests; the page's later commands get ``site`` on PYTHONPATH.
    Local source trees are copied next to ``cwd`` first, so an in-tree build
    leaves no ``build/`` or ``*.egg-info`` in the checkout; ``-e`` is dropped
    (an editable install of a copy would point at the copy, and PYTHONPATH
    does not read the ``.pth`` file that makes it work).  Nothing is fetched:
    ``--no-deps``, and no build isolation when setuptools is importable here.
    A source tree whose distribution this environment already has (a
    developer who followed the tutorial) is not installed twice: None.
    """
    out = [argv[0], "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--no-deps", "--target", str(site)]
    if importlib.util.find_spec("setuptools") is not None:
        out += ["--no-build-isolation", "--no-index"]
    sources = cwd.parent / "pip-src"
    for arg in argv[4:]:
        if arg in ("-e", "--editable"):
            continue
        tree = cwd / arg
        if not arg.startswith("-") and tree.is_dir():
            name = _distribution_name(tree)
            if name is not None and _installed(name):
                return None
            copy = sources / tree.name
            shutil.copytree(tree.resolve(), copy, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__",
                                                          ".pytest_cache"))
            arg = str(copy)
        out.append(arg)
    return out


def run_command(command: str, cwd: Path, base_env: dict[str, str],
                timeout: float = 300, site: Path | None = None
                ) -> subprocess.CompletedProcess[str]:
    """Run a documented command in ``cwd`` with ``base_env`` plus its own assignments.

    ``site``: where a ``pip install`` installs (:func:`pip_install_argv`); it
    goes on every command's PYTHONPATH, after the command's own entries.
    """
    assigned, argv = argv_of(command)
    env = dict(base_env)
    if "ATTNREG_PLUGINS" in assigned:
        # the command names its plugins itself: autoload on, limited to them
        env.pop("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", None)
    env.update(assigned)
    if is_pip_install(argv):
        if site is None:
            raise ValueError(f"{command!r}: a documented pip install runs only with a scratch "
                             "site= (never into the environment running the tests)")
        scratch = pip_install_argv(argv, cwd, site)
        if scratch is None:
            return subprocess.CompletedProcess(argv, 0, "already installed here\n", "")
        argv = scratch
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(site)]))
    if "PYTHONPATH" in env:
        env["PYTHONPATH"] = os.pathsep.join(
            str((cwd / p).resolve()) if p and not os.path.isabs(p) else p
            for p in env["PYTHONPATH"].split(os.pathsep))
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def excerpt_pattern(excerpt: str) -> re.Pattern[str]:
    """A pattern for ``excerpt`` in an output: verbatim, ``...`` matching anything."""
    parts = [re.escape(p) for p in excerpt.rstrip("\n").split("...")]
    return re.compile(".*?".join(parts), re.DOTALL)

"""Every example of the user docs runs as written and prints what the page shows.

README.md and docs/*.md (except the pages in ``snippets.PENDING``): ``pycon``
examples run under doctest with their output compared, ``python`` blocks run,
every command of a ``bash`` block runs and exits 0, an excerpt of a command's
output appears in what the command prints, and every inline ``attnreg ...``
command is accepted by the CLI's parser.  A block that cannot run on a CPU
carries ``<!-- doctest: skip: REASON -->`` (see ``snippets.py``).
Command outputs shown in ``output`` blocks are checked by
``test_generated_docs.py``.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import os
from pathlib import Path

import pytest

from attnreg.cli import build_parser

from . import snippets as sn
from .conftest import DOCS, REPO

OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

#: Kept for test_links.py: every page whose links are checked.
PAGES = tuple(p.name for p in sn.doc_pages() if p.parent == DOCS)


def _name(page: Path) -> str:
    return str(page.relative_to(REPO)) if page.parent == REPO else page.name


def _python_pages() -> list[Path]:
    return [p for p in sn.checked_pages()
            if any(s.lang in sn.PYTHON and not s.generated for s in sn.snippets(p))]


def _shell_snippets(page: Path | None = None) -> list[sn.Snippet]:
    pages = sn.checked_pages() if page is None else [page]
    return [s for p in pages for s in sn.snippets(p)
            if s.lang in sn.SHELL and not s.generated and s.skip_reason is None]


def _excerpts() -> list[sn.Snippet]:
    return [s for p in sn.checked_pages() for s in sn.snippets(p)
            if s.directive and s.directive[0] == "excerpt of"]


def run_python_blocks(page: Path, text: str | None = None) -> list[str]:
    """Run the python and pycon blocks of ``page`` in order, in one namespace; the failures."""
    namespace: dict[str, object] = {"__name__": f"doc_{page.stem}"}
    failures: list[str] = []
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    for snippet in sn.snippets(page, text):
        if snippet.lang not in sn.PYTHON or snippet.generated or snippet.skip_reason:
            continue
        if snippet.lang == "pycon":
            test = doctest.DocTestParser().get_doctest(snippet.text, namespace, _name(page),
                                                       str(page), snippet.line)
            before = runner.failures
            runner.run(test, out=failures.append, clear_globs=False)
            namespace.update(test.globs)  # DocTest works on a copy: later blocks see its names
            if runner.failures > before:
                failures.append(f"(in the pycon block at {snippet.label})\n")
            continue
        # pad with blank lines so a traceback names the line of the page
        code = compile("\n" * snippet.line + snippet.text, str(page), "exec")
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(code, namespace)  # noqa: S102 - the documented example itself
        except Exception as exc:  # noqa: BLE001 - reported with the block's place
            failures.append(f"{snippet.label}: the python block raises "
                            f"{type(exc).__name__}: {exc}\n")
    return failures


#: Pages run only with autoload off: runtime.md names every backend it creates or plans
#: (triton, reference), so installed plugins cannot change what it prints, and its
#: examples are the slowest of the docs (minutes of Triton interpreter).
_AUTOLOAD_OFF_ONLY = frozenset({"runtime.md"})


def _python_cases() -> list[object]:
    return [pytest.param(page, autoload, id=f"{_name(page)}-{autoload}")
            for page in _python_pages() for autoload in ("autoload_off", "autoload_on")
            if autoload == "autoload_off" or page.name not in _AUTOLOAD_OFF_ONLY]


@pytest.mark.parametrize("page,autoload", _python_cases())
def test_python_examples_run_and_print_what_the_page_shows(page, autoload, tmp_path,
                                                          monkeypatch):
    """Also with plugin autoload on (tests/conftest.py turns it off): a reader's
    environment has whatever `make test` installed (the FlashMLA plugin), and an example
    whose output depends on installed plugins must say so and pin its registry."""
    monkeypatch.chdir(tmp_path)  # an example that writes a file writes it here
    if autoload == "autoload_on":
        monkeypatch.delenv("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", raising=False)
        monkeypatch.delenv("ATTNREG_PLUGINS", raising=False)
        monkeypatch.delenv("ATTNREG_DISABLE", raising=False)
    failures = run_python_blocks(page)
    assert failures == [], "".join(failures)


@pytest.fixture(scope="module")
def shell_env(build_docs) -> dict[str, str]:
    """The environment documented commands run in: none of the caller's attnreg settings,
    and nothing written into the checkout through the scratch directory's links."""
    env = build_docs.clean_env()
    env.pop("COLUMNS", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTEST_ADDOPTS"] = "-p no:cacheprovider"
    return env


@pytest.mark.parametrize("page", [p for p in sn.checked_pages() if _shell_snippets(p)],
                         ids=_name)
def test_shell_commands_run(page, shell_env, tmp_path):
    """The page's commands, in page order, in one scratch directory (a reader's shell)."""
    cwd = sn.workdir(tmp_path / "repo")
    failures = []
    for snippet in _shell_snippets(page):
        commands = sn.shell_commands(snippet.text)
        if not commands:
            failures.append(f"{snippet.label}: a shell block without a command")
        for command in commands:
            proc = sn.run_command(command, cwd, shell_env, site=tmp_path / "site")
            if proc.returncode != 0:
                failures.append(f"{snippet.label}: `{command}` exits {proc.returncode}:\n"
                                f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    assert failures == [], "\n".join(failures)


@pytest.mark.parametrize("snippet", _excerpts(), ids=lambda s: s.label)
def test_output_excerpts_are_what_the_command_prints(snippet, shell_env, tmp_path):
    command = snippet.directive[1]
    proc = sn.run_command(command, sn.workdir(tmp_path), shell_env)
    printed = proc.stdout + proc.stderr
    assert sn.excerpt_pattern(snippet.text).search(printed), (
        f"{snippet.label}: the excerpt is not in what `{command}` prints:\n{printed}")


def _inline_commands() -> list[tuple[str, int, str]]:
    return [(_name(p), line, cmd) for p in sn.checked_pages()
            for line, cmd in sn.inline_commands(p)]


def refused(command: str) -> str | None:
    """What the CLI's parser says against ``command`` (None: accepted).  Nothing runs."""
    _, argv = sn.argv_of(command)
    args = argv[3:]  # after `python -m attnreg`
    parser = build_parser(only=args[0] if args else "")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as exc:
        return None if exc.code == 0 else err.getvalue().strip()
    return None


@pytest.mark.parametrize("page", [p for p in sn.checked_pages() if list(sn.inline_commands(p))],
                         ids=_name)
def test_inline_commands_are_accepted_by_the_cli(page):
    """Every inline `attnreg ...` command names options and values the CLI takes."""
    problems = [f"{_name(page)}:{line}: `{command}`: {why}"
                for line, command in sn.inline_commands(page)
                if (why := refused(command)) is not None]
    assert problems == [], "\n".join(problems)


def test_every_block_is_run_skipped_with_a_reason_or_data():
    """No fenced block slips through: each is run, generated, data, or skipped with why."""
    problems = []
    for page in sn.checked_pages():
        for s in sn.snippets(page):
            if s.directive and s.directive[0] == "skip" and not s.directive[1]:
                problems.append(f"{s.label}: a skip without a reason")
            if s.generated:
                continue
            if not s.lang:
                problems.append(f"{s.label}: a fenced block without a language "
                                "(bash, pycon, python, or text for data)")
            first = next((ln.strip() for ln in s.text.splitlines() if ln.strip()), "")
            if s.lang not in sn.PYTHON + sn.SHELL and not s.directive and \
                    first.split(" ")[0] in ("attnreg", "python", "python3", "$", ">>>"):
                problems.append(f"{s.label}: a {s.lang} block that reads like code: label it "
                                "bash/pycon, or mark it an excerpt of a command")
    assert problems == [], "\n".join(problems)


def test_the_runtime_page_runs_its_engine_examples():
    """docs/runtime.md is checked here, with its GraphRunner replays and its engine loop
    (they used to run in tests/runtime, one block at a time)."""
    page = DOCS / "runtime.md"
    assert page in sn.checked_pages()
    blocks = [s.text for s in sn.snippets(page) if s.lang == "pycon" and not s.skip_reason]
    assert any("GraphRunner" in b and ".replay()" in b for b in blocks)
    assert any("capture_pieces" in b for b in blocks) and any("sync(" in b for b in blocks)


def test_pending_pages_exist():
    """The pending list names real pages (delete a name to check its page here)."""
    names = {p.name for p in sn.doc_pages()}
    assert sn.PENDING <= names, sn.PENDING - names


def test_the_checks_cover_examples_of_every_kind():
    """Guards against a parser that silently finds nothing."""
    kinds = {s.lang for p in sn.checked_pages() for s in sn.snippets(p) if not s.generated}
    assert {"pycon", "bash"} <= kinds, kinds
    assert len(_shell_snippets()) >= 5 and _excerpts() and len(_inline_commands()) >= 10


# ------------------------------------------------------------------------------------
# the checks themselves can fail
# ------------------------------------------------------------------------------------
BROKEN_PAGE = '''# A page

```pycon
>>> 1 + 1
3
```

```python
raise RuntimeError("stale example")
```

<!-- doctest: skip: needs a GPU -->
```bash
attnreg conformance --device cuda
```

```bash
attnreg compat --no-such-option  # a comment
attnreg backends \\
    --platform cpu
```

Run `attnreg compat --no-such-option` or `attnreg backends [--json]`.
'''


def test_a_wrong_output_and_a_raising_block_are_reported(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(BROKEN_PAGE)
    failures = "".join(run_python_blocks(page))
    assert "Expected:\n    3\nGot:\n    2" in failures
    assert "page.md:8: the python block raises RuntimeError: stale example" in failures


def test_blocks_directives_and_commands_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(BROKEN_PAGE)
    found = sn.snippets(page)
    assert [(s.line, s.lang, s.skip_reason) for s in found] == [
        (3, "pycon", None), (8, "python", None), (13, "bash", "needs a GPU"),
        (17, "bash", None)]
    assert sn.shell_commands(found[3].text) == ["attnreg compat --no-such-option",
                                                "attnreg backends --platform cpu"]
    assert list(sn.inline_commands(page)) == [(23, "attnreg compat --no-such-option")]


def test_a_failing_command_is_reported(shell_env, tmp_path):
    proc = sn.run_command("attnreg compat --no-such-option", sn.workdir(tmp_path), shell_env)
    assert proc.returncode == 2 and "--no-such-option" in proc.stderr
    assert "--no-such-option" in refused("attnreg compat --no-such-option")
    assert refused("attnreg compat --platform cuda:sm100") is None
    with pytest.raises(ValueError, match="run `attnreg` and `python` commands only"):
        sn.argv_of("make demo")


def test_a_documented_pip_install_goes_to_a_scratch_site(tmp_path, shell_env):
    cwd = sn.workdir(tmp_path / "repo")
    site = tmp_path / "site"
    _, argv = sn.argv_of(".venv/bin/python -m pip install -e examples/attnreg-example-backend")
    with pytest.raises(ValueError, match="never into the environment"):
        sn.run_command(".venv/bin/python -m pip install -e examples/attnreg-example-backend",
                       cwd, shell_env)
    scratch = sn.pip_install_argv(argv, cwd, site)
    if scratch is None:  # this environment has the example already: not installed twice
        assert sn._installed("attnreg-example-backend")
        return
    copy = tmp_path / "pip-src" / "attnreg-example-backend"
    assert scratch[-1] == str(copy) and (copy / "pyproject.toml").is_file()
    assert "-e" not in scratch and scratch[scratch.index("--target") + 1] == str(site)
    assert "--no-deps" in scratch


def test_an_excerpt_matches_verbatim_with_ellipsis_only():
    pattern = sn.excerpt_pattern("a: 1 ... c: 3\n")
    assert pattern.search("x\na: 1 b: 2 c: 3\n")
    assert not pattern.search("a: 1 b: 2 c: 4")


def test_workdir_links_the_repository_without_writing_into_it(tmp_path):
    cwd = sn.workdir(tmp_path)
    assert (cwd / "examples" / "attnreg-example-backend").is_dir()
    assert (cwd / "README.md").is_symlink() and not (cwd / ".git").exists()
    assert os.path.realpath(cwd / "src") == str(REPO / "src")

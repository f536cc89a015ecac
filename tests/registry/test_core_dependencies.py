"""The core (registry, graph_policy, startup CLI commands) needs pluggy and nothing else.

A fresh `pip install attnreg` brings only pluggy, so a module that quietly
imports typing_extensions, numpy or torch works in the dev venv (where torch
pulled them in) and crashes for users.  The subprocess below blocks every
non-stdlib import except pluggy and attnreg, then runs the startup paths.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKER = textwrap.dedent('''
    import sys, importlib.abc
    ALLOWED = {"attnreg", "pluggy"}
    STDLIB = set(sys.stdlib_module_names)
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top in ALLOWED or top in STDLIB or top.startswith("_"):
                return None
            raise ImportError(f"core code imported non-core module {name!r}")
    sys.meta_path.insert(0, Block())
''')


def _run(body: str) -> subprocess.CompletedProcess[str]:
    code = BLOCKER + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, timeout=120)


def test_core_modules_import_with_only_pluggy():
    proc = _run('''
        import attnreg, attnreg.registry, attnreg.graph_policy, attnreg.cli
        import attnreg.backends.builtin
        import attnreg.backends.declarations.triton  # noqa: F401
        print("ok")
    ''')
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_startup_commands_run_with_only_pluggy():
    proc = _run('''
        import os
        os.environ["ATTNREG_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        from attnreg.cli import main
        for argv in (["backends", "--json", "--platform", "cuda:sm90"],
                     ["compat", "--json", "--platform", "cuda:sm100", "--model", "kimi-k2.6"],
                     ["backends", "--platform", "cpu"]):
            rc = main(argv)
            assert rc == 0, (argv, rc)
        print("ok")
    ''')
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("ok"), proc.stderr[-3000:]

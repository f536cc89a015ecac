"""Run ``attnreg conformance`` (or pytest) in a fresh process and read its JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def env(**extra: str) -> dict[str, str]:
    """The test environment plus ``tests/conformance`` on PYTHONPATH (planted plugins)."""
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), out.get("PYTHONPATH", "")) if p)
    out.update(extra)
    return out


def conformance(tmp_path: Path, *args: str, timeout: float = 1200
                ) -> tuple[int, str, dict[str, Any] | None]:
    """(exit code, stdout + stderr, parsed report or None)."""
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "attnreg", "conformance", "--output", str(report), *args],
        check=False, cwd=tmp_path, env=env(),
        capture_output=True, text=True, timeout=timeout)
    data = json.loads(report.read_text()) if report.exists() else None
    return proc.returncode, proc.stdout + proc.stderr, data


def by_status(data: dict[str, Any], status: str) -> dict[str, str]:
    """claim id -> message, for the claims of ``status``."""
    return {c["id"]: c["message"] for c in data["claims"] if c["status"] == status}

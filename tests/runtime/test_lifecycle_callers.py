"""Only the runtime, the backends (which implement them) and the engine bridges (which
adapt an engine's own graph runner) call the capture lifecycle methods; everything else
that captures goes through GraphSession, so what is proven is what is measured."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CALL = re.compile(r"init_forward_metadata_(capture|replay)\(|init_cuda_graph_state\(")
ALLOWED = ("src/attnreg/runtime/", "src/attnreg/backends/", "src/attnreg/integrations/")


def test_only_the_runtime_backends_and_bridges_drive_the_capture_lifecycle() -> None:
    offenders = []
    for top in ("src", "benchmarks", "scripts"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(ALLOWED):
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if CALL.search(line) and not line.lstrip().startswith("#"):
                    offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == [], "capture through attnreg.runtime.GraphSession instead:\n" + \
        "\n".join(offenders)

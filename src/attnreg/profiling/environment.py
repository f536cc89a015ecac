"""What every measurement records about where it ran: library versions, the machine's load."""

from __future__ import annotations

import os
import platform
import sys

__all__ = ["VERSIONED", "library_versions", "load_average"]

#: Distributions whose versions a measurement records (read without importing them).
VERSIONED = ("attnreg", "torch", "triton", "flashinfer-python", "flash-attn-4",
             "nvidia-cutlass-dsl", "numpy", "pluggy", "matplotlib")


def library_versions() -> dict[str, str | None]:
    """``{distribution: version or None}`` for :data:`VERSIONED`, plus ``python`` and ``cuda``.

    ``cuda`` is torch's CUDA version, read only when torch is already imported
    (a start-up measurement must not import it).
    """
    from attnreg import __version__
    from attnreg.registry.spec import installed_version

    out: dict[str, str | None] = {d: installed_version(d) for d in VERSIONED}
    out["attnreg"] = __version__  # also right when run from a source tree (PYTHONPATH=src)
    out["python"] = platform.python_version()
    torch = sys.modules.get("torch")
    out["cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    return out


def load_average() -> list[float] | None:
    """1/5/15-minute load averages (None where the OS has none): other work on a shared
    machine widens a host-bound figure's spread, so it is recorded beside it."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None

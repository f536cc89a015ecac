"""Platforms: where kernels run (vendor + architecture).

``Platform.parse("cuda:sm90")`` for simulated platforms; ``Platform.detect()``
asks torch lazily (only if it is installed) and falls back to ``cpu``.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

from .strenum import StrEnum

__all__ = ["Platform", "Vendor"]


class Vendor(StrEnum):
    CUDA = "cuda"
    ROCM = "rocm"
    NPU = "npu"
    XPU = "xpu"
    CPU = "cpu"



_ARCH_RE = re.compile(r"^(sm|gfx)(\d+)([a-z]?)$")


@dataclass(frozen=True, order=True)
class Platform:
    """A vendor and an architecture string (``sm90``, ``sm100``, ``gfx942``, or empty)."""

    vendor: Vendor
    arch: str = ""

    @classmethod
    def parse(cls, text: str | Platform) -> Platform:
        """Parse ``vendor[:arch]``: ``cuda:sm90``, ``cuda:sm_100a``, ``rocm:gfx942``, ``cpu``."""
        if isinstance(text, Platform):
            return text
        raw = str(text).strip().lower()
        vendor_text, _, arch = raw.partition(":")
        try:
            vendor = Vendor(vendor_text)
        except ValueError:
            allowed = ", ".join(v.value for v in Vendor)
            raise ValueError(
                f"unknown platform vendor {vendor_text!r} in {text!r}; expected one of "
                f"{allowed}, optionally with an arch, e.g. 'cuda:sm90' or 'rocm:gfx942'"
            ) from None
        arch = arch.replace("_", "")
        if arch.startswith("sm") and arch.endswith("a"):
            arch = arch[:-1]  # sm90a / sm100a: same family for declarations
        if arch and not _ARCH_RE.match(arch):
            raise ValueError(f"cannot parse architecture {arch!r} in {text!r}; "
                             "expected e.g. sm90, sm100, gfx942")
        if vendor is Vendor.CUDA and arch and not arch.startswith("sm"):
            raise ValueError(f"a cuda platform needs an sm arch, got {arch!r} in {text!r}; "
                             "expected e.g. cuda:sm90")
        return cls(vendor, arch)

    @classmethod
    def detect(cls) -> Platform:
        """Detect the current device, cheaply.

        Order: ``ATTNREG_PLATFORM`` (e.g. ``cuda:sm100``) if set; torch if it is
        already imported; ``cpu`` when the machine has no GPU device nodes (no
        torch import); ``nvidia-smi``'s compute capability; finally torch,
        imported lazily.  Startup queries therefore never pay for torch on a
        CPU-only machine.
        """
        override = os.environ.get("ATTNREG_PLATFORM")
        if override:
            return cls.parse(override)
        if "torch" not in sys.modules and not _has_gpu_device_nodes():
            return cls(Vendor.CPU)
        if "torch" not in sys.modules:
            found = _nvidia_smi_platform()
            if found is not None:
                return found
        return cls._detect_with_torch()

    @classmethod
    def _detect_with_torch(cls) -> Platform:
        try:
            import torch
        except ImportError:
            return cls(Vendor.CPU)
        try:
            if torch.cuda.is_available():
                if getattr(torch.version, "hip", None):
                    name = torch.cuda.get_device_properties(0).gcnArchName
                    return cls(Vendor.ROCM, name.split(":")[0].lower())
                major, minor = torch.cuda.get_device_capability(0)
                return cls(Vendor.CUDA, f"sm{major}{minor}")
            if hasattr(torch, "xpu") and torch.xpu.is_available():
                return cls(Vendor.XPU)
        except Exception:  # a broken driver must not break a startup query
            return cls(Vendor.CPU)
        return cls(Vendor.CPU)

    @property
    def sm(self) -> int | None:
        """The CUDA compute capability as an int (``sm90`` -> 90), else None."""
        if self.vendor is Vendor.CUDA and self.arch.startswith("sm"):
            return int(self.arch[2:])
        return None

    def is_cuda_at_least(self, sm: int) -> bool:
        return self.sm is not None and self.sm >= sm

    @property
    def has_device_graphs(self) -> bool:
        """Whether the platform can capture device graphs at all (CUDA/HIP graphs)."""
        return self.vendor in (Vendor.CUDA, Vendor.ROCM)

    def __str__(self) -> str:
        return f"{self.vendor.value}:{self.arch}" if self.arch else self.vendor.value


def _has_gpu_device_nodes() -> bool:
    """NVIDIA (/dev/nvidia0...) or AMD (/dev/kfd) device nodes exist."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def _nvidia_smi_platform() -> Platform | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()[0] if out.strip() else ""
    major, _, minor = first.strip().partition(".")
    if not (major.isdigit() and minor.isdigit()):
        return None
    return Platform(Vendor.CUDA, f"sm{int(major)}{int(minor)}")

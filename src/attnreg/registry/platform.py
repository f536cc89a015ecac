"""Platforms: where kernels run (vendor + architecture).

``Platform.parse("cuda:sm90")`` for simulated platforms; ``Platform.detect()``
asks torch lazily (only if it is installed) and falls back to ``cpu``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = ["Vendor", "Platform"]


class Vendor(str, enum.Enum):
    CUDA = "cuda"
    ROCM = "rocm"
    NPU = "npu"
    XPU = "xpu"
    CPU = "cpu"

    def __str__(self) -> str:
        return self.value


_ARCH_RE = re.compile(r"^(sm|gfx)(\d+)([a-z]?)$")


@dataclass(frozen=True, order=True)
class Platform:
    """A vendor and an architecture string (``sm90``, ``sm100``, ``gfx942``, or empty)."""

    vendor: Vendor
    arch: str = ""

    @classmethod
    def parse(cls, text: "str | Platform") -> "Platform":
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
            raise ValueError(f"a cuda platform needs an sm arch, got {arch!r} in {text!r}")
        return cls(vendor, arch)

    @classmethod
    def detect(cls) -> "Platform":
        """Detect the current device through torch, imported lazily; ``cpu`` without it."""
        try:
            import torch  # noqa: PLC0415 - lazy on purpose: startup must not need torch
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

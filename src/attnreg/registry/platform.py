"""Platforms: where kernels run (vendor + architecture), and what each one can capture.

``Platform.parse("cuda:sm90")`` for simulated platforms (a known GPU name such
as ``"h200"`` parses to its platform too); ``Platform.detect()`` asks torch
lazily (only if it is installed) and falls back to ``cpu``.

Two tables are data, not code, so that a new vendor or GPU is a row:

* :data:`PLATFORM_TRAITS`: per vendor, whether device graphs exist (and
  through which API), and whether a plan needs an architecture;
* :data:`KNOWN_DEVICES`: GPUs by name with their platform and memory, which
  the graph policy's default capture budget is a fraction of.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .environment import env_value
from .strenum import StrEnum

__all__ = ["KNOWN_DEVICES", "PLATFORM_TRAITS", "DeviceInfo", "Platform", "PlatformTraits",
           "Vendor", "detect_device_memory", "known_device"]


class Vendor(StrEnum):
    CUDA = "cuda"
    ROCM = "rocm"
    NPU = "npu"
    XPU = "xpu"
    CPU = "cpu"


@dataclass(frozen=True)
class PlatformTraits:
    """What a vendor's platforms can do, as far as graph capture is concerned.

    Parameters
    ----------
    device_graphs
        whether the vendor's torch extension can record and replay device
        graphs.  ``full``, ``breakable`` and ``tc_piecewise`` all need them
        (tc_piecewise captures each torch.compile piece as a device graph);
        where they exist, each backend's declaration says which modes work.
    graph_api
        the API that provides them (for messages and docs).
    arch_required
        backends gate kernels on the architecture, so a plan for this vendor
        needs one (``cuda`` alone is refused with the list of archs).
    archs
        architectures attnreg knows for the vendor (listed in that refusal).
        ``Platform.parse`` accepts any other arch of the right form (a detected
        GPU newer than this table is planned from its declarations); the
        ``attnreg`` commands refuse a *given* (simulated) arch outside this
        list (docs/policy.md, "Platforms").
    """

    vendor: Vendor
    device_graphs: bool
    graph_api: str
    arch_required: bool = False
    archs: tuple[str, ...] = ()


#: The platform capability table.  npu and xpu graphs exist (torch_npu's
#: NPUGraph, torch.xpu's XPUGraph); whether a backend's kernels capture under
#: them is the backend's declaration, not the platform's.
PLATFORM_TRAITS: Mapping[Vendor, PlatformTraits] = MappingProxyType({
    Vendor.CUDA: PlatformTraits(Vendor.CUDA, True, "CUDA graphs (torch.cuda.CUDAGraph)",
                                arch_required=True,
                                archs=("sm80", "sm86", "sm89", "sm90", "sm100", "sm103",
                                       "sm120")),
    Vendor.ROCM: PlatformTraits(Vendor.ROCM, True, "HIP graphs (torch.cuda.CUDAGraph on ROCm)",
                                arch_required=True, archs=("gfx90a", "gfx942", "gfx950")),
    Vendor.NPU: PlatformTraits(Vendor.NPU, True, "NPU graphs (torch_npu.npu.NPUGraph)"),
    Vendor.XPU: PlatformTraits(Vendor.XPU, True, "XPU graphs (torch.xpu.XPUGraph)"),
    Vendor.CPU: PlatformTraits(Vendor.CPU, False, "none (eager only)"),
})

_GB = 1000 ** 3


@dataclass(frozen=True)
class DeviceInfo:
    """A GPU attnreg knows by name: its platform and its memory.

    ``memory_bytes`` is the vendor's datasheet capacity (decimal GB), not a
    measurement; an engine passes the size it sees
    (``EngineFacts.device_memory_bytes``, ``attnreg compat --device-memory``).
    """

    name: str
    label: str
    vendor: Vendor
    arch: str
    memory_bytes: int

    @property
    def platform(self) -> Platform:
        return Platform(self.vendor, self.arch)


def _device(name: str, label: str, vendor: Vendor, arch: str, gb: int) -> DeviceInfo:
    return DeviceInfo(name, label, vendor, arch, gb * _GB)


#: Known GPUs by lower-case name (``--platform h200``).  Sizes from the vendors'
#: datasheets: HGX/DGX totals divided by the GPU count where only those are given.
KNOWN_DEVICES: Mapping[str, DeviceInfo] = MappingProxyType({d.name: d for d in (
    _device("a100", "A100 80GB", Vendor.CUDA, "sm80", 80),
    _device("l40s", "L40S", Vendor.CUDA, "sm89", 48),
    _device("h100", "H100 80GB", Vendor.CUDA, "sm90", 80),
    _device("h20", "H20", Vendor.CUDA, "sm90", 96),
    _device("h200", "H200", Vendor.CUDA, "sm90", 141),
    _device("b200", "B200", Vendor.CUDA, "sm100", 180),
    _device("gb200", "GB200", Vendor.CUDA, "sm100", 186),
    _device("b300", "B300", Vendor.CUDA, "sm103", 288),
    _device("gb300", "GB300", Vendor.CUDA, "sm103", 288),
    _device("mi300x", "MI300X", Vendor.ROCM, "gfx942", 192),
    _device("mi325x", "MI325X", Vendor.ROCM, "gfx942", 256),
    _device("mi355x", "MI355X", Vendor.ROCM, "gfx950", 288),
)})


def known_device(text: str | Platform) -> DeviceInfo | None:
    """The known GPU named ``text`` (``"h200"``, ``"H200"``), else None."""
    if isinstance(text, Platform):
        return None
    return KNOWN_DEVICES.get(str(text).strip().lower().replace("-", ""))


#: An arch: ``sm`` or ``gfx``, at most 4 digits (no GPU has more; a 20,000-digit "arch"
#: is refused here rather than failing later in ``int()``), an optional letter.
def _clip(text: object) -> str:
    """``repr(text)``, cut to a readable length (a message stays one short line)."""
    shown = repr(str(text))
    return shown if len(shown) <= 40 else f"{shown[:32]}...' ({len(str(text))} characters)"


_ARCH_RE = re.compile(r"^(sm|gfx)(\d{1,4})([a-z]?)$")


@dataclass(frozen=True, order=True)
class Platform:
    """A vendor and an architecture string (``sm90``, ``sm100``, ``gfx942``, or empty)."""

    vendor: Vendor
    arch: str = ""

    @classmethod
    def parse(cls, text: str | Platform) -> Platform:
        """Parse ``vendor[:arch]`` (``cuda:sm90``, ``cuda:sm_100a``, ``rocm:gfx942``, ``cpu``)
        or a known GPU name (``h200`` -> ``cuda:sm90``, see :data:`KNOWN_DEVICES`)."""
        if isinstance(text, Platform):
            return text
        device = known_device(text)
        if device is not None:
            return device.platform
        raw = str(text).strip().lower()
        vendor_text, _, arch = raw.partition(":")
        try:
            vendor = Vendor(vendor_text)
        except ValueError:
            allowed = ", ".join(v.value for v in Vendor)
            raise ValueError(
                f"unknown platform vendor {_clip(vendor_text)} in {_clip(text)}; expected one of "
                f"{allowed}, optionally with an arch, e.g. 'cuda:sm90' or 'rocm:gfx942', "
                f"or a GPU name ({', '.join(KNOWN_DEVICES)})"
            ) from None
        arch = arch.replace("_", "")
        if arch.startswith("sm") and arch.endswith("a"):
            arch = arch[:-1]  # sm90a / sm100a: same family for declarations
        if arch and not _ARCH_RE.match(arch):
            raise ValueError(f"cannot parse architecture {_clip(arch)}; expected e.g. sm90, "
                             "sm100, gfx942")
        if vendor is Vendor.CUDA and arch and not arch.startswith("sm"):
            raise ValueError(f"a cuda platform needs an sm arch, got {arch!r} in {_clip(text)}; "
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
        override = env_value("ATTNREG_PLATFORM")  # EnvironmentValueError when it does not parse
        if override is not None:
            return override  # type: ignore[no-any-return]
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
    def traits(self) -> PlatformTraits:
        """The vendor's row of :data:`PLATFORM_TRAITS`."""
        return PLATFORM_TRAITS[self.vendor]

    @property
    def has_device_graphs(self) -> bool:
        """Whether the platform can capture device graphs at all (:data:`PLATFORM_TRAITS`)."""
        return self.traits.device_graphs

    @property
    def arch_missing(self) -> bool:
        """True when a plan needs an arch (cuda, rocm) and none was given."""
        return self.traits.arch_required and not self.arch

    @property
    def arch_known(self) -> bool:
        """Whether attnreg knows the arch (:attr:`PlatformTraits.archs`), or the vendor
        lists none (npu, xpu, cpu: any arch, or none, is fine)."""
        return not self.traits.archs or not self.arch or self.arch in self.traits.archs

    def known_archs(self) -> tuple[str, ...]:
        """``vendor:arch`` for each arch attnreg knows for the vendor."""
        return tuple(f"{self.vendor.value}:{a}" for a in self.traits.archs)

    def default_device(self) -> DeviceInfo | None:
        """The known GPU of this platform with the least memory (a conservative default
        for the capture budget), or None when attnreg knows none."""
        found = [d for d in KNOWN_DEVICES.values()
                 if d.vendor is self.vendor and d.arch == self.arch]
        return min(found, key=lambda d: (d.memory_bytes, d.name)) if found else None

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


def detect_device_memory() -> int | None:
    """Bytes of memory of device 0, or None when there is no GPU or it cannot be asked.

    Order: torch if it is already imported (``total_memory``), else
    ``nvidia-smi`` (``memory.total``); torch is never imported for this.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return int(torch.cuda.get_device_properties(0).total_memory)
        except Exception:  # a broken driver must not break a startup query
            return None
        return None
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()[0].strip() if out.strip() else ""
    return int(first) * 1024 * 1024 if first.isdigit() else None

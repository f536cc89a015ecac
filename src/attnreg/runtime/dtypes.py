"""torch helpers shared by the runtime and the backends: dtypes and devices."""

from __future__ import annotations

import torch

from attnreg.registry import DType

__all__ = [
    "FP8_E4M3_MAX",
    "device_num_sms",
    "device_sm",
    "dtype_from_torch",
    "resolve_device",
    "torch_dtype",
]

#: Largest finite float8_e4m3fn value; writes clamp to it (an overflow would become NaN).
FP8_E4M3_MAX = 448.0

_TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.BF16: torch.bfloat16,
    DType.FP16: torch.float16,
    DType.FP32: torch.float32,
    DType.FP8_E4M3: torch.float8_e4m3fn,
}


def torch_dtype(dtype: DType | str) -> torch.dtype:
    """The torch dtype of an attnreg :class:`~attnreg.registry.DType` (or its name)."""
    return _TORCH_DTYPES[DType.parse(dtype)]


def dtype_from_torch(dtype: torch.dtype) -> DType | None:
    """The attnreg DType of a torch dtype, or None when attnreg has no name for it."""
    for name, tdt in _TORCH_DTYPES.items():
        if tdt == dtype:
            return name
    return None


def resolve_device(device: str | torch.device) -> torch.device:
    """``torch.device`` with an explicit index for CUDA (``"cuda"`` -> ``cuda:<current>``).

    Tensors report ``cuda:0``, and ``torch.device("cuda") != torch.device("cuda:0")``,
    so device checks compare resolved devices.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def device_sm(device: torch.device) -> int | None:
    """Compute capability of a CUDA device as an int (``90``), None for other devices."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def device_num_sms(device: torch.device) -> int | None:
    """Multiprocessors of a CUDA device, None for other devices."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(device).multi_processor_count)

"""torch helpers shared by the runtime and the backends: dtypes, devices, and the one way
a kernel that computes in fp8 rounds q (``quantize_q_fp8``)."""

from __future__ import annotations

import torch

from attnreg.registry import DType

from ._optional import triton_kernel_module

__all__ = [
    "FP8_E4M3_MAX",
    "device_num_sms",
    "device_sm",
    "dtype_from_torch",
    "output_dtype",
    "quantize_q_fp8",
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


def output_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The dtype of attention's output (and of the new KV rows an engine hands with it)
    for queries of ``q_dtype``: the query's own, bf16 for an fp8 query.

    An fp8 query is the model's bf16 query that the engine rounded for a kernel that
    declares fp8 among its ``q_dtypes`` (it comes with its ``q_scale``); the model around
    the attention still runs in bf16.
    """
    return torch.bfloat16 if q_dtype == torch.float8_e4m3fn else q_dtype


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


#: float32 bit fields: the mantissa, the exponent, and 254 << 23 (the bits of 1 / 2**e are 254 << 23 minus those of 2**e)
_F32_MANTISSA, _F32_EXPONENT, _F32_TWO_254 = 0x7FFFFF, 0x7F800000, 254 << 23

#: attnreg's convention for a kernel that rounds q (``KernelConstraints.q_compute_dtype``
#: fp8; docs/decisions.md, "A kernel that rounds q declares it"): one power-of-two scale
#: per batch, the smallest ``s`` with ``max|q| / s <= 448`` over the batch's real query
#: rows, then one round to nearest fp8 e4m3.  The conformance oracle
#: (``attnreg.testing.workload.round_q``) rounds the same way, bit for bit.
def quantize_q_fp8(q: torch.Tensor, live_rows: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_fp8, descale)``: ``q`` rounded to float8_e4m3fn with one power-of-two scale.

    ``live_rows`` (``q``'s leading dims before the last two: one entry per query row;
    bool, or int32 read as nonzero = live, so a decode's ``seq_lens`` serves as is and
    costs no comparison launch) says which rows set the scale (padded rows of a
    replayed graph hold stale values, possibly inf or NaN, and are left out).
    ``descale`` is float32 ``(1,)`` with ``q ~ q_fp8 * descale``; ``max|q| = 0`` gives
    the smallest normal float32 scale, never 0.  No host read: it runs inside a captured
    graph.

    A CUDA q runs as two fused Triton launches when triton imports
    (``attnreg.runtime._quantize_q_kernel``); everything else runs the torch form, whose
    bits the fused form reproduces.
    """
    if q.is_cuda:
        fused = triton_kernel_module("_quantize_q_kernel")
        if fused is not None and fused.supports(q, live_rows):
            return fused.quantize_q_fp8_fused(q, live_rows)
    return _quantize_q_fp8_torch(q, live_rows)


def _quantize_q_fp8_torch(q: torch.Tensor, live_rows: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_q_fp8` in torch ops: the CPU path, the fallback, and the
    specification the fused kernel is tested against."""
    # Twelve launches, three passes over q (issue 31: the plugin's FP8 decode paid +47 us
    # for the eighteen launches and four passes this took before); the bits are the same.
    # H200, in a graph: ~26 us at q [8, 128, 576] (34.5 before); the inf-norm is 2.3x
    # faster than abs + amax at [128, 128, 576].
    # max|q| per row in float32 in one pass (no |q| copy): an inf-norm is exact
    row_amax = torch.linalg.vector_norm(q, float("inf"), dim=(-2, -1), dtype=torch.float32)
    # torch.where, not a product: a stale padded row holding inf or NaN must not leak in
    live = live_rows if live_rows.dtype == torch.bool else live_rows != 0
    # no rows (an idle rank's batch) set no scale: the smallest, as for max|q| = 0 (amax of
    # an empty tensor raises); numel is the shape's, so no host read inside a capture
    masked = torch.where(live, row_amax, 0.0)
    amax = masked.amax() if masked.numel() else masked.new_zeros(())
    ratio = torch.clamp(amax / FP8_E4M3_MAX, min=torch.finfo(torch.float32).tiny)
    # a live inf / NaN: scale 1 (what frexp's exponent 0 gave before), q's cast says the rest
    ratio = torch.nan_to_num(ratio, nan=1.0, posinf=1.0)
    # the smallest power of two >= ratio from its float32 bits: a nonzero mantissa rounds the
    # exponent up, an exact power is kept (ratio is a positive normal float32 here)
    bits = (ratio.view(torch.int32) + _F32_MANTISSA) & _F32_EXPONENT
    descale = bits.view(torch.float32).reshape(1)
    # 1 / 2**e from the bits as well ((254 - e) << 23; e in [-126, 120]): exact, one launch
    inv = (_F32_TWO_254 - bits).view(torch.float32)
    # a power of two scales exactly in any dtype with float32's exponent range (bf16,
    # fp32): q is multiplied in its own dtype, no float32 copy; fp16's range is not
    # float32's (2**k may not fit), so fp16 is scaled in float32.  The factor is cast to
    # q's dtype first: a mixed bf16 x float32 multiply was 1.3x slower on the H200
    wide = q if q.dtype in (torch.bfloat16, torch.float32) else q.float()
    q_fp8 = (wide * inv.to(wide.dtype)).to(torch.float8_e4m3fn)
    return q_fp8, descale

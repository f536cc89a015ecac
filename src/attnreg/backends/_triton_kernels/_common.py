"""Shared helpers of the Triton MLA kernels: input validation and small device helpers.

Validation runs on the host *before* any launch and never reads device memory (no
``.item()``, no ``.cpu()``), so it is safe inside ``torch.cuda.CUDAGraph`` capture.
Every failure is a ``ValueError`` that names the argument, what was expected and what
was got; the backend layer turns these into the library's ``UnsupportedError``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

# the power-of-two fp8 scale: one formula for the runtime's per-batch rounding and the
# decode's per-row one
from attnreg.runtime._quantize_q_kernel import pow2_scale

#: Storage dtypes accepted for queries / outputs.
Q_DTYPES = (torch.bfloat16, torch.float16)
#: Storage dtypes accepted for the MLA KV cache (fp8 needs ``kv_scale``).
KV_FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)

LOG2E = 1.4426950408889634
#: ln(2): the kernels keep log-sum-exps in the log2 domain; LSE outputs are natural logs.
#: A ``tl.constexpr``: compiled kernels may read no other kind of global (the CPU
#: interpreter would accept a float, the sm90 compiler refuses it).
LN2 = tl.constexpr(0.6931471805599453)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether the kernels must upcast dot operands to fp32.

    The Triton CPU interpreter (checked with triton 3.9) stores bf16 as raw uint16 and its
    ``tl.dot`` multiplies those integers, so a bf16 dot returns garbage there.  Under the
    interpreter we therefore upcast bf16 operands to fp32 (exact) before every dot.  On a
    GPU this is never done: the tensor cores take bf16 directly.
    """
    return interpreting() and dtype == torch.bfloat16


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def split_pow2(d: int) -> tuple[int, int]:
    """Split a head dim into (power-of-two main part, power-of-two padded remainder).

    ``tl.arange`` needs power-of-two lengths, so e.g. 192 -> (128, 64), 576 -> (512, 64),
    128 -> (128, 0), 96 -> (64, 32).  The remainder is loaded with a mask when the true
    remainder is not itself a power of two.
    """
    main = 1 << (int(d).bit_length() - 1)
    rest = d - main
    return main, (next_pow2(rest) if rest > 0 else 0)


def _fmt_shape(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensor(name: str, t, *, ndim: int | None = None,
                 dtypes: Sequence[torch.dtype] | None = None,
                 device: torch.device | None = None,
                 last_contiguous: bool = True) -> None:
    """Raise ValueError unless ``t`` is a tensor of the given rank / dtype / device."""
    if not isinstance(t, torch.Tensor):
        # ValueError, not TypeError, for every bad input: the backend layer maps
        # ValueError to the library's UnsupportedError.
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor, got {_fmt_shape(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: expected dtype {want}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (same device as q), "
                         f"got one on {t.device}")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), "
                         f"got strides {tuple(t.stride())}")


def check_lse(lse, rows: int, heads: int, device) -> None:
    """``lse`` must be None or a float32 ``[rows, heads]`` tensor on ``device``, heads contiguous."""
    if lse is None:
        return
    check_tensor("lse", lse, ndim=2, dtypes=(torch.float32,), device=device)
    if tuple(lse.shape) != (rows, heads):
        raise ValueError(f"lse: expected shape {(rows, heads)}, got {tuple(lse.shape)}")


def lse_launch_args(lse, stride_name: str, store: bool = True) -> dict:
    """The LSE keywords of a JIT launch: store into ``lse`` [rows, H] float32 when given
    (``store`` False: this launch leaves it to another kernel, e.g. the split merge)."""
    if lse is None or not store:
        return {}
    return {"LSE": lse, stride_name: lse.stride(0), "STORE_LSE": True}


def check_index(name: str, t, *, ndim: int, device: torch.device,
                shape0: int | None = None) -> None:
    """Index tensors must be int32 on q's device; int64 is refused, never converted.

    Converting silently would allocate (not allowed under CUDA-graph capture) and hide a
    caller bug, so an int64 tensor is an error that names the tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(  # noqa: TRY004 (see check_tensor)
            f"{name}: expected an int32 torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name}: expected dtype torch.int32, got {t.dtype} "
                         f"(convert it once with .to(torch.int32) outside the hot path)")
    check_tensor(name, t, ndim=ndim, device=device)
    if shape0 is not None and t.shape[0] != shape0:
        raise ValueError(f"{name}: expected {shape0} entries along dim 0, "
                         f"got {_fmt_shape(t)}")


def check_kv_scale(kv_scale, kv_cache: torch.Tensor) -> None:
    if isinstance(kv_scale, torch.Tensor):
        if kv_scale.numel() != 1 or not kv_scale.is_floating_point() or \
                kv_scale.dtype == KV_FP8_DTYPE:
            raise ValueError(f"kv_scale: expected a float or a 1-element float32/bf16/fp16 "
                             f"tensor, got {_fmt_shape(kv_scale)}")
        if kv_scale.device != kv_cache.device:
            raise ValueError(f"kv_scale: expected a tensor on {kv_cache.device}, got one on "
                             f"{kv_scale.device}")
    elif not isinstance(kv_scale, (int, float)):
        raise ValueError(  # noqa: TRY004 (see check_tensor)
            f"kv_scale: expected a float, got {type(kv_scale).__name__}")


def kv_dtypes_for(q_dtype: torch.dtype) -> tuple:
    return (q_dtype,) + ((KV_FP8_DTYPE,) if KV_FP8_DTYPE is not None else ())


# ----------------------------------------------------------------------------------------
# Device helpers shared by the kernels
# ----------------------------------------------------------------------------------------

@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32; see :func:`dot_upcast` for why UPCAST exists."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def to_fp8(x, EMULATE: tl.constexpr):
    """float32 ``x`` (within +-448) rounded to nearest-even fp8 e4m3.

    EMULATE (the CPU interpreter only): the interpreter's conversion gets a rounding that
    carries into the next power of two wrong (31.9 -> 16, not 32; triton 3.x), so the
    value is rounded to 3 mantissa bits in float32 first (subnormals to a multiple of
    2**-9) and the conversion of an exact value is left to it.
    """
    if EMULATE:
        bits = x.to(tl.int32, bitcast=True)
        lsb = (bits >> 20) & 1
        normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
        sub = (x + 24576.0) - 24576.0  # 1.5 * 2**14: rounds to a multiple of 2**-9
        x = tl.where(tl.abs(x) < 0.015625, sub, normal)
    return x.to(tl.float8e4nv)


@triton.jit
def round_q_rows_fp8(q_row, offs_lat, offs_pe, mask_h, EMULATE: tl.constexpr):
    """``(q_lat, q_pe, scale)``: the query rows at ``q_row`` (one per head, masked by
    ``mask_h``; latent columns ``offs_lat``, rope columns ``offs_pe``) rounded to fp8 e4m3
    with one power-of-two ``scale`` per row over its 576 values (``q ~ q_fp8 * scale``),
    attnreg's ``q_compute_scale`` "row" convention (``attnreg.testing.workload.round_q``
    rounds the same way).  EMULATE: see :func:`to_fp8`."""
    q_lat = tl.load(q_row + offs_lat[None, :], mask=mask_h[:, None], other=0.0).to(tl.float32)
    q_pe = tl.load(q_row + offs_pe[None, :], mask=mask_h[:, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(q_lat), 1), tl.max(tl.abs(q_pe), 1))
    scale, inv = pow2_scale(amax)
    return (to_fp8(q_lat * inv[:, None], EMULATE), to_fp8(q_pe * inv[:, None], EMULATE),
            scale)


@triton.jit
def fp8_to_fp16_in_registers(x, EMULATE: tl.constexpr):
    """fp8 e4m3 ``x`` as fp16 (exact), converted where it is held: four values per packed
    conversion pair.  The compiler moves a plain ``x.to(tl.float16)`` that feeds a dot after
    the operand's shared-memory read, which for an operand whose K is not the contiguous
    dimension reads one byte per instruction; inline asm is not moved.  EMULATE (the CPU
    interpreter, which runs no asm): the plain conversion."""
    if EMULATE:
        return x.to(tl.float16)
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def kv_tile_fp8(KV, row, offs_lat, offs_pe, mask_n):
    """One tile of an fp8 cache for fp8 x fp8 score dots: ``(k_lat [lat, N], k_pe [64, N],
    v [N, lat])``, the K parts fp8 as stored, ``v`` converted to fp16 (exact) for a 16-bit
    P @ V.  Masked rows read 0.

    Tried and removed (issue 31, ``scripts/probe_triton_fp8_mma.py`` at 72b60ec on the
    H200): an fp8 P @ V (P scaled by 256), with V as loaded or from a second, transposed
    load: 4-5x slower at 64+ heads (2653-2843 vs 524-549 us at B=128, L=4096, H=128), as
    Triton feeds the transposed fp8 operand from shared memory byte by byte.
    """
    kv_row = KV + row[:, None]
    kv = tl.load(kv_row + offs_lat[None, :], mask=mask_n[:, None], other=0.0)
    kpe = tl.load(kv_row + offs_pe[None, :], mask=mask_n[:, None], other=0.0)
    return tl.trans(kv), tl.trans(kpe), kv.to(tl.float16)


@triton.jit
def tile_rows(KV, pt_row, n0, mask_n, stride_kvp, stride_kvr, PAGE_SIZE: tl.constexpr,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, ONE_PAGE: tl.constexpr):
    """``(base, row)``: token ``n0 + i`` of the tile starts at ``base + row[i]`` in the cache.

    ONE_PAGE (only when a page holds at least one tile; the host decides): tiles start at
    multiples of BLOCK_N (see ``_split_chunk``) and both are powers of two, so the whole
    tile lies in one page: one scalar page-table read, a scalar base pointer and
    loop-invariant int32 row offsets.  Per-token gathers (36 page loads and their 64-bit
    address arithmetic per thread per tile at BLOCK_N = 64, 4 warps) pushed the 16-head
    decode at page size 64 to 255 registers and 50 bytes spilled.  Otherwise one page
    index is gathered per token.
    """
    offs = tl.arange(0, BLOCK_N)
    if ONE_PAGE:
        page = tl.load(pt_row + n0 // PAGE_SIZE)
        base = KV + page.to(tl.int64) * stride_kvp + (n0 % PAGE_SIZE) * stride_kvr
        return base, offs * stride_kvr
    else:
        offs_n = n0 + offs
        if MASKED:
            page = tl.load(pt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        else:
            page = tl.load(pt_row + offs_n // PAGE_SIZE)
        return KV, page.to(tl.int64) * stride_kvp + (offs_n % PAGE_SIZE) * stride_kvr


@triton.jit
def kv_tile(KV, row, offs_lat, offs_pe, mask_n, DT: tl.constexpr, MASKED: tl.constexpr,
            KV_FP8: tl.constexpr, TWO_LOADS: tl.constexpr):
    """Load one tile of the latent cache and return its dot operands in dtype ``DT``:
    ``(k_lat [lat, N], k_pe [64, N], v [N, lat])`` (the K parts transposed for the scores,
    the latent part also the V of ``P @ V``).

    ``row`` [N] is each token's element offset from ``KV``; ``mask_n`` [N] its validity
    (used when MASKED).  A 16-bit tile is loaded once and read by both dots from shared
    memory.  An fp8 tile must become 16-bit for the dots:

    * by default ``.to(DT)`` once, and the compiler places the conversion: the wgmma
      kernels (64-row tiles) convert into a 16-bit shared tile; at 16 heads (mma.sync)
      Triton moves the conversion after the shared-memory read, reading the transposed
      fp8 operand one byte per instruction, and spills (255 registers, 136 bytes);
    * TWO_LOADS: load the tile a second time, transposed, for the scores (an L2 hit), each
      copy converted in its own dot's operand layout: asynchronous loads, no spill, 1.7x
      faster at 16 heads (with fp16 ``DT``: e4m3 -> fp16 is one packed instruction per two
      values, e4m3 -> bf16 has none on sm90).

    Tried and removed (issue 20 sweeps, H200): converting after the transpose (the same
    code at 16 heads, 250 KB of shared memory at 64), integer-shift conversion (slower
    everywhere), and a packed inline-asm conversion into one 16-bit shared tile read by
    both dots (asm is not moved by the compiler): 225.9 vs 223.1 us at B=128, L=4096,
    H=16 and no gain at B=32; it won only at B=1 with 64-token tiles and 8 warps (30.5
    vs 34.7 us), a config that loses at the larger batches (254.8 vs 223.1).
    """
    kv_row = KV + row[:, None]
    if MASKED:
        kv = tl.load(kv_row + offs_lat[None, :], mask=mask_n[:, None], other=0.0)
        kpe = tl.load(kv_row + offs_pe[None, :], mask=mask_n[:, None], other=0.0)
    else:
        kv = tl.load(kv_row + offs_lat[None, :])
        kpe = tl.load(kv_row + offs_pe[None, :])
    if KV_FP8:
        if TWO_LOADS:
            kv_col = KV + row[None, :]
            if MASKED:
                k_t = tl.load(kv_col + offs_lat[:, None], mask=mask_n[None, :], other=0.0)
                kpe_t = tl.load(kv_col + offs_pe[:, None], mask=mask_n[None, :], other=0.0)
            else:
                k_t = tl.load(kv_col + offs_lat[:, None])
                kpe_t = tl.load(kv_col + offs_pe[:, None])
            return k_t.to(DT), kpe_t.to(DT), kv.to(DT)
        else:
            kv = kv.to(DT)
            return tl.trans(kv), tl.trans(kpe.to(DT)), kv
    else:
        return tl.trans(kv), tl.trans(kpe), kv

"""Backends as the benchmarks see them: through the registry, like an engine would.

A :class:`Variant` is one row of a table: a registry backend plus the options it
is created with (flashinfer's fa3 / fa2 kernels are two variants of
``flashinfer_mla``).  :func:`available_variants` asks the registry which of
them can run here and keeps the reason for the others, so a table always says
why a backend is missing from it.

Also a float32 decode reference for spot checks of the outputs that are timed
(random pools and relative errors are :mod:`attnreg.profiling`'s).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from ._harness import RunContext, error_text

__all__ = [
    "DECODE_VARIANTS",
    "PREFILL_VARIANTS",
    "Variant",
    "available_variants",
    "checked_output",
    "create_backend",
    "declared_reasons",
    "planned_splits",
    "reference_decode",
    "worst_row_rel_error",
]


@dataclass(frozen=True)
class Variant:
    """A backend row: registry name, a label for tables and the create options.

    ``page_size`` is the KV-pool page size the row runs at; None means the
    section's own (P1: page 1).  A backend that declares other page sizes only
    (FlashMLA: 64) gets its own pool of the same data layout at that size.
    """

    label: str
    backend: str
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    page_size: int | None = None


#: Decode rows of P1.  flashinfer on sm90 defaults to fa3; fa2 is its other kernel.
DECODE_VARIANTS: tuple[Variant, ...] = (
    Variant("triton", "triton"),
    Variant("flashinfer_mla/fa3", "flashinfer_mla", {"mla_backend": "fa3"}),
    Variant("flashinfer_mla/fa2", "flashinfer_mla", {"mla_backend": "fa2"}),
    Variant("trtllm_mla", "trtllm_mla"),
    Variant("flash_attn_cute", "flash_attn_cute"),
    # FlashMLA's dense decode takes page size 64 only (plugins/attnreg-flashmla); triton
    # beside it at the same page size, so both peers of issue 20 are in one run.
    Variant("triton (page 64)", "triton", page_size=64),
    Variant("flashmla (page 64)", "flashmla", page_size=64),
)

#: Backends of the prefill and P4 comparisons (each with its default kernels).
PREFILL_VARIANTS: tuple[Variant, ...] = (
    Variant("triton", "triton"),
    Variant("flashinfer_mla", "flashinfer_mla"),
    Variant("trtllm_mla", "trtllm_mla"),
    Variant("flash_attn_cute", "flash_attn_cute"),
)


def _registry() -> Any:
    from attnreg.registry import get_registry
    return get_registry()


def available_variants(ctx: RunContext, variants: tuple[Variant, ...] | list[Variant]
                       ) -> tuple[list[Variant], dict[str, str]]:
    """Variants whose backend the registry says can run here, and why the others cannot.

    In a dry run on a CPU machine only backends available on ``cpu`` are kept
    (the Triton kernels under the interpreter, the torch reference).
    """
    reg = _registry()
    runnable: list[Variant] = []
    skipped: dict[str, str] = {}
    for v in variants:
        try:
            avail = reg.availability(v.backend)
        except Exception as exc:  # noqa: BLE001 - an unknown/broken plugin is a row, not a crash
            skipped[v.label] = error_text(exc)
            continue
        if avail.available:
            runnable.append(v)
        else:
            skipped[v.label] = avail.reason or "not available here"
    return runnable, skipped


def declared_reasons(ctx: RunContext, variant: Variant, method: str, phase: str, *,
                     heads: int, head_dims: tuple[int, int], page_size: int | None = 1,
                     dtype: str = "bf16") -> list[str]:
    """Why the backend's declaration refuses this request here (empty: it is declared).

    Asked before a backend runs, so an undeclared combination (flash_attn_cute's
    absorbed decode on sm90, say) is a "not declared" cell with the declaration's
    own words rather than an error.
    """
    reg = _registry()
    from attnreg.registry import Platform
    caps = reg.declaration(variant.backend, Platform.detect())
    return list(caps.check_request(method, phase, head_dims=head_dims, q_dtype=dtype,
                                   kv_dtype=dtype, page_size=page_size, num_heads=heads))


def create_backend(ctx: RunContext, variant: Variant, **config: Any) -> Any:
    """``get_registry().create(variant.backend, MLAConfig(**config), **variant.options)``."""
    from attnreg.runtime import MLAConfig
    config.setdefault("device", ctx.device)
    return _registry().create(variant.backend, MLAConfig(**config), **variant.options)


def planned_splits(md: Any) -> int | None:
    """The static split-KV count in a forward's metadata: ``TritonPlan.splits``.

    None for metadata without a Triton plan (other backends plan their splits
    inside their libraries).  The Triton backend's module is looked up, not
    imported: a plan of its class exists only once it was loaded, and a machine
    without triton cannot import it.
    """
    triton_mla = sys.modules.get("attnreg.backends.triton_mla")
    plan = getattr(md, "plan", None)
    if triton_mla is not None and isinstance(plan, triton_mla.TritonPlan):
        return int(plan.splits)
    return None


def worst_row_rel_error(torch: Any, out: Any, ref: Any) -> float:
    """The largest ``||out[b] - ref[b]|| / ||ref[b]||`` over ``ref``'s rows (sequences);
    inf when ``out`` holds a NaN or an inf there.

    Per row, not over the whole tensor: one wrong sequence of 128 would weigh a twelfth
    in the tensor's norm and could pass a tolerance the row itself misses by far.
    """
    o, r = out[:ref.shape[0]].float().flatten(1), ref.float().flatten(1)
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    per_row = torch.linalg.vector_norm(o - r, dim=1) / torch.linalg.vector_norm(
        r, dim=1).clamp_min(1e-30)
    return float(per_row.max())


def checked_output(ctx: RunContext, out: Any, ref: Any, max_rel_err: float) -> dict[str, Any]:
    """A timed path's correctness entry: ``out``'s rows against the reference's
    (``rel_err``: the worst sequence's, ``correct``), and an ``error`` when it is off by
    more than ``max_rel_err`` (such a path is reported, not timed)."""
    err = worst_row_rel_error(ctx.torch, out, ref)
    res: dict[str, Any] = {"rel_err": err, "correct": err <= max_rel_err}
    if not res["correct"]:
        res["error"] = f"output off the float32 reference by {err:.2e}; not timed"
    return res


def reference_decode(ctx: RunContext, q: Any, pool: Any, page_table: Any, seq_lens: list[int],
                     sm_scale: float, rows: int | None = None) -> Any:
    """float32 absorbed decode ``[B, H, 512]`` of every sequence (or the first ``rows``):
    a kernel wrong only in its last programs shows only in the last sequences."""
    torch = ctx.torch
    ps = pool.page_size
    outs = []
    for b in range(q.shape[0] if rows is None else min(rows, q.shape[0])):
        length = int(seq_lens[b])
        t = torch.arange(length, device=q.device)
        kv = pool.buffer[page_table[b, t // ps].long(), t % ps].float()
        scores = (q[b].float() @ kv.T) * sm_scale
        outs.append(torch.softmax(scores, -1) @ kv[:, :512])
    return torch.stack(outs)

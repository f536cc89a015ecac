"""The sparse (DSA) MLA claims of a declaration and the checks that prove them.

Claims come from ``Capabilities.sparse_kernels`` and ``sparse_graph_modes`` (see
docs/sparse.md), never from the dense kernels:

* ``eager .../sparse/...`` - each sparse kernel configuration computes what the
  float64 sparse oracle (:mod:`attnreg.testing.sparse`) computes on every sparse
  batch of its phase (top-k below, equal to and above the visible tokens, unsorted,
  repeated slots, rows of only -1), with its log-sum-exp where declared, writes the
  new rows and nothing else;
* ``refusal .../sparse_index`` - an index that is neither -1 nor a pool slot (-2, the
  pool's size) and int64 indices are refused with ``UnsupportedError`` naming the
  index, before the kernel runs (the output and the pool untouched);
* ``capture .../sparse_refuses_capture`` - a sparse (phase, mode) declared
  UNSUPPORTED is refused when a sparse forward runs under ``capturing(mode)``;
* ``capture .../sparse_replay`` - a sparse (phase, mode) declared NATIVE is captured
  once through :class:`~attnreg.runtime.GraphSession` (its step reads a static
  top-k index tensor) and replays every sparse batch: outputs match the oracle, the
  rows of padding sequences (all -1) come out zero, the new rows are written.

Every claim of a kernel runs on a pool of the rows it declares
(``make_pool(..., kv_format=kernel.kv_format)``: 656-byte ``fp8_ds_mla`` rows or
bf16 ones), and a captured claim allocates its graph state with ``sparse=True``.
Each check class is registered in :data:`attnreg.testing.checks.CHECKS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnreg.registry import (
    Capabilities,
    ForwardMode,
    GraphMode,
    Phase,
    SparseKernel,
    SparseKVFormat,
)

from .checks import ConformanceCheck, register_check
from .claims import Check, Claim, ClaimKind, Combo, Expansion, combos_of

if TYPE_CHECKING:
    from .harness import Harness

__all__ = ["SparseSite", "claim_top_k", "sparse_claims", "sparse_sites"]

#: The index width the suite runs where a kernel accepts it (small: cpu runs it).
_PREFERRED_TOP_K = 16


def claim_top_k(kernel: SparseKernel) -> int:
    """The top-k the claims of ``kernel`` run: 16, else the smallest width it accepts."""
    if kernel.top_k_sizes:
        return min(kernel.top_k_sizes)
    step = max(1, kernel.top_k_multiple)
    return min(kernel.max_top_k, -(-_PREFERRED_TOP_K // step) * step)


def _kernel_for(caps: Capabilities, combo: Combo) -> SparseKernel | None:
    for k in caps.sparse_kernels_for(combo.phase):
        if combo.q_dtype in k.q_dtypes and combo.kv_dtype is k.kv_dtype \
                and combo.page_size in k.page_sizes and k.accepts_heads(combo.num_heads):
            return k
    return None


@dataclass(frozen=True)
class SparseSite:
    """One sparse kernel in one phase it serves: the configurations claimed for it (none
    claimed by an earlier kernel), its top-k and the sparse batches it runs."""

    kernel: SparseKernel
    phase: Phase
    top_k: int
    names: tuple[str, ...]
    combos: tuple[Combo, ...]

    @property
    def base(self) -> Combo:
        return self.combos[0]


def sparse_sites(x: Expansion) -> list[SparseSite]:
    """The sparse sites of ``x``'s declaration (none without sparse kernels)."""
    caps = x.caps
    if not caps.sparse_kernels:
        return []
    from .sparse_cases import sparse_cases

    view = caps.sparse_view()
    sites: list[SparseSite] = []
    seen: set[Combo] = set()
    for kernel in caps.sparse_kernels:
        dense = kernel.as_dense_constraints()
        top_k = claim_top_k(kernel)
        for phase in (Phase.DECODE, Phase.PREFILL):
            if phase not in kernel.phases:
                continue
            names = tuple(c.name for c in sparse_cases(phase, top_k))
            combos = [c for c in combos_of(view, dense, phase, x.device, False, x.heads)
                      if c not in seen]
            seen.update(combos)
            if combos:
                sites.append(SparseSite(kernel, phase, top_k, names, tuple(combos)))
    return sites


def sparse_claims(caps: Capabilities, device: str,
                  heads: tuple[int, ...] | None = None) -> list[Claim]:
    """Every sparse claim of ``caps`` for a run on ``device`` (what the sparse checks'
    :meth:`~ConformanceCheck.declaration_claims` make, in table order)."""
    from .checks import CHECKS

    x = Expansion(caps, device, False, heads)
    return [claim for check in CHECKS.values() if isinstance(check, _SparseCheck)
            for claim in check.declaration_claims(x)]


class _SparseCheck(ConformanceCheck):
    """A check of the sparse sites (:func:`sparse_sites`)."""

    def declaration_claims(self, x: Expansion) -> list[Claim]:
        return [claim for site in sparse_sites(x) for claim in self.site_claims(x, site)]

    def site_claims(self, x: Expansion, site: SparseSite) -> list[Claim]:
        return []


def _cases(harness: Harness, claim: Claim, caps: Capabilities):  # type: ignore[no-untyped-def]
    from .errors import HarnessLimitation
    from .sparse import sparse_cases

    assert claim.combo is not None
    kernel = _kernel_for(caps, claim.combo)
    if kernel is None:
        raise HarnessLimitation(f"no sparse kernel of {claim.backend} accepts "
                                f"{claim.combo.describe()}")
    cases = [c for c in sparse_cases(claim.combo.phase, claim_top_k(kernel))
             if c.name in claim.batches]
    return kernel, cases


def _setup(harness: Harness, claim: Claim):  # type: ignore[no-untyped-def]
    from .sparse import sparse_cases
    from .workload import make_config

    assert claim.combo is not None
    caps = harness.registry.declaration(claim.backend, harness.platform)
    kernel, cases = _cases(harness, claim, caps)
    longest = max(p + e for c in sparse_cases(claim.combo.phase, claim_top_k(kernel))
                  for p, e in c.seqs)
    config = make_config(claim.combo, harness.device, max_context_len=max(longest, 64))
    return harness.create(claim, config), config, kernel, cases


def _forward(backend, work, pool, indices, *, out=None, return_lse=False):  # type: ignore[no-untyped-def]
    return backend.forward_sparse(work.q, work.latent_new, work.rope_new, pool, work.batch,
                                  topk_indices=indices, out=out, return_lse=return_lse)


def _written_problems(pool, work, when: str) -> list[str]:  # type: ignore[no-untyped-def]
    import torch

    got = pool.layer(0).read_slots(torch.tensor(work.new_slots, device=pool.device)).cpu()
    if torch.equal(got, work.new_rows.float()):
        return []
    return [f"{when}: the new tokens' rows at slots {work.new_slots[:4]}... are not the rows "
            "given (latent_new / rope_new as the pool stores them)"]


@register_check
class SparseMatches(_SparseCheck):
    """Sparse MLA, eagerly: the float64 sparse oracle, its LSE, the pool written as asked."""

    check = Check.SPARSE
    kinds = (ClaimKind.EAGER,)

    def site_claims(self, x: Expansion, site: SparseSite) -> list[Claim]:
        return [self.claim(
            x, ClaimKind.EAGER, combo,
            f"sparse MLA {combo.describe()} top-k {site.top_k} ({site.kernel.kv_format} "
            "rows) matches the float64 sparse oracle", batches=site.names)
            for combo in site.combos]

    def run(self, harness: Harness, claim: Claim) -> None:
        from .errors import ClaimRefuted
        from .harness import explained
        from .integrity import InputGuard, kv_problems
        from .sparse import make_sparse_workload
        from .workload import compare, compare_lse, make_pool

        backend, config, kernel, cases = _setup(harness, claim)
        assert claim.combo is not None
        pool = make_pool(config, [c.spec() for c in cases], kv_format=kernel.kv_format)
        problems: list[str] = []
        for i, case in enumerate(cases):
            sw = make_sparse_workload(config, pool, case, seed=200 + i)
            guard = InputGuard([sw.work])
            with explained(f"{sw.spec.describe()}, sparse top-k {case.top_k}, eager"):
                backend.init_forward_metadata(sw.work.batch)
                result = _forward(backend, sw.work, pool, sw.indices, return_lse=kernel.lse)
                harness.sync()
            out = result[0] if kernel.lse else result
            msg = compare(out, sw.expected, claim.combo.q_dtype, sw.spec)
            if msg:
                problems.append(f"{case.about}: {msg}")
            if kernel.lse:
                msg = compare_lse(result[1], sw.expected_lse, sw.spec)
                if msg:
                    problems.append(f"{case.about}: {msg}")
            problems += kv_problems(pool, [sw.work], f"{case.name}, eager")
            problems += guard.problems(f"{sw.spec.describe()}, eager")
        if problems:
            raise ClaimRefuted("; ".join(problems))


@register_check
class SparseIndexRefused(_SparseCheck):
    """An index neither -1 nor a pool slot, or int64 indices: UnsupportedError before the
    kernel, naming the index; the output and the pool are not touched."""

    check = Check.SPARSE_INDEX
    kinds = (ClaimKind.REFUSAL,)

    def site_claims(self, x: Expansion, site: SparseSite) -> list[Claim]:
        return [self.claim(
            x, ClaimKind.REFUSAL, site.base,
            f"sparse {site.phase}: an index neither -1 nor a pool slot, and int64 indices, "
            f"are refused with UnsupportedError before the kernel ({site.kernel.kv_format} "
            "rows)", batches=site.names[:1],
            # one claim per row format of a phase (the bf16 one keeps its first id)
            refused="sparse_index" if site.kernel.kv_format is SparseKVFormat.BF16
            else f"sparse_index_{site.kernel.kv_format}")]

    def run(self, harness: Harness, claim: Claim) -> None:
        import torch

        from attnreg.registry import UnsupportedError

        from .errors import ClaimRefuted
        from .sparse import make_sparse_workload
        from .workload import make_pool

        backend, config, kernel, cases = _setup(harness, claim)
        pool = make_pool(config, [c.spec() for c in cases], kv_format=kernel.kv_format)
        sw = make_sparse_workload(config, pool, cases[0], seed=300)
        backend.init_forward_metadata(sw.work.batch)
        slots = pool.layer(0).num_slots
        problems = []
        for label, bad, needle in (("index -2", -2, "-2"), (f"index {slots}", slots, str(slots)),
                                   ("int64 indices", None, "int64")):
            indices = sw.indices.clone() if bad is not None else sw.indices.long()
            if bad is not None:
                indices[-1, indices.shape[1] // 2] = bad
            before = pool.layer(0).buffer.clone()
            out = torch.full((sw.work.q.shape[0], sw.work.q.shape[1], config.kv_lora_rank),
                             7.0, dtype=sw.work.q.dtype, device=sw.work.q.device)
            try:
                _forward(backend, sw.work, pool, indices, out=out)
            except UnsupportedError as exc:
                if needle not in str(exc):
                    problems.append(f"{label}: refused, but the message does not name it "
                                    f"({exc})")
                if not torch.equal(pool.layer(0).buffer, before) or not bool((out == 7).all()):
                    problems.append(f"{label}: refused only after writing the pool or the "
                                    "output (the refusal must come before any launch)")
                continue
            except Exception as exc:
                problems.append(f"{label}: raised {type(exc).__name__} ({exc}), not "
                                "UnsupportedError")
                continue
            problems.append(f"{label} was accepted without UnsupportedError (a kernel that "
                            "checks only for -1 reads outside the pool)")
        if problems:
            raise ClaimRefuted("; ".join(problems))


@register_check
class SparseRefusesCapture(_SparseCheck):
    """A sparse (phase, mode) declared UNSUPPORTED is refused under ``capturing(mode)``."""

    check = Check.SPARSE_REFUSES_CAPTURE
    kinds = (ClaimKind.CAPTURE,)

    def site_claims(self, x: Expansion, site: SparseSite) -> list[Claim]:
        return [self.claim(
            x, ClaimKind.CAPTURE, site.base,
            f"sparse {site.phase} under {entry.mode} is refused (declared unsupported: "
            f"{entry.capture.reason})", graph_mode=entry.mode, capture=entry.capture.kind,
            batches=site.names[:1])
            for entry in x.caps.sparse_graph_modes
            if entry.phase is site.phase and entry.capture.is_unsupported]

    def run(self, harness: Harness, claim: Claim) -> None:
        from attnreg.graph_policy import capturing
        from attnreg.registry import UnsupportedError

        from .errors import ClaimRefuted
        from .sparse import make_sparse_workload
        from .workload import make_pool

        backend, config, kernel, cases = _setup(harness, claim)
        pool = make_pool(config, [c.spec() for c in cases], kv_format=kernel.kv_format)
        sw = make_sparse_workload(config, pool, cases[0], seed=400)
        backend.init_forward_metadata(sw.work.batch)   # planned eagerly, run "captured"
        try:
            with capturing(claim.graph_mode):
                _forward(backend, sw.work, pool, sw.indices)
        except UnsupportedError as exc:
            if "sparse" not in str(exc):
                raise ClaimRefuted(f"refused, but not for the sparse declaration: {exc}") \
                    from exc
            return
        raise ClaimRefuted(f"sparse {claim.combo.phase if claim.combo else ''} under "
                           f"{claim.graph_mode} is declared unsupported, yet a sparse forward "
                           "under capturing() ran without UnsupportedError")


@register_check
class SparseReplay(_SparseCheck):
    """Captured once through the graph session, sparse batches replay like the oracle."""

    check = Check.SPARSE_REPLAY
    kinds = (ClaimKind.CAPTURE,)

    def site_claims(self, x: Expansion, site: SparseSite) -> list[Claim]:
        return [self.claim(
            x, ClaimKind.CAPTURE, site.base,
            f"sparse {site.phase} captured under {entry.mode} once replays every sparse "
            "batch like the oracle, padding rows zero", graph_mode=entry.mode,
            capture=entry.capture.kind, pinned_method=entry.pinned_method,
            batches=site.names)
            for entry in x.caps.sparse_graph_modes
            if entry.phase is site.phase and not entry.capture.is_unsupported]

    def run(self, harness: Harness, claim: Claim) -> None:
        import torch

        from attnreg.graph_policy import capturing
        from attnreg.runtime import GraphSession, StepInputs
        from attnreg.runtime.refusals import sparse_index_problems

        from .errors import ClaimRefuted
        from .sparse import make_sparse_workload
        from .workload import compare, make_pool

        backend, config, kernel, cases = _setup(harness, claim)
        assert claim.combo is not None
        phase, mode = claim.combo.phase, claim.graph_mode
        pool = make_pool(config, [c.spec() for c in cases], spare_pages=4,
                         kv_format=kernel.kv_format)
        works = [make_sparse_workload(config, pool, c, seed=500 + i)
                 for i, c in enumerate(cases)]
        problems: list[str] = []
        if mode is GraphMode.TC_PIECEWISE:   # attention runs eagerly between the pieces
            for sw in works:
                backend.init_forward_metadata(sw.work.batch)
                with capturing(mode):
                    out = _forward(backend, sw.work, pool, sw.indices)
                msg = compare(out, sw.expected, claim.combo.q_dtype, sw.spec)
                if msg:
                    problems.append(f"{sw.case.about}, under {mode}: {msg}")
            if problems:
                raise ClaimRefuted("; ".join(problems))
            return
        decode = phase is Phase.DECODE
        fm = ForwardMode.DECODE if decode else ForwardMode.EXTEND
        rows = [sw.work.batch.batch_size if decode else sw.work.batch.num_tokens
                for sw in works]
        bucket = max(rows) + (1 if decode else 2)        # every replay is padded
        top_k = works[0].indices.shape[1]
        static_idx = torch.full((bucket, top_k), -1, dtype=torch.int32, device=pool.device)

        def step(s):  # type: ignore[no-untyped-def]
            assert s.inputs is not None
            n = s.inputs.q[0].shape[0]
            out = s.outputs[0] if s.outputs else None
            backend.forward_sparse(s.inputs.q[0], s.inputs.latent_new[0], s.inputs.rope_new[0],
                                   pool, s.batch, out=out, topk_indices=static_idx[:n])

        def load(sw) -> list[str]:  # type: ignore[no-untyped-def]
            # the one index check of a replay: before the copy, as an engine must
            bad = sparse_index_problems(sw.indices, sw.indices.shape[0], pool.layer(0).num_slots,
                                        pool.device)
            static_idx.fill_(-1)
            static_idx[:sw.indices.shape[0]].copy_(sw.indices)
            return bad

        longest = max(sw.work.batch.max_seq_len for sw in works)
        session = GraphSession(backend, pool, phase=phase, mode=mode, buckets=[bucket],
                               sparse=True,
                               forward_modes={fm: 1} if decode else None,
                               max_seq_len=longest, max_requests=max(
                                   sw.work.batch.batch_size for sw in works) + 1,
                               step=step, device_graphs=harness.real_graphs, warmup=0)
        first = works[0]
        problems += load(first)
        session.capture(batches={bucket: first.work.batch},
                        inputs={bucket: StepInputs.one(first.work.q, first.work.latent_new,
                                                       first.work.rope_new)})
        statics = session.statics
        assert statics is not None
        for sw in works:
            problems += load(sw)
            statics.outs[0].fill_(float("nan"))
            outs = session.replay(sw.work.batch, StepInputs.one(sw.work.q, sw.work.latent_new,
                                                                sw.work.rope_new),
                                  bucket=bucket)
            harness.sync()
            when = f"{sw.case.name}, replay of the {mode} graph"
            msg = compare(outs[0], sw.expected, claim.combo.q_dtype, sw.spec)
            if msg:
                problems.append(f"{when}: {msg}")
            rest = statics.outs[0][outs[0].shape[0]:]
            if rest.numel() and not bool((rest == 0).all()):
                problems.append(f"{when}: padding rows (indices all -1) are not zero")
            problems += _written_problems(pool, sw.work, when)
        if problems:
            raise ClaimRefuted("; ".join(problems))


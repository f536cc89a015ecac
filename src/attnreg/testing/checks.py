"""One class per conformance check: the claims it makes, whether it runs on cpu, how it runs.

:data:`CHECKS` is the one table of checks, in registration order.
:func:`~attnreg.testing.claims.expand_claims` asks every check for its claims
at each site of a declaration (:meth:`ConformanceCheck.declaration_claims` once per
declaration, eager claims and those of sites of their own such as sparse kernels, :meth:`~ConformanceCheck.refusal_claims` per
:class:`~attnreg.testing.claims.RefusalSite`,
:meth:`~ConformanceCheck.capture_claims` per
:class:`~attnreg.testing.claims.CaptureSite`), and the harness runs a claim
through its check (``CHECKS[claim.check].run(harness, claim)``), which calls
one procedure of :class:`~attnreg.testing.harness.Harness`.  Within a site,
claims come in table order, so the built-ins below are registered in the order
their claims are listed.

A check defined in another module registers itself with one decorator::

    # attnreg/testing/sparse_checks.py
    from attnreg.testing.checks import ConformanceCheck, register_check

    @register_check
    class SparseTopK(ConformanceCheck):
        check = "sparse_topk"              # the id segment its claims carry
        kinds = (ClaimKind.EAGER,)

        def declaration_claims(self, x):          # x: the Expansion (declaration + run)
            ...                             # return [self.claim(x, combo, statement, ...)]

        def run(self, harness, claim):
            ...

and is loaded with the built-ins when its module is named in
:data:`CHECK_MODULES`.  Pure at import (no torch): the harness is passed in.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, TypeVar

from attnreg.registry import DType, ForwardMethod, GraphMode, Phase, SplitKV
from attnreg.registry.capabilities import SPECULATIVE_MODES

from .batches import eager_specs, padded_replay_specs, quick_specs
from .claims import (
    MULTI_LAYER_COUNT,
    YARN_SM_SCALE,
    CaptureSite,
    Check,
    Claim,
    ClaimKind,
    Combo,
    Expansion,
    RefusalSite,
    head_dims_config,
    kernel_q_rounding,
)

if TYPE_CHECKING:
    from .harness import Harness

__all__ = ["CHECKS", "CHECK_MODULES", "CPU_RUNNABLE_CAPTURE_CHECKS", "FP8_LARGE_Q",
           "ConformanceCheck", "GraphOptions", "Fp8LargeQuery", "needs_device_graphs",
           "register_check"]

#: Modules whose import registers more checks (with :func:`register_check`), loaded
#: after the built-ins: a new group of checks adds its module here.
CHECK_MODULES: tuple[str, ...] = ("attnreg.testing.sparse_checks",)


@dataclass(frozen=True)
class GraphOptions:
    """How :meth:`Harness.check_graph` runs a FULL / BREAKABLE capture claim."""

    #: pool layers captured in one graph over one captured plan
    layers: int = 1
    #: fill the output with NaN before each replay; padding rows must come out zero
    padded: bool = False
    #: capture under the sync guard and account the allocator around the capture
    sync_check: bool = False
    #: allocate and free large tensors between replays
    churn: bool = False
    #: only the capture-mode code path (no device graph), even on cuda
    path_only: bool = False
    #: an FP8 pool's layers change scale (``set_scale``) between capture and the replays
    rescale: bool = False


class ConformanceCheck:
    """A check: its id, its claim kinds, where it runs, what it claims, how it runs.

    A subclass sets :attr:`check` and :attr:`kinds`, overrides the expansion
    hooks of its kinds (each returns the claims of one site, usually built with
    :meth:`claim` / :meth:`capture_claim`) and :meth:`run`.
    """

    #: the id its claims carry (a :class:`~attnreg.testing.claims.Check` for the
    #: built-ins; any ``snake_case`` string for a check of another module)
    check: ClassVar[Check | str]
    #: the kinds of claim it makes (multi-layer: eager and capture)
    kinds: ClassVar[tuple[ClaimKind, ...]]
    #: whether its capture claims run on cpu (without a device graph)
    runs_on_cpu: ClassVar[bool] = True
    #: whether it expands at capture sites declared UNSUPPORTED (only those), instead
    #: of at the NATIVE / FALLBACK ones
    for_unsupported: ClassVar[bool] = False

    # -- expansion hooks (defaults: nothing) --------------------------------------------
    def declaration_claims(self, x: Expansion) -> Sequence[Claim]:
        """Its claims about the declaration as a whole: the eager ones, and those whose
        sites the dense ones do not cover (e.g. one per sparse kernel); any kind."""
        return ()

    def refusal_claims(self, x: Expansion, site: RefusalSite) -> Sequence[Claim]:
        """Its claims at one refusal site."""
        return ()

    def capture_claims(self, x: Expansion, site: CaptureSite) -> Sequence[Claim]:
        """Its claims at one capture site."""
        return ()

    # -- building claims ----------------------------------------------------------------
    def claim(self, x: Expansion, kind: ClaimKind, combo: Combo | None, statement: str,
              **fields: object) -> Claim:
        """A claim of this check about ``x``'s backend."""
        return Claim(x.backend, kind, self.check, combo, statement, **fields)  # type: ignore[arg-type]

    def capture_claim(self, x: Expansion, site: CaptureSite, statement: str, *,
                      combo: Combo | None = None,
                      batches: Iterable[str] | None = None) -> Claim:
        """A capture claim at ``site`` (its base configuration and replay list unless
        given), needing a device graph unless this check runs on cpu."""
        return self.claim(x, ClaimKind.CAPTURE, combo or site.base, statement,
                          batches=tuple(site.replay if batches is None else batches),
                          needs_device_graphs=not self.runs_on_cpu, **site.fields())

    def run(self, harness: Harness, claim: Claim) -> None:
        """Check ``claim``: return when it holds, raise ClaimRefuted when it does not."""
        raise NotImplementedError


#: check id (as the class gives it: a :class:`Check`, or a string) -> its class's
#: instance, in registration order.  A string looks up a built-in check too.
CHECKS: dict[Check | str, ConformanceCheck] = {}

_ID = re.compile(r"^[a-z][a-z0-9_]*$")
_C = TypeVar("_C", bound=type[ConformanceCheck])


def register_check(cls: _C) -> _C:
    """Register a check class (a class decorator): its claims are expanded and run.

    Raises ValueError for a second class with the same id, an id that is not
    ``snake_case`` (ids appear in claim ids and ``-k`` expressions), or no kinds.
    """
    check = getattr(cls, "check", None)
    if not isinstance(check, str) or not _ID.match(str(check)):
        raise ValueError(f"{cls.__name__}.check must be a snake_case string, got {check!r}")
    if check in CHECKS:
        raise ValueError(f"two classes for check {str(check)!r}: "
                         f"{type(CHECKS[check]).__name__} and {cls.__name__}")
    if not getattr(cls, "kinds", ()):
        raise ValueError(f"{cls.__name__}.kinds must name the claim kinds it makes")
    CHECKS[check] = cls()
    return cls


def _paged(x: Expansion, method: ForwardMethod, phase: Phase) -> bool:
    """Whether a kernel of ``method`` in ``phase`` reads a paged cache."""
    return any(k.page_sizes for k in x.caps.kernels_for(method, phase))


# -- eager ----------------------------------------------------------------------------
@register_check
class MatchesReference(ConformanceCheck):
    """Each declared input configuration computes what the float64 oracle computes:
    every configuration of every kernel, the base one at a YaRN softmax scale, and each
    speculative forward mode the backend serves eagerly."""

    check = Check.MATCHES_REFERENCE
    kinds = (ClaimKind.EAGER,)

    def declaration_claims(self, x: Expansion) -> list[Claim]:
        return self._configurations(x) + self._sm_scale(x) + self._speculative(x)

    def _configurations(self, x: Expansion) -> list[Claim]:
        claims: list[Claim] = []
        seen: set[Combo] = set()
        for k in x.caps.kernels:
            for phase in (Phase.DECODE, Phase.PREFILL):
                if phase not in k.phases:
                    continue
                base_heads = min(x.head_counts(k), default=0)
                for combo in x.combos(k, phase):
                    if combo in seen:
                        continue
                    seen.add(combo)
                    specs = eager_specs(phase, method=combo.method)
                    if x.on_cpu and not x.heads and (combo.num_heads != base_heads
                                                     or combo.num_heads > 16):
                        # the interpreter runs each head's programs in turn: one small
                        # batch (also for the base of a head range from min_heads up)
                        specs = quick_specs(phase)
                    claims.append(self.claim(
                        x, ClaimKind.EAGER, combo,
                        f"{combo.describe()} matches the float64 oracle on "
                        f"{', '.join(specs)} and writes only its own KV slots",
                        batches=specs))
        return claims

    def _sm_scale(self, x: Expansion) -> list[Claim]:
        """One per (method, phase): the base configuration with :data:`YARN_SM_SCALE` as
        ``MLAConfig.sm_scale`` (on cpu on one small batch)."""
        claims: list[Claim] = []
        for phase in (Phase.DECODE, Phase.PREFILL):
            for method in x.caps.methods(phase):
                base = x.base_combo(method, phase)
                if base is None:
                    continue
                combo = replace(base, sm_scale=YARN_SM_SCALE)
                specs = quick_specs(phase) if x.on_cpu else eager_specs(phase, method=method)
                claims.append(self.claim(
                    x, ClaimKind.EAGER, combo,
                    f"{combo.describe()} (MLAConfig.sm_scale set to a YaRN-scaled model's, "
                    f"not the default 1/sqrt(qk dims)) matches the float64 oracle at that "
                    f"scale on {', '.join(specs)} and writes only its own KV slots",
                    batches=specs))
        return claims

    def _speculative(self, x: Expansion) -> list[Claim]:
        """Each speculative forward mode served eagerly, at its declared draft tokens, for
        each declared (q, kv) dtype pair of the decode phase's MLA kernels (the base pair
        only on cpu, unless exhaustive)."""
        claims: list[Claim] = []
        base = x.base_combo(ForwardMethod.MLA, Phase.DECODE)
        if base is None:
            return claims
        for served in x.caps.eager_forward_modes:
            if served.mode not in SPECULATIVE_MODES or served.max_query_len is None:
                continue
            q = served.max_query_len
            specs = eager_specs(Phase.DECODE, served.mode)
            combos = x.dtype_variants(base, ForwardMethod.MLA, Phase.DECODE) \
                if x.exhaustive or not x.on_cpu else [base]
            for combo in combos:
                claims.append(self.claim(
                    x, ClaimKind.EAGER, combo,
                    f"eager {served.mode} batches of {q} tokens per sequence ("
                    f"{served.describe()}), {combo.describe()}: causal among the new tokens "
                    f"over the whole prefix, match the float64 oracle on {', '.join(specs)} "
                    "and write only their own KV slots", batches=specs,
                    forward_mode=served.mode, query_len=q))
        return claims

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_eager(claim)


@register_check
class Lse(ConformanceCheck):
    """``return_lse=True`` returns the oracle's natural-log log-sum-exp: one claim per
    (method, phase) whose kernels declare an LSE output, at their base configuration."""

    check = Check.LSE
    kinds = (ClaimKind.EAGER,)

    def declaration_claims(self, x: Expansion) -> list[Claim]:
        claims: list[Claim] = []
        for phase in (Phase.DECODE, Phase.PREFILL):
            for method in x.caps.methods(phase):
                lse_kernels = [k for k in x.caps.kernels_for(method, phase) if k.lse]
                combo = next((c for k in lse_kernels
                              for c in x.combos(k, phase, exhaustive=False)), None)
                if combo is None:
                    continue
                specs = eager_specs(phase, method=method)
                claims.append(self.claim(
                    x, ClaimKind.EAGER, combo,
                    f"{combo.describe()} with return_lse=True returns float32 [tokens, "
                    "heads] log-sum-exps equal to the oracle's (natural log of the summed "
                    f"exp(sm_scale * q . k) over the visible keys) on {', '.join(specs)}, "
                    "beside an output that matches it", batches=specs))
        return claims

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_eager(claim, with_lse=True)


def _mla_phase_bases(x: Expansion) -> list[tuple[Phase, Combo, tuple[str, ...]]]:
    """Each phase whose absorbed MLA ``x`` declares, with its base configuration and the
    batches an eager claim over that phase's MLA runs (its quick batch on cpu)."""
    out = []
    for phase in (Phase.DECODE, Phase.PREFILL):
        if ForwardMethod.MLA not in x.caps.methods(phase):
            continue
        base = x.base_combo(ForwardMethod.MLA, phase)
        if base is not None:
            out.append((phase, base, quick_specs(phase) if x.on_cpu else eager_specs(phase)))
    return out


@register_check
class QRounding(ConformanceCheck):
    """The kernel computes with q as its declaration says (``KernelConstraints.
    q_compute_dtype``): rounded to fp8 where declared, as given where not.

    Rounding q to fp8 e4m3 moves an absorbed MLA output by ~8e-3 on average, inside
    every tolerance a claim holds outputs to (0.02 for bf16, 0.08 for fp8 pools), so a
    kernel that rounds q without declaring it (or declares a rounding it does not do)
    passes ``matches_reference``.  Here the output is held against two oracles of the
    same inputs, q rounded as declared and q the other way (as given, or rounded to fp8
    with one scale per row), and must be nearer, by mean absolute error, the declared
    one: the kernel's own rounding is independent of q's, so it cannot make the wrong
    oracle the nearer one.  It tells a rounding from none, not one scale per batch from
    one per row (N(0, 1) rows give the same power-of-two scale either way).

    One claim per (q, kv) dtype configuration of absorbed MLA in each phase (not an
    engine's fp8 q: that q is exact as given), on the phase's quick batch on cpu.
    """

    check = Check.Q_ROUNDING
    kinds = (ClaimKind.EAGER,)

    def declaration_claims(self, x: Expansion) -> list[Claim]:
        claims: list[Claim] = []
        for phase, base, specs in _mla_phase_bases(x):
            for combo in x.dtype_variants(base, ForwardMethod.MLA, phase):
                if combo.q_dtype is DType.FP8_E4M3:
                    continue
                rounding = kernel_q_rounding(x.caps, combo)
                declared = (f"q rounded to {rounding['q_compute_dtype']} (one scale per "
                            f"{rounding['q_compute_scale']})" if rounding["q_compute_dtype"]
                            else "q as given")
                claims.append(self.claim(
                    x, ClaimKind.EAGER, combo,
                    f"{combo.describe()} computes with {declared}, as declared: its output "
                    f"on {', '.join(specs)} is nearer the oracle of that q than of q "
                    "rounded the other way", batches=specs))
        return claims

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_q_rounding(claim)


# -- refusals ---------------------------------------------------------------------------
class _Refusal(ConformanceCheck):
    """An input outside the declaration is refused with UnsupportedError before a launch.

    A subclass says, at each (phase, method) site, which undeclared request it makes
    (:meth:`request`), how the claim id names it (:meth:`refused_value`) and how a
    message names it (:meth:`what`).
    """

    kinds = (ClaimKind.REFUSAL,)

    def request(self, x: Expansion, site: RefusalSite) -> Combo | None:
        """The undeclared configuration to ask for at ``site`` (None: nothing)."""
        return None

    def refused_value(self, combo: Combo) -> str:
        return str(self.check)

    def what(self, combo: Combo) -> str:
        return str(self.check)

    def statement(self, combo: Combo) -> str:
        return (f"{combo.phase} {combo.method} with {self.what(combo)} (undeclared) is "
                "refused with UnsupportedError before any kernel launch")

    def refusal_claims(self, x: Expansion, site: RefusalSite) -> list[Claim]:
        if site.method is None or site.base is None:
            return []
        combo = self.request(x, site)
        if combo is None:
            return []
        return [self.claim(x, ClaimKind.REFUSAL, combo, self.statement(combo),
                           refused=self.refused_value(combo))]

    def run(self, harness: Harness, claim: Claim) -> None:
        assert claim.combo is not None
        harness.check_refusal(claim, self.what(claim.combo))


#: Undeclared values the refusal checks try, in order (the first the declaration rejects).
PAGE_CANDIDATES = (3, 7, 128, 2, 5)
DTYPE_CANDIDATES = (DType.FP32, DType.FP8_E4M3, DType.FP16, DType.BF16)
DIMS_CANDIDATES = {
    ForwardMethod.MLA: ((320, 256), (576 + 64, 576)),
    ForwardMethod.MHA: ((256, 128), (96, 64), (192, 192)),
    ForwardMethod.MHA_CHUNKED_KV: ((256, 128), (96, 64), (192, 192)),
}


@register_check
class RefusesPageSize(_Refusal):
    """An undeclared page size (where a paged cache is read)."""

    check = Check.PAGE_SIZE

    def request(self, x: Expansion, site: RefusalSite) -> Combo | None:
        assert site.base is not None and site.method is not None
        if not _paged(x, site.method, site.phase):
            return None
        p = next((p for p in PAGE_CANDIDATES if x.refused(site.base, page_size=p)), None)
        return None if p is None else replace(site.base, page_size=p)

    def refused_value(self, combo: Combo) -> str:
        return f"p{combo.page_size}"

    def what(self, combo: Combo) -> str:
        return f"page size {combo.page_size}"


@register_check
class RefusesQDtype(_Refusal):
    """An undeclared query dtype (with a kernel reading no cache: K/V in it too)."""

    check = Check.Q_DTYPE

    def request(self, x: Expansion, site: RefusalSite) -> Combo | None:
        base = site.base
        assert base is not None and site.method is not None
        for dt in DTYPE_CANDIDATES:
            if dt is not base.q_dtype and x.refused(base, q_dtype=dt):
                kv = base.kv_dtype if _paged(x, site.method, site.phase) else dt
                return replace(base, q_dtype=dt, kv_dtype=kv)
        return None

    def refused_value(self, combo: Combo) -> str:
        return f"q-{combo.q_dtype}"

    def what(self, combo: Combo) -> str:
        return f"q dtype {combo.q_dtype}"


@register_check
class RefusesKVDtype(_Refusal):
    """An undeclared KV-cache dtype (where a paged cache is read)."""

    check = Check.KV_DTYPE

    def request(self, x: Expansion, site: RefusalSite) -> Combo | None:
        base = site.base
        assert base is not None and site.method is not None
        if not _paged(x, site.method, site.phase):
            return None
        dt = next((d for d in DTYPE_CANDIDATES
                   if d is not base.kv_dtype and x.refused(base, kv_dtype=d)), None)
        return None if dt is None else replace(base, kv_dtype=dt)

    def refused_value(self, combo: Combo) -> str:
        return f"kv-{combo.kv_dtype}"

    def what(self, combo: Combo) -> str:
        return f"kv dtype {combo.kv_dtype}"


@register_check
class RefusesHeadDims(_Refusal):
    """Undeclared head dims a config can express."""

    check = Check.HEAD_DIMS

    def request(self, x: Expansion, site: RefusalSite) -> Combo | None:
        base, method = site.base, site.method
        assert base is not None and method is not None
        for dims in DIMS_CANDIDATES.get(method, ()):
            if x.refused(base, head_dims=dims) and head_dims_config(method, dims):
                return replace(base, head_dims=dims)
        return None

    def refused_value(self, combo: Combo) -> str:
        return f"{combo.head_dims[0]}x{combo.head_dims[1]}"

    def what(self, combo: Combo) -> str:
        return f"head dims {combo.head_dims[0]}/{combo.head_dims[1]}"


@register_check
class RefusesNumHeads(_Refusal):
    """One head more than the largest count any kernel of the method declares."""

    check = Check.NUM_HEADS

    def request(self, x: Expansion, site: RefusalSite) -> Combo | None:
        assert site.base is not None and site.method is not None
        too_many = max(k.max_heads for k in x.caps.kernels_for(site.method, site.phase)) + 1
        return replace(site.base, num_heads=too_many) \
            if x.refused(site.base, num_heads=too_many) else None

    def refused_value(self, combo: Combo) -> str:
        return f"h{combo.num_heads}"

    def what(self, combo: Combo) -> str:
        return f"{combo.num_heads} heads"


#: The index tensors an ``index_dtype`` claim passes as int64, one group at a time.
INT64_GROUPS: dict[Phase, tuple[tuple[str, ...], ...]] = {
    Phase.DECODE: (("seq_lens",), ("page_table",), ("out_cache_loc",)),
    Phase.PREFILL: (("seq_lens",), ("page_table",), ("out_cache_loc",),
                    ("qo_indptr", "kv_indptr"), ("prefix_lens", "extend_lens")),
}


@register_check
class RefusesIndexDtype(_Refusal):
    """int64 index tensors (the runtime contract is int32), at the base configuration."""

    check = Check.INDEX_DTYPE

    def request(self, x: Expansion, site: RefusalSite) -> Combo | None:
        return site.base

    def refused_value(self, combo: Combo) -> str:
        return "int64"

    def statement(self, combo: Combo) -> str:
        return (f"{combo.phase} {combo.method} with int64 index tensors (sequence lengths, "
                "page table; the runtime contract is int32) is refused with "
                "UnsupportedError before any kernel launch")

    def run(self, harness: Harness, claim: Claim) -> None:
        assert claim.combo is not None
        for fields in INT64_GROUPS[claim.combo.phase]:
            harness.check_refusal(claim, f"int64 {'/'.join(fields)}", int64_fields=fields)


@register_check
class RefusesMethod(_Refusal):
    """A forward method the backend does not declare for a phase it serves (prefill
    only: decode runs through forward_decode, which takes no method)."""

    check = Check.METHOD

    def refusal_claims(self, x: Expansion, site: RefusalSite) -> list[Claim]:
        if site.method is not None:
            return []  # a claim of the phase as a whole
        claims: list[Claim] = []
        for method in ForwardMethod:
            if method in site.methods or site.base is None:
                continue
            if site.phase is Phase.DECODE and method is not ForwardMethod.MLA:
                continue
            dims = {ForwardMethod.MLA: (576, 512)}.get(method, (192, 128))
            combo = replace(site.base, method=method, head_dims=dims)
            claims.append(self.claim(x, ClaimKind.REFUSAL, combo, self.statement(combo),
                                     refused=self.refused_value(combo)))
        return claims

    def refused_value(self, combo: Combo) -> str:
        return combo.method.value

    def what(self, combo: Combo) -> str:
        return f"forward method {combo.method}"


# -- capture ----------------------------------------------------------------------------
@register_check
class RefusesCapture(ConformanceCheck):
    """A mode declared UNSUPPORTED is refused when a capture is prepared."""

    check = Check.REFUSES_CAPTURE
    kinds = (ClaimKind.CAPTURE,)
    for_unsupported = True

    def capture_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        return [self.capture_claim(
            x, site, f"{site.where} is declared unsupported ({site.support.reason}); the "
            "backend refuses to prepare a capture with UnsupportedError", batches=())]

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_refuses_capture(claim)


@register_check
class CapturePath(ConformanceCheck):
    """The capture-mode code path (capture metadata, replay metadata per batch) is right
    without a device graph, and a NATIVE mode is served natively; for the plain forward
    mode also at the YaRN softmax scale."""

    check = Check.CAPTURE_PATH
    kinds = (ClaimKind.CAPTURE,)

    def capture_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        claims = [self.capture_claim(
            x, site, f"{site.where}, {site.method} runs {site.how} and matches the oracle "
            "when its capture-mode code path (capture metadata, then replay metadata for "
            "each batch) is driven without a device graph")]
        if site.forward_mode is None:
            # what is planned at capture must use the config's scale too (on cpu: the
            # capture batch and one replay)
            claims.append(self.capture_claim(
                x, site, f"{site.where}, {site.method} with MLAConfig.sm_scale "
                f"{YARN_SM_SCALE:.4g} (a YaRN-scaled model's) runs {site.how} and matches the "
                "oracle at that scale when its capture-mode code path is driven without a "
                "device graph", combo=replace(site.base, sm_scale=YARN_SM_SCALE),
                batches=site.replay[:2] if x.on_cpu else site.replay))
        return claims

    def run(self, harness: Harness, claim: Claim) -> None:
        if claim.graph_mode is GraphMode.TC_PIECEWISE:
            harness.check_piecewise(claim, path_only=True)
        else:
            harness.check_graph(claim, GraphOptions(path_only=True))


@register_check
class FallbackServed(ConformanceCheck):
    """A FALLBACK mode is served by the declared ``fallback_to``."""

    check = Check.FALLBACK_SERVED
    kinds = (ClaimKind.CAPTURE,)

    def capture_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        if site.forward_mode is not None or not site.support.is_fallback:
            return []
        return [self.capture_claim(
            x, site, f"{site.where}, {site.method} is served by the declared fallback "
            f"{site.support.fallback_to} (as the backend reports through note_served_by), "
            "on every batch")]

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_fallback_served(claim)


@register_check
class Pinning(ConformanceCheck):
    """Under a pinning prefill mode the pinned method runs and every other one is refused
    (decode has one form, forward_decode takes no method: nothing to pin)."""

    check = Check.PINNING
    kinds = (ClaimKind.CAPTURE,)

    def capture_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        pinned = site.entry.pinned_method
        if site.forward_mode is not None or pinned is None or site.phase is not Phase.PREFILL:
            return []
        return [self.capture_claim(
            x, site, f"{site.where} every extend batch (prefix or not) runs the pinned "
            f"{pinned} method, never another one")]

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_pinning(claim)


@register_check
class Piecewise(ConformanceCheck):
    """Attention runs eagerly between captured TC_PIECEWISE graph pieces."""

    check = Check.PIECEWISE
    kinds = (ClaimKind.CAPTURE,)
    runs_on_cpu = False

    def capture_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        if site.mode is not GraphMode.TC_PIECEWISE:
            return []
        return [self.capture_claim(
            x, site, f"{site.where}, {site.method} runs eagerly between captured graph "
            "pieces (static input/output buffers, replayed pieces) and matches the oracle "
            f"on {', '.join(site.replay)}")]

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_piecewise(claim)


class _GraphCheck(ConformanceCheck):
    """A check of a FULL / BREAKABLE graph (not made for TC_PIECEWISE sites)."""

    kinds = (ClaimKind.CAPTURE,)

    def capture_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        if site.mode is GraphMode.TC_PIECEWISE:
            return []
        return self.graph_claims(x, site)

    def graph_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        return []

    @staticmethod
    def kv_variants(x: Expansion, site: CaptureSite) -> list[Combo]:
        """The base, and on cuda (or exhaustive) one configuration per declared dtype pair."""
        if x.exhaustive or not x.on_cpu:
            return x.dtype_variants(site.base, site.method, site.phase)
        return [site.base]

    @staticmethod
    def page_variants(x: Expansion, site: CaptureSite) -> list[Combo]:
        """On cuda (or exhaustive): the base at the smallest and at the largest other page
        size the site's kernels declare for its dtypes (none on cpu).

        A graph's page table, its padding page and a backend's own captured index arrays
        are sized and filled per page size, on a path the eager claims (which cover every
        declared size) never run.  The two ends are where paging is least like the base:
        one token per page (the page table is the slot list: sglang's flashinfer MLA) and
        the widest page (several KV tiles and split boundaries inside one page: FlashMLA,
        trtllm-gen); both are what engines capture."""
        if x.on_cpu and not x.exhaustive:
            return []
        base = site.base
        sizes = sorted({p for k in x.caps.kernels_for(site.method, site.phase)
                        if base.q_dtype in k.q_dtypes and base.kv_dtype in k.kv_dtypes
                        and k.accepts_heads(base.num_heads) for p in k.page_sizes}
                       - {base.page_size})
        ends = sorted({sizes[0], sizes[-1]}) if sizes else []
        return [replace(base, page_size=p) for p in ends if not x.refused(base, page_size=p)]


@register_check
class Replay(_GraphCheck):
    """Captured once, the graph replays new batches correctly (on cuda per declared dtype
    pair, and at the smallest and largest other declared page size)."""

    check = Check.REPLAY
    runs_on_cpu = False

    def graph_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        return [self.capture_claim(
            x, site, f"{site.where}, {site.method} captured once replays "
            f"{', '.join(site.replay)} (new lengths and contents each time) and matches the "
            "oracle, leaving every KV slot outside the written ones untouched", combo=combo)
            for combo in (*self.kv_variants(x, site), *self.page_variants(x, site))]

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_graph(claim, GraphOptions())


@register_check
class CaptureMemory(_GraphCheck):
    """What the capture allocates is within the declared CaptureMemory estimate."""

    check = Check.CAPTURE_MEMORY

    def graph_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        return [self.capture_claim(
            x, site, f"{site.where}, what init_cuda_graph_state and the capture allocate is "
            "within 1.25x (or 1 MiB) of the declared CaptureMemory.estimate for the "
            "captured shape", combo=combo) for combo in self.kv_variants(x, site)]

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_capture_memory(claim)


@register_check
class PaddedRows(_GraphCheck):
    """A smaller batch replayed through a bigger graph gets exactly zero padding rows; a
    decode-phase graph also replays an idle batch (every row padding)."""

    check = Check.PADDED_ROWS

    def graph_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        batches = padded_replay_specs(site.phase, site.forward_mode)
        idle = (f", an idle data-parallel rank's batch ({batches[-2]}: no request) among "
                "them" if site.phase is Phase.DECODE else "")
        return [self.capture_claim(
            x, site, f"{site.where}, a graph captured for the largest of "
            f"{', '.join(site.replay)} replays the smaller ones{idle} with every output row "
            f"of the padding exactly zero ({combo.describe()})", combo=combo,
            batches=batches)
            for combo in self.padding_variants(x, site)]

    @classmethod
    def padding_variants(cls, x: Expansion, site: CaptureSite) -> list[Combo]:
        """The base; on cuda (or exhaustive) also each :meth:`kv_variants` entry of another
        KV dtype (a kernel's FP8 path is another kernel, and one that cannot write zeros
        for an empty sequence is zeroed after it), and the base at the largest head count
        the site's kernels are claimed at: whether a kernel writes the rows of a padding
        request itself (flashinfer's decode graphs rely on it, with no zeroing launch)
        can change with the head count, where a kernel switches its tiling (e.g. two-CTA
        clusters at 128 heads); and the base at the page sizes of :meth:`page_variants`
        (which page a padding request points at, and how many, is set per page size)."""
        if x.on_cpu and not x.exhaustive:
            return [site.base]
        out = [c for c in cls.kv_variants(x, site)
               if c == site.base or c.kv_dtype != site.base.kv_dtype]
        heads = max((h for k in x.caps.kernels_for(site.method, site.phase)
                     if site.base.q_dtype in k.q_dtypes and site.base.kv_dtype in k.kv_dtypes
                     for h in x.head_counts(k)), default=site.base.num_heads)
        wide = replace(site.base, num_heads=heads)
        if wide not in out and not x.refused(site.base, num_heads=heads):
            out.append(wide)
        return out + [c for c in cls.page_variants(x, site) if c not in out]

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_graph(claim, GraphOptions(padded=True))


def _own_per_layer(combo: Combo | None) -> str:
    """What each layer of a multi-layer claim has of its own."""
    if combo is not None and combo.q_dtype is DType.FP8_E4M3:
        return "own contents, kv scales and query scales"
    return "own contents and kv scales"


@register_check
class MultiLayer(_GraphCheck):
    """Several layers of one pool, one plan per step: each layer matches its own oracle,
    eagerly (per phase with MLA) and captured in one graph (MLA sites: the layer decides
    what MLA reads; MHA is handed its k / v)."""

    check = Check.MULTI_LAYER
    kinds = (ClaimKind.EAGER, ClaimKind.CAPTURE)

    def declaration_claims(self, x: Expansion) -> list[Claim]:
        claims: list[Claim] = []
        for phase in (Phase.DECODE, Phase.PREFILL):
            if ForwardMethod.MLA not in x.caps.methods(phase):
                continue
            specs = eager_specs(phase)[:2]
            for combo in x.multi_layer_combos(ForwardMethod.MLA, phase):
                claims.append(self.claim(
                    x, ClaimKind.EAGER, combo,
                    f"{MULTI_LAYER_COUNT} layers of one pool ({_own_per_layer(combo)}), "
                    f"planned once per step with init_forward_metadata and run per "
                    f"layer_id, each match their own oracle on {', '.join(specs)} "
                    f"({combo.describe()}); every layer writes only its own slots",
                    batches=specs))
        return claims

    def graph_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        if site.method is not ForwardMethod.MLA:
            return []
        replay = site.replay
        return [self.capture_claim(
            x, site, f"{site.where}, {MULTI_LAYER_COUNT} layers of one pool "
            f"({_own_per_layer(combo)}) captured in one graph over one captured plan replay "
            f"{', '.join(replay[:2])} with every layer matching its own oracle",
            combo=combo, batches=replay[:2])
            for combo in x.multi_layer_combos(site.method, site.phase) or [site.base]]

    def run(self, harness: Harness, claim: Claim) -> None:
        if claim.kind is ClaimKind.EAGER:
            harness.check_eager(claim, layers=MULTI_LAYER_COUNT)
        else:
            harness.check_graph(claim, GraphOptions(layers=MULTI_LAYER_COUNT))


@register_check
class AllocatorChurn(_GraphCheck):
    """Replays stay right with large tensors allocated and freed between them."""

    check = Check.ALLOCATOR_CHURN
    runs_on_cpu = False

    def graph_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        return [self.capture_claim(
            x, site, f"{site.where}, replays stay correct after large tensors are "
            "allocated and freed between them (storage the graph recorded was not freed)")]

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_graph(claim, GraphOptions(churn=True))


@register_check
class NoSyncAlloc(_GraphCheck):
    """Nothing in the captured region syncs with the host or allocates outside the pool."""

    check = Check.NO_SYNC_ALLOC
    runs_on_cpu = False

    def graph_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        return [self.capture_claim(
            x, site, f"{site.where}, nothing in the captured region synchronises with the "
            "host or allocates outside the graph's pool", batches=site.replay[:1])]

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_graph(claim, GraphOptions(sync_check=True))


_SPLIT_KINDS = {
    SplitKV.DYNAMIC: "device-side split counts follow each replay's lengths",
    SplitKV.HOST_PLANNED: "split counts re-planned on the host before each replay follow "
                          "its lengths",
    SplitKV.SINGLE: "one split under capture",
}


@register_check
class SplitKVCheck(_GraphCheck):
    """Split-KV survives capture as declared: short capture, long replays (on cuda per
    declared dtype pair, and at the smallest and largest other declared page size).

    The variants matter because a kernel's split count and its workspace follow its
    config, and the config may change with the dtype or the page size (triton's 16-head
    fp8 decode takes half the splits over 64-token pages): a graph captured with one
    config's splits over another's workspace, or a page-size path that drops a split's
    partials, passes at the base configuration and corrupts the other."""

    check = Check.SPLIT_KV
    runs_on_cpu = False

    def graph_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        split = site.entry.split_kv
        if split not in _SPLIT_KINDS:
            return []
        replay = site.replay
        longs = tuple(s for s in replay if "long_kv" in s) or replay
        # Prefill: captured for few tokens, as a split-KV extend is (a graph sized for
        # hundreds of tokens fills the GPU without splits and proves nothing).
        short = "short_extend" if site.forward_mode is None and site.phase is Phase.PREFILL \
            else replay[0]
        return [self.capture_claim(
            x, site, f"{site.where}, split-KV is {split} ({_SPLIT_KINDS[split]}): a graph "
            f"captured on short sequences replays long ones correctly ({combo.describe()})",
            combo=combo, batches=(short,) + longs)
            for combo in (*self.kv_variants(x, site), *self.page_variants(x, site))]

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_graph(claim, GraphOptions())


#: What :class:`KVScaleChange` multiplies each layer's fp8 scale by after capture (a power
#: of two, so the suite's pools keep power-of-two scales; N(0, 1) rows stay well inside
#: e4m3's range at every one of them).
KV_RESCALE = 4.0


@register_check
class KVScaleChange(_GraphCheck):
    """A graph over an FP8 pool reads each layer's scale at replay: captured at one scale,
    replayed after ``set_scale`` changed every layer's (docs/runtime.md, "FP8 pools").

    A kernel (or a KV write) handed the host float ``layer.kv_scale`` inside a captured
    region has it frozen into the graph; every claim at a fixed scale holds, and an engine
    that sets its checkpoint's ``k_scale`` after capture reads and writes the cache at the
    old one.  One claim per FP8-pool configuration of the site's q dtype, on cuda (a real
    graph) or with ``--exhaustive`` on cpu (the capture-mode path: it catches a scale kept
    in the backend's captured plan, not one frozen into a launch)."""

    check = Check.KV_SCALE_CHANGE

    def graph_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        combos = [c for c in self.kv_variants(x, site)
                  if c.kv_dtype is DType.FP8_E4M3 and c.q_dtype is site.base.q_dtype]
        return [self.capture_claim(
            x, site, f"{site.where}, {site.method} {combo.describe()} captured at one fp8 "
            f"scale per layer replays {', '.join(site.replay)} correctly after set_scale "
            f"multiplied every layer's by {KV_RESCALE:g} (its kernels and KV writes read the "
            "scale at replay)", combo=combo) for combo in combos]

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_graph(claim, GraphOptions(rescale=True))


# -- queries beyond the fp8 range -------------------------------------------------------
#: The id of :class:`Fp8LargeQuery`'s claims.
FP8_LARGE_Q = "fp8_large_q"
#: The softmax scale of the large-query claims: ``MLAConfig``'s default 1/sqrt(192)
#: divided by the largest gain (``workload.LARGE_Q_GAINS``, 1024).  Real absorbed queries
#: are large because W_UK moved the magnitude into q, not because the logits are: with
#: the default scale a x1024 N(0, 1) row has logits of std ~1700, a one-hot softmax
#: whose near-ties the accumulation's rounding decides: on the H200 the fp32 reference
#: missed 2e-4 and FlashMLA's fp8 path (q correctly scaled) was off by up to 3.1.  Scaled back, the
#: gained rows have the workload's usual logits while |q| still reaches ~4000, so what
#: the claims catch stays an unscaled cast (saturated or NaN q), not arithmetic.
LARGE_Q_SM_SCALE = 1.0 / (math.sqrt(192.0) * 1024.0)


@register_check
class Fp8LargeQuery(ConformanceCheck):
    """With an FP8 KV pool, queries beyond fp8 e4m3's range (|q| up to ~4000, as absorbed
    MLA queries reach in real models) still give the oracle's output: a kernel that
    rounds q to fp8 must scale it first (and declare ``q_compute_dtype``), never cast it
    (an out-of-range cast is NaN: e4m3fn has no inf).

    One claim per FP8-KV MLA configuration of each phase (the first only on cpu),
    eagerly (and per speculative forward mode served eagerly) and at each capture site
    whose method is MLA, on batches whose query rows are gained by
    :data:`~attnreg.testing.workload.LARGE_Q_GAINS`.  The oracle rounds q as the
    declared ``q_compute_dtype`` says and the output is held to that dtype's tolerance,
    so a declared, correctly scaled rounding passes.
    """

    check = FP8_LARGE_Q
    kinds = (ClaimKind.EAGER, ClaimKind.CAPTURE)

    @staticmethod
    def _fp8(x: Expansion, base: Combo, phase: Phase) -> list[Combo]:
        combos = [replace(c, sm_scale=LARGE_Q_SM_SCALE)
                  for c in x.dtype_variants(base, ForwardMethod.MLA, phase)
                  if c.kv_dtype is DType.FP8_E4M3]
        return combos if x.exhaustive or not x.on_cpu else combos[:1]

    def declaration_claims(self, x: Expansion) -> list[Claim]:
        claims: list[Claim] = []
        for phase, base, specs in _mla_phase_bases(x):
            for combo in self._fp8(x, base, phase):
                claims.append(self.claim(
                    x, ClaimKind.EAGER, combo,
                    f"{combo.describe()} with query rows of |q| up to ~4000 (beyond fp8 "
                    f"e4m3's 448) gives finite outputs matching the float64 oracle on "
                    f"{', '.join(specs)}", batches=specs))
            if phase is not Phase.DECODE:
                continue
            for served in x.caps.eager_forward_modes:
                if served.mode not in SPECULATIVE_MODES or served.max_query_len is None:
                    continue
                specs = eager_specs(Phase.DECODE, served.mode)
                specs = specs[1:2] if x.on_cpu else specs
                for combo in self._fp8(x, base, phase):
                    claims.append(self.claim(
                        x, ClaimKind.EAGER, combo,
                        f"eager {served.mode} batches of {served.max_query_len} tokens per "
                        f"sequence, {combo.describe()}, with query rows of |q| up to ~4000 "
                        f"give finite outputs matching the float64 oracle on "
                        f"{', '.join(specs)}", batches=specs, forward_mode=served.mode,
                        query_len=served.max_query_len))
        return claims

    def capture_claims(self, x: Expansion, site: CaptureSite) -> list[Claim]:
        if site.method is not ForwardMethod.MLA:
            return []
        replay = site.replay[:2] if x.on_cpu else site.replay
        return [self.capture_claim(
            x, site, f"{site.where}, {site.method} {combo.describe()} with query rows of "
            f"|q| up to ~4000 (beyond fp8 e4m3's 448) runs {site.how} and gives finite "
            f"outputs matching the oracle on {', '.join(replay)}", combo=combo,
            batches=replay) for combo in self._fp8(x, site.base, site.phase)]

    def run(self, harness: Harness, claim: Claim) -> None:
        from .errors import ClaimRefuted
        from .workload import LARGE_Q_GAINS  # torch: only when a claim runs

        try:
            with harness.query_gains(LARGE_Q_GAINS):
                if claim.kind is ClaimKind.EAGER:
                    harness.check_eager(claim)
                elif claim.graph_mode is GraphMode.TC_PIECEWISE:
                    harness.check_piecewise(claim)
                else:
                    harness.check_graph(claim, GraphOptions())
        except ClaimRefuted as exc:
            raise ClaimRefuted(
                f"{exc} (query rows gained x{', x'.join(f'{g:g}' for g in LARGE_Q_GAINS)}, "
                "|q| up to ~4000; a cast of q to fp8 e4m3 without a scale saturates at 448 "
                "or gives NaN: scale q per tensor before the cast and declare "
                "q_compute_dtype)") from exc


# -- availability ------------------------------------------------------------------------
@register_check
class Available(ConformanceCheck):
    """A requested backend can run here (its claim, from
    :func:`~attnreg.testing.claims.unavailable_claim`, is always skipped with the reason)."""

    check = Check.AVAILABLE
    kinds = (ClaimKind.AVAILABILITY,)

    def run(self, harness: Harness, claim: Claim) -> None:
        from .errors import HarnessLimitation

        raise HarnessLimitation(f"nothing to run for a {claim.kind} claim")


for _module in CHECK_MODULES:
    importlib.import_module(_module)

_missing = set(Check) - set(CHECKS)
if _missing:  # a Check value without its class would be dispatched nowhere
    raise AssertionError(f"checks without a class: {sorted(_missing)}")

#: Capture checks that also run without a CUDA graph: on cpu under
#: ``capturing(mode)`` with capture and replay emulated by the graph runner
#: (capture memory is then read from the backend's typed graph state).
CPU_RUNNABLE_CAPTURE_CHECKS = frozenset(
    c.check for c in CHECKS.values() if c.runs_on_cpu and ClaimKind.CAPTURE in c.kinds)


def needs_device_graphs(check: Check | str) -> bool:
    """Whether ``check``'s capture claims need a real device graph (skipped on cpu)."""
    return not CHECKS[check].runs_on_cpu

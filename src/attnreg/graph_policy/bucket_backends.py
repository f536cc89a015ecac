"""Per-bucket decode backends: each decode capture bucket may get its own declared backend.

With a :class:`~attnreg.graph_policy.decode_profile.DecodeProfile` given to
:func:`~attnreg.graph_policy.resolve` (``decode_profile=``), the plan may
capture each decode batch-size bucket with the backend the profile measured
fastest there, instead of the phase's one backend.  Every backend then reads
and writes the same KV pool, so a candidate must declare the same pool layout
as the phase's backend:

* the engine's page size and the model's KV dtype (its decode kernels accept
  them, checked with the phase backend's own acceptance rules); the profile
  must have been measured at that page size, KV dtype, heads per rank and
  platform (else it describes another pool and is ignored, with the reason);
* the same KV row format.  No declaration names a row format other than the
  pool's ``[num_pages, page_size, 576]`` rows today, so this holds for every
  backend that accepts the page size and KV dtype; a backend that owns its row
  format (a kernel library's own FP8 layout, a sparse DSA format) must be
  excluded here once it declares one.

and it must capture full decode graphs with no hard or soft rule against them,
serving every captured forward mode (verify / draft-extend graphs with their
draft tokens).  A bucket switches only where the profile measured both the
phase's backend and the candidate there and the candidate is faster by more
than :data:`MIN_GAIN` (geometric mean over the KV lengths both were measured
at); anywhere else the phase's backend keeps it.  Without a profile (or when
the user named the decode backend) nothing here runs: one backend, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from ..registry.capabilities import SPECULATIVE_MODES, Capabilities, GraphMode, Phase
from ..registry.errors import AttnregError
from ..registry.manager import BackendRegistry
from .acceptance import model_rejections
from .decode_profile import DecodeProfile
from .plan import BucketBackend, CapturedShapes
from .rules import RuleContext, hard_violations, soft_violations

__all__ = ["MIN_GAIN", "BucketChoice", "choose_bucket_backends"]

#: A bucket leaves the phase's backend only for a candidate measured more than this much
#: faster (2%): timing noise between two runs of one kernel on the H200 is about 1%.
MIN_GAIN = 0.02


@dataclass(frozen=True)
class BucketChoice:
    """What :func:`choose_bucket_backends` decided: per bucket its backend (empty: one
    backend serves every bucket), the candidates' declarations by name, the extra
    capture memory of the other backends, and the summary for the decision trace
    (``decode.bucket_backends`` when ``buckets`` is not empty, else
    ``decode.bucket_backends_off``)."""

    buckets: tuple[BucketBackend, ...]
    declarations: Mapping[str, Capabilities]
    extra_capture_bytes: int
    message: str


def _off(message: str) -> BucketChoice:
    return BucketChoice((), {}, 0, message)


def _candidate_problem(name: str, ctx: RuleContext, registry: BackendRegistry | None,
                       assume_installed: bool, versions: Mapping[str, str | None] | None,
                       shapes: Sequence[CapturedShapes]) -> tuple[Capabilities | None, str]:
    """The candidate's declaration and why it cannot take a bucket ('' = it can)."""
    if registry is None:
        return None, "no registry to look it up in"
    try:
        avail = registry.availability(name, ctx.platform, versions,
                                      assume_installed=assume_installed)
    except AttnregError as exc:  # an unknown name or a broken plugin: a reason, not a crash
        return None, str(exc).splitlines()[0]
    caps = avail.capabilities
    if caps is None or not avail.available:
        return None, avail.reason or f"no declaration on {ctx.platform}"
    rejected = model_rejections(caps, Phase.DECODE, ctx.model, ctx.engine)
    if rejected:
        return caps, "its kernels do not read this pool: " + "; ".join(rejected)
    theirs = replace(ctx, caps=caps)
    blocking = hard_violations(theirs, GraphMode.FULL) + soft_violations(theirs, GraphMode.FULL)
    if blocking:
        return caps, "; ".join(f"{v.rule}: {v.message}" for v in blocking)
    support = caps.graph_support(Phase.DECODE, GraphMode.FULL)
    for s in shapes:
        if s.forward_mode not in SPECULATIVE_MODES:
            continue
        entry = support.serving(s.forward_mode)
        if entry is None or not entry.serves_query_len(int(s.query_len or 1)):
            return caps, (f"its full decode graphs do not serve {s.forward_mode} batches of "
                          f"{s.query_len} tokens per sequence")
    return caps, ""


def _spans(buckets: Sequence[BucketBackend]) -> str:
    """``"1..8 a, 16..256 b"``: runs of consecutive buckets on one backend."""
    runs: list[tuple[int, int, str]] = []
    for b in buckets:
        if runs and runs[-1][2] == b.backend:
            runs[-1] = (runs[-1][0], b.bucket, b.backend)
        else:
            runs.append((b.bucket, b.bucket, b.backend))
    return ", ".join(f"{lo}..{hi} {name}" if lo != hi else f"{lo} {name}" for lo, hi, name in runs)


def choose_bucket_backends(profile: DecodeProfile, ctx: RuleContext, mode: GraphMode,
                           shapes: Sequence[CapturedShapes], *, by_user: bool,
                           registry: BackendRegistry | None, assume_installed: bool,
                           versions: Mapping[str, str | None] | None,
                           capture_bytes: Callable[[Capabilities, Sequence[CapturedShapes]], int],
                           ) -> BucketChoice:
    """Each decode bucket's backend from ``profile`` (see the module doc).

    ``ctx`` is the decode phase's rule context (its backend, model and
    engine), ``shapes`` its captured shapes, ``capture_bytes(caps, shapes)``
    a backend's capture memory for those shapes (resolve's own estimate).
    """
    default = ctx.caps.backend
    where = f"decode profile {profile.label}"
    if mode is not GraphMode.FULL or not shapes:
        return _off(f"{where} not used: decode graphs are not captured in this plan")
    if by_user:
        return _off(f"{where} not used: the user named the decode backend ({default}), so "
                    "every bucket is captured with it")
    if ctx.engine.page_size is None:
        return _off(f"{where} not used: the engine did not pass its page size "
                    "(EngineFacts.page_size, --page-size), so whether the profile's pool "
                    f"(page {profile.page_size}) is the engine's cannot be checked")
    mismatch = profile.mismatch(ctx.platform, ctx.model.num_heads, ctx.model.kv_dtype,
                                ctx.engine.page_size)
    if mismatch:
        return _off(f"{where} ignored: it describes another pool: {mismatch}")
    candidates: dict[str, Capabilities] = {}
    excluded: list[str] = []
    for name in profile.backends:
        if name == default:
            continue
        caps, problem = _candidate_problem(name, ctx, registry, assume_installed, versions,
                                           shapes)
        if problem or caps is None:
            excluded.append(f"{name} ({problem})")
        else:
            candidates[name] = caps
    excluded_note = f"; not candidates: {', '.join(excluded)}" if excluded else ""
    if not candidates:
        return _off(f"{where} not used: no measured backend besides {default} can capture "
                    f"decode buckets over this pool{excluded_note}")
    sizes = shapes[0].batch_sizes
    if default not in profile.backends:
        return _off(f"{where} not used: it has no time of {default}, the phase's backend, to "
                    f"compare the others with (measure it too: --backend {default},...)")
    chosen: list[BucketBackend] = []
    for bucket in sizes:
        if profile.entry(default, bucket) is None:
            chosen.append(BucketBackend(bucket, default, "decode.bucket_backends",
                                        f"kept {default}: the profile has no {default} time at "
                                        f"bucket {bucket} to compare with", None))
            continue
        best, best_ratio, unmeasured = default, 1.0, []
        for name in candidates:
            ratio = profile.ratio(bucket, name, default)
            if ratio is None:
                unmeasured.append(name)
            elif ratio < 1.0 - MIN_GAIN and ratio < best_ratio:
                best, best_ratio = name, ratio
        gap = f" ({', '.join(unmeasured)} not measured here)" if unmeasured else ""
        if best == default:
            reason = (f"kept {default}: no candidate measured more than {MIN_GAIN:.0%} faster "
                      f"at bucket {bucket}{gap}")
        else:
            reason = (f"{best} measured {best_ratio:.3f}x {default}'s time at bucket {bucket} "
                      f"(geometric mean over the KV lengths both were measured at){gap}")
        chosen.append(BucketBackend(bucket, best, "decode.bucket_backends", reason,
                                    round(best_ratio, 4)))
    used = {b.backend for b in chosen} - {default}
    if not used:
        return _off(f"{where}: {default} is the fastest measured backend at every bucket (or "
                    f"the only one measured there), so it captures them all{excluded_note}")
    extra = 0
    for name in sorted(used):
        mine = tuple(b.bucket for b in chosen if b.backend == name)
        sub = [replace(s, batch_sizes=mine,
                       num_tokens=tuple(b * int(s.query_len or 1) for b in mine),
                       max_requests=max(mine)) for s in shapes]
        extra += capture_bytes(candidates[name], sub)
    message = (f"decode buckets by backend from {where}: {_spans(chosen)}; every one declares "
               f"page size {profile.page_size}, {profile.kv_dtype} KV and the pool's rows"
               f"{excluded_note}")
    return BucketChoice(tuple(chosen), {n: candidates[n] for n in sorted(used)}, extra, message)

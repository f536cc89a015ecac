"""FALLBACK targets are checked by the policy, and no plugin error escapes resolve()."""

from __future__ import annotations

from dataclasses import replace

import pytest

from attnreg.graph_policy import MODEL_PRESETS, GraphConfig, Severity, resolve
from attnreg.registry import (
    BackendSpec,
    Capabilities,
    CaptureSupport,
    Cost,
    DeclarationContext,
    GraphMode,
    GraphPolicyError,
    Phase,
    Vendor,
    hookimpl,
    load_registry,
)

from ._helpers import VERSIONS, declaration, sim

TEXT_MLA = MODEL_PRESETS["deepseek-v3"]
BREAKABLE = (Phase.PREFILL, GraphMode.BREAKABLE)


def falling_back(name: str, to: str, platform: str = "cuda:sm90") -> Capabilities:
    return declaration(name, platform, modes={
        BREAKABLE: CaptureSupport.fallback(to, Cost.LOW, "generated fallback")})


def reason_for(plan, rule: str) -> str:  # type: ignore[no-untyped-def]
    (found,) = [d for d in plan.decisions if d.rule == rule]
    assert found.severity is Severity.HARD and found.phase is Phase.PREFILL
    return found.message


@pytest.mark.parametrize("target, why", [
    ("no_such_backend", "no backend named 'no_such_backend' is registered"),
    ("trtllm_mla", "trtllm_mla cannot run on cuda:sm90"),  # Blackwell-only
    ("reference", "reference declares it unsupported"),     # cannot capture breakable
    ("gen_fb", "falls back to gen_fb"),                      # itself
])
def test_an_invalid_target_makes_the_mode_impossible(target: str, why: str) -> None:
    caps = falling_back("gen_fb", target)
    plan = sim("cuda:sm90", TEXT_MLA, caps)
    assert plan.prefill.mode is GraphMode.DISABLED and plan.prefill.fallbacks == ()
    assert why in reason_for(plan, "backend.fallback_target_invalid")
    with pytest.raises(GraphPolicyError, match="backend.fallback_target_invalid"):
        sim("cuda:sm90", TEXT_MLA, caps, GraphConfig.from_user(prefill="breakable"))


def test_a_valid_target_is_relied_on() -> None:
    plan = sim("cuda:sm90", TEXT_MLA, falling_back("gen_fb", "triton"))
    assert plan.prefill.mode is GraphMode.BREAKABLE
    assert [f.to for f in plan.prefill.fallbacks] == ["triton"]


def test_chains_and_cycles_are_refused() -> None:
    a = falling_back("gen_a", "gen_b")
    b = falling_back("gen_b", "gen_a")
    plan = resolve("cuda:sm90", TEXT_MLA, a, extra_declarations=[b])
    message = reason_for(plan, "backend.fallback_target_invalid")
    assert "gen_b declares it fallback->gen_a" in message and "no chains, no cycles" in message
    chain_end = declaration("gen_c", "cuda:sm90")
    ok = resolve("cuda:sm90", TEXT_MLA, falling_back("gen_a", "gen_c"),
                 extra_declarations=[chain_end])
    assert ok.prefill.mode is GraphMode.BREAKABLE


def _raising_on(vendor: Vendor):  # type: ignore[no-untyped-def]
    """A plugin whose declaration raises on ``vendor`` only (valid elsewhere)."""
    base = declaration("gen_flaky", "cuda:sm90")

    def capabilities(ctx: DeclarationContext) -> Capabilities:
        if ctx.platform.vendor is vendor:
            raise RuntimeError(f"boom on {vendor}")
        return replace(base, platform=ctx.platform)

    class Plugin:
        @hookimpl
        def attnreg_register_backends(self, register):  # type: ignore[no-untyped-def]
            register(BackendSpec(name="gen_flaky", summary="raises on one vendor",
                                 capabilities=capabilities,
                                 runtime="attnreg.backends.reference:ReferenceBackend"))

    return load_registry(autoload=False, extra_plugins=[("flaky", Plugin())])


def test_a_declaration_that_raises_never_escapes_resolve() -> None:
    # Whether registration catches it (validating every platform) or not, resolve()
    # turns it into a reason: a policy error for a named backend ...
    reg = _raising_on(Vendor.ROCM)
    with pytest.raises(GraphPolicyError) as info:
        resolve("rocm:gfx942", TEXT_MLA, "gen_flaky", registry=reg, assume_installed=True,
                versions=VERSIONS)
    assert all(r.split(": ", 1)[1].startswith("backend.unavailable: gen_flaky")
               for r in info.value.reasons)
    # ... and a hard decision for a fallback target.
    plan = resolve("rocm:gfx942", TEXT_MLA, falling_back("gen_fb", "gen_flaky", "rocm:gfx942"),
                   GraphConfig(prefill_mode=GraphMode.BREAKABLE), registry=reg,
                   assume_installed=True, versions=VERSIONS)
    assert plan.prefill.mode is GraphMode.DISABLED
    assert "gen_flaky" in reason_for(plan, "backend.fallback_target_invalid")

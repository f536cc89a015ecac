"""The per-claim time limit: a claim that never returns is refuted, the next one runs."""

from __future__ import annotations

import time

import pytest

from attnreg.testing.checks import CHECKS, CPU_RUNNABLE_CAPTURE_CHECKS, needs_device_graphs
from attnreg.testing.claims import Check, ClaimKind
from attnreg.testing.errors import ClaimRefuted
from attnreg.testing.timelimit import (
    DEFAULT_LIMITS,
    ENV,
    ClaimRunner,
    HarnessRecipe,
    resolve_limit,
    stage,
)


class _Harness:
    """Stands in for the harness: a claim is a (what, seconds) pair."""

    def check(self, claim):
        what, seconds = claim
        stage(f"replay 1 of {what}")
        time.sleep(seconds)
        if what == "wrong":
            raise ClaimRefuted("wrong output")


def _runner(limit: float) -> ClaimRunner:
    return ClaimRunner(_Harness, HarnessRecipe("cpu"), limit, start="fork")


def test_a_claim_past_its_limit_is_refuted_naming_the_stage_and_the_run_goes_on() -> None:
    runner = _runner(1.0)
    try:
        started = time.monotonic()
        kind, text = runner.answer(("hang", 60))
        assert time.monotonic() - started < 10
        assert kind == "refuted"
        assert text.startswith("timed out after 1 s in replay (replay 1 of hang)")
        assert runner.answer(("fine", 0)) == ("ok", "")  # a fresh worker took over
        with pytest.raises(ClaimRefuted, match="wrong output"):
            runner.run(("wrong", 0))
    finally:
        runner.close()


def test_a_crashed_worker_refutes_the_claim() -> None:
    class Crashing(_Harness):
        def check(self, claim):
            import os

            stage("eager forward")
            os._exit(3)

    runner = ClaimRunner(Crashing, HarnessRecipe("cpu"), 5.0, start="fork")
    try:
        kind, text = runner.answer(("x", 0))
        assert kind == "refuted" and "died (exit code 3) in eager step" in text
    finally:
        runner.close()


def test_limits_come_from_the_option_the_environment_or_the_device(monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert resolve_limit(None, "cpu") == DEFAULT_LIMITS["cpu"]
    assert resolve_limit(None, "cuda") == DEFAULT_LIMITS["cuda"]
    monkeypatch.setenv(ENV, "42")
    assert resolve_limit(None, "cpu") == 42.0
    assert resolve_limit(7, "cpu") == 7.0
    monkeypatch.setenv(ENV, "soon")
    with pytest.raises(ValueError, match=f"{ENV}='soon' is not a number of seconds"):
        resolve_limit(None, "cpu")
    with pytest.raises(ValueError, match=">= 0"):
        resolve_limit(-1, "cpu")


def test_every_check_has_one_class_and_the_cpu_checks_come_from_the_table() -> None:
    assert set(Check) <= set(CHECKS)  # and the checks of CHECK_MODULES
    for check, impl in CHECKS.items():
        assert impl.check is check and impl.kinds and impl.__doc__
    assert CPU_RUNNABLE_CAPTURE_CHECKS == {
        c for c, impl in CHECKS.items() if impl.runs_on_cpu and ClaimKind.CAPTURE in impl.kinds}
    assert needs_device_graphs(Check.REPLAY) and not needs_device_graphs(Check.CAPTURE_PATH)


def test_a_fresh_interpreter_worker_rebuilds_the_harness_and_runs_claims() -> None:
    # what a cuda run starts (CUDA does not survive a fork), tried on cpu
    pytest.importorskip("torch")
    from attnreg.registry import get_registry
    from attnreg.testing.claims import expand_claims

    claims = expand_claims(get_registry().declaration("reference", "cpu"), "cpu")
    refusal = next(c for c in claims if c.kind is ClaimKind.REFUSAL)
    runner = ClaimRunner(None, HarnessRecipe("cpu"), 120.0, start="spawn")
    try:
        assert runner.answer(refusal) == ("ok", ""), refusal.id
    finally:
        runner.close()

"""One class per check: the table, registration from another module, dispatch."""

from __future__ import annotations

import pytest

from attnreg.registry import ForwardMethod, Phase, get_registry
from attnreg.testing.checks import (
    CHECKS,
    ConformanceCheck,
    needs_device_graphs,
    register_check,
)
from attnreg.testing.claims import Check, ClaimKind, expand_claims


@pytest.fixture
def registered():
    """Register check classes for one test, then take them out of the table again."""
    added: list[str] = []
    before = list(CHECKS)

    def register(cls):
        register_check(cls)
        added.append(str(cls.check))
        return cls

    yield register
    for check in added:
        CHECKS.pop(check, None)
    assert list(CHECKS) == before  # nothing else was left registered


def test_every_built_in_check_has_exactly_one_class():
    assert set(Check) <= set(CHECKS)
    for check, instance in CHECKS.items():
        assert instance.check is check and instance.kinds


def _caps():
    return get_registry().declaration("reference", "cpu")


def test_a_check_of_another_module_adds_its_claims_at_every_site(registered):
    class EverySite(ConformanceCheck):
        check = "sparse_example"
        kinds = (ClaimKind.EAGER, ClaimKind.CAPTURE)
        runs_on_cpu = False

        def declaration_claims(self, x):
            base = x.base_combo(ForwardMethod.MLA, Phase.DECODE)
            return [self.claim(x, ClaimKind.EAGER, base, "an eager statement",
                               batches=("ragged_decode",))]

        def capture_claims(self, x, site):
            return [self.capture_claim(x, site, f"{site.where}: a capture statement")]

        def run(self, harness, claim):
            raise AssertionError("not run here")

    before = {c.id for c in expand_claims(_caps(), "cpu")}
    registered(EverySite)
    claims = expand_claims(_caps(), "cpu")
    mine = [c for c in claims if c.check == "sparse_example"]
    assert {c.id for c in claims} - {c.id for c in mine} == before  # nothing else moved
    eager = [c for c in mine if c.kind is ClaimKind.EAGER]
    capture = [c for c in mine if c.kind is ClaimKind.CAPTURE]
    assert [c.id for c in eager] == \
        ["reference/eager/decode/mla/sparse_example/bf16-bf16/p16/h2/576x512"]
    # one per supported capture site (reference on cpu: tc_piecewise prefill, mla and mha)
    assert sorted(c.id for c in capture) == [
        "reference/capture/prefill/tc_piecewise/sparse_example/mha/bf16-bf16/p16/h2/192x128",
        "reference/capture/prefill/tc_piecewise/sparse_example/mla/bf16-bf16/p16/h2/576x512"]
    # runs_on_cpu False: its capture claims need device graphs, skipped on cpu
    assert all(c.needs_device_graphs and c.skip_reason for c in capture)
    assert needs_device_graphs("sparse_example")
    assert eager[0].to_dict()["check"] == "sparse_example"


def test_registration_refuses_a_second_class_a_bad_id_or_no_kinds(registered):
    class Twice(ConformanceCheck):
        check = Check.LSE
        kinds = (ClaimKind.EAGER,)

    with pytest.raises(ValueError, match="two classes for check 'lse'"):
        register_check(Twice)

    class BadId(ConformanceCheck):
        check = "Sparse Top-K"
        kinds = (ClaimKind.EAGER,)

    with pytest.raises(ValueError, match="snake_case"):
        register_check(BadId)

    class NoKinds(ConformanceCheck):
        check = "no_kinds"
        kinds = ()

    with pytest.raises(ValueError, match="kinds"):
        register_check(NoKinds)
    assert "no_kinds" not in CHECKS


def test_the_harness_dispatches_a_claim_through_its_class(registered):
    from attnreg.testing.harness import Harness

    ran = []

    class Recorded(ConformanceCheck):
        check = "recorded_example"
        kinds = (ClaimKind.EAGER,)

        def declaration_claims(self, x):
            return [self.claim(x, ClaimKind.EAGER, x.base_combo(ForwardMethod.MLA,
                                                                Phase.DECODE), "s")]

        def run(self, harness, claim):
            ran.append(claim.id)

    registered(Recorded)
    claim = next(c for c in expand_claims(_caps(), "cpu") if c.check == "recorded_example")
    Harness(get_registry(), "cpu", _caps().platform).check(claim)
    assert ran == [claim.id]

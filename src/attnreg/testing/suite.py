"""The conformance suite's test class.  Collected with ``pytest --pyargs attnreg.testing.suite``
(what ``attnreg conformance`` runs), or subclassed in a backend package's own tests::

    # tests/test_attnreg_conformance.py of a third-party backend package
    from attnreg.testing.suite import BackendConformance

    class TestMyBackendConformance(BackendConformance):
        attnreg_backends = ("my_backend",)

Each claim of each backend's declaration becomes one test item (see
:mod:`attnreg.testing.claims`); the ``attnreg`` pytest plugin parametrizes
them and writes the claims report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from .claims import Claim
    from .harness import Harness
    from .timelimit import ClaimRunner

__all__ = ["BackendConformance", "TestConformance"]


class BackendConformance:
    """Base class (not collected itself): one test per claim of the chosen backends.

    ``attnreg_backends``: the backends a subclass checks; empty means the
    ``--attnreg-backend`` options, or every backend available on the device.
    """

    attnreg_backends: ClassVar[tuple[str, ...]] = ()

    def test_claim(self, attnreg_claim: Claim, attnreg_harness: Harness | ClaimRunner) -> None:
        attnreg_harness.run(attnreg_claim)


class TestConformance(BackendConformance):
    """The suite as ``attnreg conformance`` runs it (backends from the command line)."""

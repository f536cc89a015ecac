"""The conformance suite, shipped in the wheel.

``attnreg conformance --backend NAME`` (or ``pytest --pyargs attnreg.testing.suite
--attnreg-backend NAME``) turns every claim of a backend's declaration into a
test against a float64 oracle, including real CUDA-graph capture and replay on
a GPU, and reports each claim as verified, refuted or skipped (with why).

Modules: :mod:`.claims` (declaration -> claims, pure), :mod:`.batches` (named
batch specs), :mod:`.report` (text / JSON report), :mod:`.plugin` (the pytest
plugin, registered through the ``pytest11`` entry point), :mod:`.suite` (the
test class), and, imported only when claims run, :mod:`.harness`,
:mod:`.capture_harness` and :mod:`.workload` (torch).  Importing this package
imports no torch.  See docs/conformance.md.
"""

from .claims import Check, Claim, ClaimKind, Combo, expand_claims
from .errors import ClaimRefuted, HarnessLimitation
from .report import ClaimResult, Report, Status

# The stable surface (docs/api.md).  Check and Combo stay importable from here but are
# the claim expansion's own vocabulary, not promised.
__all__ = [
    "Claim",
    "ClaimKind",
    "ClaimRefuted",
    "ClaimResult",
    "HarnessLimitation",
    "Report",
    "Status",
    "expand_claims",
]

"""Hypothesis profiles of the policy's property tests.

``make test`` runs the small default profile.  The slow profile generates
10,000 cases per property test (tens of thousands in all)::

    HYPOTHESIS_PROFILE=slow python -m pytest tests/policy -m slow
    python -m pytest tests/policy -m slow --hypothesis-profile=slow

The property tests carry the ``slow`` marker so that ``-m slow`` selects
exactly them; under the default profile they run small and stay in ``make test``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_NO_DEADLINE = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}

#: Small enough for ``make test``.
settings.register_profile("policy-default", max_examples=150, **_NO_DEADLINE)  # type: ignore[arg-type]
#: The bar of issue 16: at least 10,000 generated cases.
settings.register_profile("slow", max_examples=10_000, **_NO_DEADLINE)  # type: ignore[arg-type]
if settings.get_current_profile_name() == "default":  # not chosen on the command line
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "policy-default"))

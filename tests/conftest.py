"""Hypothesis profiles. `ci` extends Hypothesis' built-in CI profile (derandomized, loaded
automatically when CI is set) and bounds every property for `make test`; `fuzz` is the long,
randomized run of `make fuzz`."""

import os

from hypothesis import HealthCheck, settings

_ci = settings.get_profile("ci")
settings.register_profile(
    "ci",
    parent=_ci,
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz",
    max_examples=3000,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

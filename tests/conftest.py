"""Hypothesis profiles. `ci` extends Hypothesis' built-in CI profile (derandomized, loaded
automatically when CI is set) and bounds every property for `make test`; `fuzz` is the long,
randomized run of `make fuzz`."""

import os

import pytest
from hypothesis import HealthCheck, settings

from services import PostgresServer, RedisServer

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


# -- real servers for the fleet tests (tests/services.py) ---------------------------------------

@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a loopback port, for the whole session (tests may kill and restart it)."""
    reason = RedisServer.unavailable()
    if reason:
        pytest.skip(reason)
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL cluster on a loopback port, for the whole session."""
    reason = PostgresServer.unavailable()
    if reason:
        pytest.skip(reason)
    server = PostgresServer()
    try:
        server.start()
    except Exception:
        server.stop()
        raise
    yield server
    server.stop()


# -- make mutmut -----------------------------------------------------------------------------------

# Under mutmut each mutant runs the tests that cover it until the first failure: the in-process
# scenarios and the direct tests fail fastest, the Hypothesis machines and properties last.
_MUTMUT_LAST = ("test_turn_properties.py", "test_machines_stateful.py", "test_ledger_bounds.py")


def pytest_collection_modifyitems(items):
    if os.environ.get("MUTANT_UNDER_TEST"):
        items.sort(key=lambda item: (item.path.name != "test_conformance.py", item.path.name in _MUTMUT_LAST))

"""Hypothesis profiles. `ci` extends Hypothesis' built-in CI profile (derandomized, loaded
automatically when CI is set) and bounds every property for `make test`; `fuzz` is the long,
randomized run of `make fuzz`."""

import json
import os
import resource
import threading
import time
from pathlib import Path

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
    """A real redis-server on a loopback port, for the whole test run (tests may kill and restart it)."""
    reason = RedisServer.unavailable()
    if reason:
        pytest.skip(reason)
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL cluster on a loopback port, for the whole test run."""
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

# Under mutmut each mutant runs the tests that cover it until the first failure, in mutmut's order
# (the fastest first: the direct tests, then the in-process scenarios), the Hypothesis machines and
# properties last.
_MUTMUT_LAST = ("test_turn_properties.py", "test_machines_stateful.py", "test_ledger_bounds.py")


def pytest_collection_modifyitems(items):
    if os.environ.get("MUTANT_UNDER_TEST"):
        items.sort(key=lambda item: item.path.name in _MUTMUT_LAST)  # stable: mutmut's order otherwise


# mutmut 3.8.1 bounds a mutant by CPU time only, at (estimate + 1) * timeout_multiplier * 2: a
# mutant that waits forever, or loops while its memory grows, ran unchecked for minutes. Each test
# under a mutant gets a wall-clock budget (10 s + 5 times the duration mutmut recorded for it on
# the unmutated code) and the worker a memory ceiling; a test past its budget ends the worker with
# mutmut's own "timeout" exit code (36). A hang is a caught mutant: make test would time out on it.
_MUTANT_HANG_EXIT = 36
_MUTANT_MEMORY_BYTES = 3 * 1024**3
_mutant_deadline = [float("inf")]


def _mutant_under_test():
    return "__mutmut_" in os.environ.get("MUTANT_UNDER_TEST", "")


def _watch_for_a_hang():
    while True:
        time.sleep(0.5)
        if time.monotonic() > _mutant_deadline[0]:
            os._exit(_MUTANT_HANG_EXIT)


def pytest_sessionstart(session):
    if not _mutant_under_test():
        return
    resource.setrlimit(resource.RLIMIT_AS, (_MUTANT_MEMORY_BYTES, _MUTANT_MEMORY_BYTES))
    stats = Path(__file__).resolve().parent.parent / "mutmut-stats.json"
    session.config.mutant_test_s = json.loads(stats.read_text())["duration_by_test"] if stats.exists() else {}
    threading.Thread(target=_watch_for_a_hang, name="mutant-hang-alarm", daemon=True).start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _mutant_under_test():
        recorded = getattr(item.config, "mutant_test_s", {}).get(item.nodeid, 10.0)
        _mutant_deadline[0] = time.monotonic() + 10.0 + 5 * recorded
    yield
    _mutant_deadline[0] = float("inf")

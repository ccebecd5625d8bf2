"""The specs are load-bearing: every single-transition mutation of every spec (delete it,
redirect its destination, swap its guards), installed in place of the real spec, is caught by
the spec validator, a scenario (shared and own, in process on virtual time), a scenario that
never ends, or the direct tests of the breaker and the walk (test_health.py, test_walk.py). tests/spec_mutations.py generates and applies them.

`make test` runs all of them (about 420, a few seconds: whatever caught the last mutation is
asked first, so a sweep runs about one scenario per mutation). None may survive: a survivor is a transition whose change nothing observes,
so the diagram would not be what runs; the answer is a scenario or a test that observes it.
"""

from __future__ import annotations

import gc
import inspect
import time

import pytest
import test_health
import test_walk
from spec_mutations import all_mutations, caught_by, close_aborted_runs, observers

# direct tests of the machines, run against each mutant too (plain functions: they fail by raising)
CHECKS = tuple(getattr(module, name) for module in (test_health, test_walk)
               for name in sorted(dir(module)) if name.startswith("test_"))


# a hung mutant is stopped by an alarm in whatever coroutine it was: trio reports those as unraisable
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_every_spec_mutation_is_caught():
    mutations = all_mutations()
    watch = observers(CHECKS)
    # an observer that fails on the real specs would "catch" every mutation
    assert not [name for name, observe in watch if observe()]
    # a hung mutant's aborted run must be finalized where it hung: left to the collector, a
    # scenario coroutine was once finalized inside a later test's trio run and corrupted it. The
    # collector is off during the sweep, so that what the sweep leaves is seen
    def suspended() -> list[object]:
        return [c for c in gc.get_objects() if inspect.iscoroutine(c) and c.cr_frame is not None
                and c.__qualname__ == "run_scenario.<locals>.main"]

    gc.collect()
    before = {id(c) for c in suspended()}
    gc.disable()
    try:
        survivors = [str(m) for m in mutations if caught_by(m, watch) is None]
        close_aborted_runs()  # (a run that raised, not only one that hung, may leave one)
        assert not [c for c in suspended() if id(c) not in before]
    finally:
        gc.enable()
    assert not survivors, f"{len(survivors)} of {len(mutations)} mutations survive: {survivors}"


def _valid_mutation():
    """A mutation the spec validator lets through: the observers are asked about it."""
    return next(m for m in all_mutations() if caught_by(m, []) is None)


def test_an_observer_that_spins_without_end_is_caught_by_its_cpu_time():
    def spin() -> bool:
        while True:
            pass

    assert caught_by(_valid_mutation(), [("spin", spin)], limit_s=0.2) == "a scenario that never ends"


def test_an_observer_that_waits_without_end_is_caught_by_the_backstop():
    def wait() -> bool:
        time.sleep(60)
        return False

    assert caught_by(_valid_mutation(), [("wait", wait)], limit_s=0.2, backstop_s=0.3) == "a scenario that never ends"

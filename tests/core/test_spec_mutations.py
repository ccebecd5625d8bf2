"""The specs are load-bearing: every single-transition mutation of every spec (delete it,
redirect its destination, swap its guards), installed in place of the real spec, is caught by
the spec validator, a scenario (shared and own, in process on virtual time) or a scenario that
never ends: the scenarios alone, as an auditor runs them, except the kinds of mutation named in
SCENARIOS_CANNOT_SEE, which the direct tests of the breaker, the walk, the budget and the
admission (test_health.py, test_walk.py, test_budget_lifecycle.py) catch. tests/spec_mutations.py
generates and applies them.

`make test` runs all of them (about 420, half a minute: whatever caught the last mutation is
asked first, so a sweep runs about one scenario per mutation). None may survive: a survivor is a
transition whose change nothing observes, so the diagram would not be what runs; the answer is a
scenario (with concurrent requests, where a late result needs one) that observes it.
"""

from __future__ import annotations

import gc
import inspect
import sys
import time
from pathlib import Path

import pytest
import test_budget_lifecycle
import test_health
import test_walk
from spec_mutations import (
    Mutation,
    all_mutations,
    caught_by,
    close_aborted_runs,
    observers,
    raw_spec,
)

from relayline.adapters.sim.simulate import load_scenario, run_scenario
from relayline.machines import engine

SCENARIO_DIR = Path(__file__).resolve().parents[1] / "scenarios"
# direct tests of the machines, run against each mutant too (plain functions: they fail by raising)
CHECKS = tuple(getattr(module, name) for module in (test_health, test_walk, test_budget_lifecycle)
               for name in sorted(dir(module)) if name.startswith("test_"))


def _lease_expiry(m: Mutation) -> bool:
    return m.spec == "breaker" and raw_spec("breaker")["transitions"][m.index]["trigger"] == "lease_expired"


def _named_keys_limits(m: Mutation) -> bool:
    return m.spec in ("budget", "admission")


# the mutations only the direct tests can observe, each kind with its reason
SCENARIOS_CANNOT_SEE = {
    # a probe's lease frees it from a turn that died without its verdict; a scenario's turn always
    # gives it (the lease is timeouts.total_s from the claim, and total_s ends the turn first)
    "the lease of a probe whose turn died": _lease_expiry,
    # a named key's admission and its budget run in the gateway, before and after a turn: a
    # scenario drives turns through the core, where no key and no limit exists
    "a named key's admission and budget": _named_keys_limits,
}


# anything left to report when collected fails the sweep (tests/spec_mutations.py's alarm spares
# trio's own machinery, and a Hung it raised inside a callback is its own, dropped)
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_every_spec_mutation_is_caught():
    """Every mutation is caught, by the scenarios alone except the kinds they cannot see."""
    mutations = all_mutations()
    scenarios = observers()
    named = {name for name, _ in scenarios}
    checks = [o for o in observers(CHECKS) if o[0] not in named]
    # an observer that fails on the real specs would "catch" every mutation
    assert not [name for name, observe in scenarios + checks if observe()]
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
        unseen = [m for m in mutations if caught_by(m, scenarios) is None]
        survivors = [str(m) for m in unseen if caught_by(m, checks) is None]
        close_aborted_runs()  # (a run that raised, not only one that hung, may leave one)
        assert not [c for c in suspended() if id(c) not in before]
    finally:
        gc.enable()
    assert not survivors, f"{len(survivors)} of {len(mutations)} mutations survive: {survivors}"
    unexplained = [str(m) for m in unseen if not any(kind(m) for kind in SCENARIOS_CANNOT_SEE.values())]
    assert not unexplained, f"{len(unexplained)} mutations only the direct tests catch: {unexplained}"


def test_a_mutated_breaker_is_not_bypassed_by_its_shortcuts():
    """success on a closed breaker sent to open: the spec's entry action opens it for open_s, so
    the very next turn skips the profile (the code's own idea of where a breaker opens, and its
    shortcut for a closed one, once let that turn through as a probe)."""
    assert raw_spec("breaker")["transitions"][2] == {"trigger": "success", "source": "closed", "dest": "closed"}
    mutant = engine.build_spec(Mutation("breaker", 2, "redirect", "open").apply(raw_spec("breaker")), "mutant")
    scenario = load_scenario(SCENARIO_DIR / "b07_success_keeps_breaker_closed.toml")
    real = engine.load_spec("breaker")
    engine._CACHE["breaker"] = mutant
    try:
        trace = run_scenario(scenario)
    finally:
        engine._CACHE["breaker"] = real
    second = trace["requests"][1]
    assert [(s["provider"], s["reason"]) for s in second["skipped"]] == [("sim.a", "breaker")]
    assert [a["provider"] for a in second["attempts"]] == ["sim.b"]


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


def test_a_hung_mutant_stopped_anywhere_leaves_nothing_to_report_when_collected():
    """The alarm that stops a mutant which never ends lands wherever its CPU is: raised inside
    trio's run loop, a nursery's exit or its async generator finalizer, it left the run half torn
    down, and trio's coroutines (the run's init task, one never awaited) complained when the
    collector reached them between mutants. Stopped at 12 points of its run, nothing does."""
    hung = next(m for m in all_mutations() if str(m) == "turn.toml transitions[8] redirect to streaming")
    watch = [o for o in observers() if o[0] == "s10_stream_context_window_stops"]  # (where it hangs)
    reported: list[str] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: reported.append(f"{unraisable.object!r}: {unraisable.exc_value!r}")
    try:
        for i in range(12):
            assert caught_by(hung, watch, limit_s=0.05 + 0.05 * i) is not None
            gc.collect()
    finally:
        sys.unraisablehook = hook
    assert not reported, reported

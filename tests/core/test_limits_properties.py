"""The limits' arithmetic under Hypothesis: over random interleavings of admissions,
settlements, clock steps and workers sharing one store, no 60 s ever admits more than rpm
requests, tokens never pass tpm by more than one request's overshoot per worker in flight, and
spend never passes a budget by more than one request's cost per worker in flight.

Each simulated worker has at most one request in flight (admitted, not yet settled), as a
worker's request does between its admission and the end of its turn: the bound is per request
in flight, so this is the contract's "per worker" with one request each."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from relayline.adapters.stores.limits import MemoryLimits
from relayline.machines.limits import (
    WINDOW_S,
    ScopeLimits,
    judge,
    period_end,
    period_start,
    window_wait,
)

NOON = 1_767_268_800.0 + 12 * 3600  # 2026-01-01 12:00 UTC: no run reaches the day's end
WORKERS = 3
MAX_ESTIMATE = 40
MAX_COST = 0.01


class FleetOnOneStore(RuleBasedStateMachine):
    """Workers admitting and settling against one MemoryLimits on a clock the test steps."""

    @initialize(rpm=st.integers(1, 8), tpm=st.integers(MAX_ESTIMATE, 200), budget=st.sampled_from([0.02, 0.05]),
                team_rpm=st.integers(1, 12))
    def start(self, rpm, tpm, budget, team_rpm):
        self.now = NOON
        self.store = MemoryLimits(clock=lambda: self.now)
        self.scopes = (ScopeLimits("key", "k", rpm=rpm, tpm=tpm, budget_usd=budget, budget_period="day"),
                       ScopeLimits("team", "t", rpm=team_rpm))
        self.store._spend[f"key:k@{int(period_start(NOON, 'day'))}"] = 0.0  # seeded: the ledger is empty
        self.in_flight: dict[int, tuple] = {}
        self.admitted: list[list] = []  # [at, tokens (estimate, then billed)]
        self.spent = 0.0

    @rule(worker=st.integers(0, WORKERS - 1), estimate=st.integers(1, MAX_ESTIMATE))
    def admit(self, worker, estimate):
        if worker in self.in_flight:
            return
        refusal, ticket, standings = self.store.admit_at(self.scopes, estimate, self.now)
        if refusal is None:
            entry = [self.now, estimate]
            self.admitted.append(entry)
            self.in_flight[worker] = (ticket, entry)
            assert standings[0].requests <= self.scopes[0].rpm
        else:
            assert refusal.retry_after_s is None or refusal.retry_after_s > 0

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), cost=st.floats(0, MAX_COST))
    def settle(self, data, cost):
        worker = data.draw(st.sampled_from(sorted(self.in_flight)))
        ticket, entry = self.in_flight.pop(worker)
        billed = data.draw(st.integers(0, 2 * ticket.estimate))  # an estimate can be short by itself
        self.store.settle_at(ticket, billed, cost, self.now)
        if self.now - entry[0] < WINDOW_S:
            entry[1] = billed
        self.spent += cost

    @rule(seconds=st.floats(0, 30))
    def step(self, seconds):
        self.now += seconds

    @invariant()
    def windows_hold(self):
        if not hasattr(self, "scopes"):
            return
        key, team = self.scopes
        for at, _ in self.admitted:
            inside = [tokens for start, tokens in self.admitted if at - WINDOW_S < start <= at]
            assert len(inside) <= min(key.rpm, team.rpm)
            assert sum(inside) <= key.tpm + WORKERS * MAX_ESTIMATE

    @invariant()
    def budget_holds(self):
        if hasattr(self, "scopes"):
            assert self.spent <= self.scopes[0].budget_usd + WORKERS * MAX_COST


FleetOnOneStore.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestFleetOnOneStore = FleetOnOneStore.TestCase


@given(entries=st.lists(st.tuples(st.floats(0, 59.9), st.integers(1, 30)), max_size=20),
       limit=st.integers(1, 200), need=st.integers(1, 60))
def test_the_wait_is_exactly_when_the_request_first_fits(entries, limit, need):
    now = 100.0
    entries = sorted((now - WINDOW_S + age, w) for age, w in entries)
    wait = window_wait(entries, now, limit, need)

    def used(at):
        return sum(w for start, w in entries if start > at - WINDOW_S)

    if need > limit:
        assert wait is None
    elif used(now) + need <= limit:
        assert wait == 0
    else:
        assert wait > 0 and used(now + wait + 1e-9) + need <= limit  # it fits once the wait is over...
        assert used(now + wait - 1e-6) + need > limit  # ...and not a moment before


@given(wall=st.floats(0, 4e9), period=st.sampled_from(["day", "week", "month"]))
def test_a_period_holds_its_instant_and_the_next_starts_where_it_ends(wall, period):
    start, end = period_start(wall, period), period_end(wall, period)
    assert start <= wall < end and period_start(end, period) == end
    assert 86400 <= end - start <= 31 * 86400


def test_a_spent_budget_waits_for_the_period_and_outranks_the_windows():
    scope = ScopeLimits("key", "k", rpm=1, budget_usd=1.0, budget_period="month")
    refusal = judge(scope, [(NOON - 1, 0)], 1.0, 5, NOON)
    assert refusal.code == "budget_exceeded" and refusal.retry_after_s == period_end(NOON, "month") - NOON

"""The limits' arithmetic under Hypothesis: over random interleavings of admissions,
settlements, clock steps and workers sharing one store, no 60 s ever admits more than rpm
requests, tokens never pass tpm by more than one request's overshoot per worker in flight, and
spend never passes a budget by more than one request's cost per worker in flight.

Each simulated worker has at most one request in flight (admitted, not yet settled), as a
worker's request does between its admission and the end of its turn: the bound is per request
in flight, so this is the contract's "per worker" with one request each."""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from relayline.adapters.stores.limits import MemoryLimits
from relayline.machines.config import GatewayKey, GatewayTeam
from relayline.machines.limits import (
    DEFAULT_OUTPUT_TOKENS,
    WINDOW_S,
    ScopeLimits,
    estimate_tokens,
    judge,
    limits_of,
    period_end,
    period_start,
    window_wait,
)
from relayline.machines.wire import Message, Part, Request, Tool

NOON = 1_767_268_800.0  # 2026-01-01 12:00 UTC: no run reaches the day's end
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


# The examples below pin exact values where the properties above only bound them: each names the
# change to limits.py it catches.


def test_a_spent_budget_names_its_scope():
    # the refusal's scope is what the console and the error name (not None)
    scope = ScopeLimits("team", "t", budget_usd=2.0, budget_period="day")
    refusal = judge(scope, [], 2.5, 5, NOON)
    assert refusal.limit == "budget" and refusal.scope is scope
    assert refusal.retry_after_s == 12 * 3600  # at noon, the day ends in twelve hours


def test_the_rpm_window_counts_requests_not_tokens():
    # a request counts once in rpm whatever its tokens; a request just under the minute old
    # still counts, and the wait is exactly until it leaves the window
    scope = ScopeLimits("key", "k", rpm=2)
    assert judge(scope, [(NOON - 30, 500)], 0.0, 5, NOON) is None  # (counted as 2: refused)
    refusal = judge(scope, [(NOON - 50, 1), (NOON - 30, 1)], 0.0, 5, NOON)
    assert (refusal.limit, refusal.code, refusal.scope, refusal.retry_after_s) == (
        "rpm", "rate_limit_exceeded", scope, 10.0)


def test_the_tpm_window_waits_for_room_and_refuses_what_never_fits():
    scope = ScopeLimits("key", "k", tpm=100)
    assert judge(scope, [(NOON - 20, 40)], 0.0, 60, NOON) is None  # 40 + 60 fits: admitted
    refusal = judge(scope, [(NOON - 20, 50)], 0.0, 60, NOON)
    assert (refusal.limit, refusal.scope, refusal.retry_after_s) == ("tpm", scope, 40.0)
    never = judge(scope, [], 0.0, 101, NOON)
    assert (never.limit, never.scope, never.retry_after_s) == ("tpm", scope, None)
    assert "about 101 tokens" in never.message


def test_a_day_ends_a_day_after_it_starts():
    start = period_start(NOON, "day")
    assert start == NOON - 12 * 3600 and period_end(NOON, "day") == start + 86400
    assert period_end(NOON, "week") == period_start(NOON, "week") + 7 * 86400
    assert period_end(NOON, "month") == start + 31 * 86400  # January


def test_periods_are_utc_whatever_the_host_zone(monkeypatch):
    import time

    # the budget's calendar is UTC's: on a host west of Greenwich, March still ends on April 1
    # 00:00 UTC (read in local time, its start would fall on February 28 and the month would last
    # February's 28 days from there)
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        mid_march, april_first = 1_773_576_000.0, 1_775_001_600.0  # 2026-03-15 12:00, 2026-04-01 UTC
        assert period_end(mid_march, "month") == april_first
        assert period_end(mid_march, "day") == period_start(mid_march, "day") + 86400
    finally:
        monkeypatch.undo()
        time.tzset()


def test_a_configured_key_and_team_keep_every_limit():
    key = GatewayKey(name="k", rpm=3, tpm=400, budget_usd=2.5, budget_period="week")
    assert limits_of("key", key) == ScopeLimits("key", "k", 3, 400, 2.5, "week")
    team = GatewayTeam(name="t", tpm=9, budget_period="day")
    assert limits_of("team", team) == ScopeLimits("team", "t", None, 9, None, "day")


def test_a_fleet_without_a_shared_store_splits_each_limit():
    scope = ScopeLimits("key", "k", rpm=10, tpm=7, budget_usd=3.0)
    assert scope.share(1) is scope and scope.share(0) is scope
    assert scope.share(2) == ScopeLimits("key", "k", rpm=5, tpm=3, budget_usd=1.5)
    # a worker's part is never below one request or token, and an unset limit stays unset
    assert ScopeLimits("key", "k", rpm=2).share(3) == ScopeLimits("key", "k", rpm=1)


def test_the_estimate_is_input_chars_a_token_per_message_and_the_most_output():
    # 8 + 4 characters of text, and a tool of 1 + 2 + len("{}") = 5: 17 chars, 5 tokens
    request = Request(messages=(Message("system", (Part(text="abcd"),)), Message("user", (Part(text="abcdefgh"),))),
                      tools=(Tool("f", "dd", {}),))
    assert estimate_tokens(attrs.evolve(request, max_tokens=100), 50) == 5 + 2 + 100
    assert estimate_tokens(request, 50) == 5 + 2 + 50  # the profile's default output
    assert estimate_tokens(request, None) == 5 + 2 + DEFAULT_OUTPUT_TOKENS
    assert estimate_tokens(attrs.evolve(request, tools=()), None) == 3 + 2 + DEFAULT_OUTPUT_TOKENS

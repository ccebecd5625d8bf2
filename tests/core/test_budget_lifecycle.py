"""specs/budget.toml and specs/admission.toml as they run (machines/limits.py): every transition
taken and its state checked. Plain functions without fixtures: the spec mutation sweep
(test_spec_mutations.py) runs them against every mutant of these specs."""

from __future__ import annotations

import pytest

from relayline.machines.errors import IllegalTransition
from relayline.machines.limits import Admission, Budget, Refusal, ScopeLimits, period_end

NOON = 1_767_268_800.0 + 12 * 3600  # 2026-01-01 12:00 UTC
TEN = ScopeLimits("key", "k", budget_usd=10.0, budget_period="day")


def walk(budget: Budget, *spends: float, wall: float = NOON) -> list[str]:
    return [budget.observe(spend, wall) for spend in spends]


def test_a_budget_goes_open_warned_spent_and_stays_spent():
    budget = Budget(TEN, NOON)
    assert walk(budget, 0.0, 7.9, 8.0, 9.99, 10.0, 10.5) == ["open", "open", "warned", "warned", "spent", "spent"]
    assert budget.life.history == ["open", "open", "open", "warned", "warned", "spent", "spent"]


def test_one_turn_may_cross_both_thresholds_at_once():
    assert walk(Budget(TEN, NOON), 12.0) == ["spent"]


def test_a_new_period_opens_every_state_again():
    tomorrow = period_end(NOON, "day") + 1
    for spends, before in (((1.0,), "open"), ((9.0,), "warned"), ((10.0,), "spent")):
        budget = Budget(TEN, NOON)
        assert walk(budget, *spends)[-1] == before
        assert budget.observe(0.5, tomorrow) == "open"
        assert budget.life.history[-2:] == ["open", "open"]  # period_end, then the spend
        assert budget.observe(8.5, tomorrow) == "warned"


def test_a_request_that_fits_is_counted_then_settled_and_one_that_does_not_is_refused():
    admitted = Admission()
    assert admitted.judge(None) == "counted"
    admitted.settle()
    assert admitted.state == "settled"
    refused = Admission()
    assert refused.judge(Refusal("rpm", TEN, 3.0, "over")) == "refused"
    with pytest.raises(IllegalTransition):
        refused.settle()  # nothing was counted: there is nothing to settle

"""The ledger's backstop: whatever token counts reach it, a row bills a sane, non-negative cost."""

import math

from hypothesis import given
from hypothesis import strategies as st

from relayline.machines.config import Price
from relayline.machines.ledger import MAX_TOKENS, Usage, row

PRICE = Price(input_per_mtok=3.0, output_per_mtok=15.0)


def test_negative_counts_bill_nothing():
    line = row("p", "m", PRICE, Usage(-5, -7, -1, -1), accepted=False, outcome="ok", mode="complete")
    assert (line.input_tokens, line.output_tokens, line.cost_usd) == (0, 0, 0.0)


def test_absurd_counts_are_capped_not_raised():
    line = row("p", "m", PRICE, Usage(10**300, float("inf"), float("nan"), "x"), accepted=True, outcome="ok",
               mode="complete")
    assert line.input_tokens == MAX_TOKENS and line.output_tokens == 0
    assert math.isfinite(line.cost_usd) and line.cost_usd >= 0


@given(st.lists(st.one_of(st.integers(), st.floats(allow_nan=True), st.text(max_size=5), st.none()),
                min_size=5, max_size=5))
def test_any_counts_give_a_finite_non_negative_cost(counts):
    usage = Usage(*counts)
    line = row("p", "m", PRICE, usage, accepted=True, outcome="ok", mode="complete")
    assert 0 <= line.input_tokens <= 3 * MAX_TOKENS and 0 <= line.output_tokens <= MAX_TOKENS
    assert math.isfinite(line.cost_usd) and line.cost_usd >= 0

"""The ledger: a row per billable attempt, its totals and its cost; and its backstop: whatever
token counts reach it, a row bills a sane, non-negative cost."""

import math

from hypothesis import given
from hypothesis import strategies as st

from relayline.machines.config import Price
from relayline.machines.ledger import MAX_TOKENS, Usage, estimated_tokens, row, tokens

PRICE = Price(input_per_mtok=3.0, output_per_mtok=15.0)


def test_a_row_bills_cache_reads_and_writes_as_input_and_keeps_what_it_records():
    usage = Usage(input_tokens=1_000, output_tokens=200, cache_read_tokens=30, cache_write_tokens=4,
                  reasoning_tokens=50)
    line = row("anthropic.main", "m", PRICE, usage, accepted=False, outcome="semantic_empty", mode="stream")
    assert (line.provider, line.model, line.accepted, line.outcome, line.mode) == (
        "anthropic.main", "m", False, "semantic_empty", "stream")
    assert (line.input_tokens, line.output_tokens) == (1_034, 200)
    assert line.cost_usd == (1_034 * 3.0 + 200 * 15.0) / 1_000_000
    assert line.as_json() == {"provider": "anthropic.main", "model": "m", "accepted": False,
                              "input_tokens": 1_034, "output_tokens": 200, "cost_usd": line.cost_usd,
                              "estimated": False}


def test_an_estimate_is_a_token_for_every_four_characters_rounded_up():
    assert [estimated_tokens(n) for n in (0, 1, 4, 5, 400, -3)] == [0, 1, 1, 2, 100, 0]


def test_a_usage_is_billable_when_any_billed_count_is_not_zero():
    assert not Usage().billable and not Usage(reasoning_tokens=9).billable
    assert all(Usage(**{k: 1}).billable
               for k in ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens"))
    assert Usage().cost(PRICE) == 0.0 and Usage(output_tokens=1_000_000).cost(PRICE) == 15.0
    assert Usage(cache_write_tokens=1_000_000).cost(PRICE) == 3.0


def test_a_count_that_is_no_number_bills_zero():
    assert Usage("12", 7.9, None, [], "x") == Usage(12, 7, 0, 0, 0)
    assert Usage(MAX_TOKENS).input_tokens == MAX_TOKENS and Usage(MAX_TOKENS + 1).input_tokens == MAX_TOKENS


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


@given(st.one_of(st.integers(-3, MAX_TOKENS + 3), st.integers(), st.booleans(), st.floats(allow_nan=True),
                 st.sampled_from(["12", "x", None, 2.9, -0.5])))
def test_a_count_read_at_once_is_the_count_the_backstop_reads(value):
    """`tokens` takes a plain count in range as it is; whatever the value, it bills what the
    backstop's general reading (int(), clamped, 0 for what is not a number) makes of it."""
    try:
        general = min(max(int(value), 0), MAX_TOKENS)
    except (TypeError, ValueError, OverflowError):
        general = 0
    assert tokens(value) == general and type(tokens(value)) is int

"""The per-attempt usage and cost ledger.

Every billable attempt is one row, accepted or not: an empty completion, a semantic-empty stream,
an interrupted stream or a failure that reported usage all cost money, and an operator reading
the bill must see them. A turn's cost is the sum of its rows; nothing is inferred from notices.
"""

from __future__ import annotations

import attrs

from .config import Price

MAX_TOKENS = 10**9  # no real reply reports more; the adapters refuse more as malformed
# an estimate's rule where the provider reported no usage (an attempt cut after it forwarded
# output): a token for every 4 characters of text, OpenAI's rule of thumb for English
CHARS_PER_TOKEN = 4


def tokens(value: object) -> int:
    """A token count the ledger can bill: a backstop behind the adapters' validation, so that a
    negative count never becomes a negative cost and a huge one never overflows a row."""
    if type(value) is int and 0 <= value <= MAX_TOKENS:
        # nearly every count: one the adapters read and checked (half a Usage's making)
        return value
    try:
        count: int = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return 0
    return min(max(count, 0), MAX_TOKENS)


def estimated_tokens(chars: int) -> int:
    """The tokens `chars` characters of text are estimated at (rounded up)."""
    return -(-max(chars, 0) // CHARS_PER_TOKEN)


@attrs.frozen
class Usage:
    input_tokens: int = attrs.field(default=0, converter=tokens)
    output_tokens: int = attrs.field(default=0, converter=tokens)
    cache_read_tokens: int = attrs.field(default=0, converter=tokens)
    cache_write_tokens: int = attrs.field(default=0, converter=tokens)
    # part of output_tokens, reported apart
    reasoning_tokens: int = attrs.field(default=0, converter=tokens)

    @property
    def billable(self) -> bool:
        return bool(self.input_tokens or self.output_tokens or self.cache_read_tokens
                    or self.cache_write_tokens)

    def cost(self, price: Price) -> float:
        # cache reads and writes are billed as input here: the price table has one input rate
        tokens_in = self.input_tokens + self.cache_read_tokens + self.cache_write_tokens
        spent = tokens_in * price.input_per_mtok + self.output_tokens * price.output_per_mtok
        return spent / 1_000_000


@attrs.frozen
class LedgerRow:
    provider: str
    model: str
    accepted: bool
    input_tokens: int
    output_tokens: int
    cost_usd: float
    outcome: str = ""
    mode: str = "complete"
    # the provider reported no usage for output it had already streamed (a hang-up, a drain, a
    # cut, a stall): the tokens are relayline's estimate of what it bills
    estimated: bool = False

    def as_json(self) -> dict[str, object]:
        return {
            "provider": self.provider,
            "model": self.model,
            "accepted": self.accepted,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": self.cost_usd,
            "estimated": self.estimated,
        }


def row(provider: str, model: str, price: Price, usage: Usage, *, accepted: bool, outcome: str,
        mode: str, estimated: bool = False) -> LedgerRow:
    return LedgerRow(
        provider=provider,
        model=model,
        accepted=accepted,
        input_tokens=usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens,
        output_tokens=usage.output_tokens,
        cost_usd=usage.cost(price),
        outcome=outcome,
        mode=mode,
        estimated=estimated,
    )

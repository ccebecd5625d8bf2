"""The per-attempt usage and cost ledger.

Every billable attempt is one row, accepted or not: an empty completion, a semantic-empty stream,
an interrupted stream or a failure that reported usage all cost money, and an operator reading
the bill must see them. A turn's cost is the sum of its rows; nothing is inferred from notices.
"""

from __future__ import annotations

import attrs

from .config import Price


@attrs.frozen
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0  # part of output_tokens (billed with them), reported apart

    @property
    def billable(self) -> bool:
        return bool(self.input_tokens or self.output_tokens or self.cache_read_tokens or self.cache_write_tokens)

    def cost(self, price: Price) -> float:
        # cache reads and writes are billed as input here: the price table has one input rate
        tokens_in = self.input_tokens + self.cache_read_tokens + self.cache_write_tokens
        return (tokens_in * price.input_per_mtok + self.output_tokens * price.output_per_mtok) / 1_000_000


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

    def as_json(self) -> dict[str, object]:
        return {
            "provider": self.provider,
            "model": self.model,
            "accepted": self.accepted,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": self.cost_usd,
        }


def row(provider: str, model: str, price: Price, usage: Usage, *, accepted: bool, outcome: str, mode: str) -> LedgerRow:
    return LedgerRow(
        provider=provider,
        model=model,
        accepted=accepted,
        input_tokens=usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens,
        output_tokens=usage.output_tokens,
        cost_usd=usage.cost(price),
        outcome=outcome,
        mode=mode,
    )

"""A finished turn as the console shows it: its attribution and attempts, each attempt paired
with the ledger row that bills it, and never its text. Its own module because this is the
console's record of a turn (kept as observed, `EndedTurn`, until first shown, then as its view,
`TurnView`), apart from the live state (routes, health, lifecycles, cost) that console.py reads
and serves."""

from __future__ import annotations

from typing import Any

import attrs

from relayline.machines.turn import AttemptRecord, TurnResult


@attrs.frozen
class AttemptView:
    profile: str
    model: str
    mode: str
    outcome: str
    reason: str | None
    key: int | None
    latency_ms: float | None
    input_tokens: int
    output_tokens: int
    cost_usd: float
    billed: bool


@attrs.frozen
class TurnView:
    """One finished turn as the console shows it: attribution and attempts, never text."""

    seq: int
    turn: str
    at: float  # wall clock, for the operator
    requested: str
    served: str | None
    outcome: str
    error: str | None
    fallback: bool
    latency_ms: float
    cost_usd: float
    attempts: tuple[AttemptView, ...]
    skipped: tuple[tuple[str, str, str], ...]  # (profile, model, reason)

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def attempt_ms(attempt: AttemptRecord, ended: float) -> float | None:
    """An attempt's time in ms, to its own end or, still open at the turn's end, to that."""
    end = attempt.ended if attempt.ended is not None else ended
    return round((end - attempt.at) * 1000, 1) if end >= attempt.at else None


def turn_view(seq: int, turn_id: str, result: TurnResult | EndedTurn, latency_s: float,
              ended: float, wall: float) -> TurnView:
    """Pair each attempt with its ledger row. Rows are appended together with the attempt they
    bill, in the same order, so the next unmatched row of the same profile, model, outcome and
    mode is that attempt's."""
    rows = list(result.ledger)
    attempts = []
    for a in result.attempts:
        row = None
        for i, r in enumerate(rows):
            if (r.provider, r.model, r.outcome, r.mode) == (a.provider, a.model, a.outcome, a.mode):
                row = rows.pop(i)
                break
        attempts.append(AttemptView(
            a.provider, a.model, a.mode, a.outcome, a.reason, a.key, attempt_ms(a, ended),
            row.input_tokens if row else 0, row.output_tokens if row else 0,
            row.cost_usd if row else 0.0, row is not None))
    return TurnView(
        seq=seq, turn=turn_id, at=round(wall, 3), requested=result.requested,
        served=result.served.label if result.served else None, outcome=result.outcome,
        error=result.error,
        fallback=result.fallback, latency_ms=round(latency_s * 1000, 1), cost_usd=result.cost_usd,
        attempts=tuple(attempts),
        skipped=tuple((s.profile, s.model, s.reason) for s in result.skipped))


class EndedTurn:
    """A finished turn as the console keeps it until it is shown: what its view reads of the
    result, never the result itself (its text may be large, and it is not the console's)."""

    __slots__ = ("seq", "turn", "latency_s", "ended", "wall", "requested", "served", "outcome",
                 "error", "fallback",
                 "attempts", "ledger", "skipped", "cost_usd")

    def __init__(self, seq: int, turn: str, result: TurnResult, latency_s: float, ended: float,
                 wall: float) -> None:
        self.seq, self.turn, self.latency_s, self.ended, self.wall = (
            seq,
            turn,
            latency_s,
            ended,
            wall,
        )
        self.requested, self.served, self.outcome = result.requested, result.served, result.outcome
        self.error, self.fallback = result.error, result.fallback
        self.attempts, self.ledger, self.skipped = result.attempts, result.ledger, result.skipped
        self.cost_usd = result.cost_usd

    def view(self) -> TurnView:
        return turn_view(self.seq, self.turn, self, self.latency_s, self.ended, self.wall)

"""The refusal policy of a turn (reliability.on_refusal), sans-I/O.

A refusal is a provider's content policy answering instead of the model: a completion whose
finish reason is content_filter, or a content-policy 400. With on_refusal = "return" it is what
it always was (an answer, or a client error); with "advance" the walk moves past it to the next
entry, the profile is not asked again in the turn, and when nothing is left to advance to the
last refusal settles the turn: it is the answer as it came, or the client error it was."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from . import classify as fc
from .ledger import Usage
from .plan import PlannedEntry
from .results import Completion
from .vocab import ErrorReason, Mode
from .walk import WalkDone

# the turn (machines/turn.py) imports this module: it is named here by what it is, not its class
Turn = Any

# the ends of a walk that found nothing better than the last refusal: it settles them
SETTLED_BY_REFUSAL = frozenset({ErrorReason.EXHAUSTED, ErrorReason.SEMANTIC_EMPTY, ErrorReason.NO_CANDIDATE})


@attrs.frozen
class Refusal:
    """The turn's last refusal (on_refusal = "advance"): when nothing is left to advance to, it is
    the answer (a refusal completion) or the error (a content-policy 400 is a client error)."""

    entry: PlannedEntry
    answer: Completion | None  # None: an HTTP 400 or an in-band error event
    attempt: int  # its index in the turn's attempts
    row: int | None  # its index in the turn's ledger, when it was billed
    mode: Mode


def as_configured(failure: fc.Failure, advance: bool) -> fc.Failure:
    """on_refusal = "return" (`advance` false): a content-policy 400 is the client error it always was."""
    if failure.kind == fc.REFUSED and not advance:
        return attrs.evolve(failure, kind=fc.REJECTED)
    return failure


def record(turn: Turn, failure: fc.Failure, now: float, *, answer: Completion | None = None,
           usage: Usage | None = None) -> fc.Failure:
    """Record a refusal the walk advances past; the profile is not asked again this turn."""
    rows = len(turn.ledger)
    turn._record(fc.REFUSED, now, reason=fc.REFUSED, detail=failure.detail, usage=usage, failure=failure)
    call = turn._call()
    entry = call.entry
    turn.refusal = Refusal(entry, answer, len(turn.attempts) - 1, rows if len(turn.ledger) > rows else None,
                           call.mode)
    turn.health.refused.add(entry.profile)
    return failure


@attrs.frozen
class Settlement:
    """What specs/turn.toml's [outcomes.refusal_settles] reads: the walk's end and the last refusal."""

    refusal: Refusal
    done: WalkDone

    @property
    def walk_found_nothing(self) -> bool:
        return not self.done.ok and self.done.error in SETTLED_BY_REFUSAL

    @property
    def refusal_answered(self) -> bool:
        return self.refusal.answer is not None


def settle(turn: Turn, refusal: Refusal, done: WalkDone) -> WalkDone:
    """The end of the walk that advanced past the last refusal, as [outcomes.refusal_settles]
    says: it stands, or the refusal is the answer as it came, or the client error it was."""
    how = turn.life.spec.outcomes["refusal_settles"].decide(Settlement(refusal, done))
    return SETTLE[how](turn, refusal, done)


def _stands(turn: Turn, refusal: Refusal, done: WalkDone) -> WalkDone:
    return done


def _client_error(turn: Turn, refusal: Refusal, done: WalkDone) -> WalkDone:
    if refusal.attempt == len(turn.attempts) - 1:  # nothing was tried after it: not advanced past
        turn.attempts[-1] = attrs.evolve(turn.attempts[-1], outcome=fc.REJECTED)
    return WalkDone(ok=False, entry=refusal.entry, error=ErrorReason.CLIENT_ERROR)


def _answer(turn: Turn, refusal: Refusal, done: WalkDone) -> WalkDone:
    attempts = turn.attempts
    last = refusal.attempt == len(attempts) - 1  # nothing was tried after it: not advanced past
    if last:
        attempts[-1] = attrs.evolve(attempts[-1], outcome=fc.OK, reason=None)
    if refusal.row is not None:  # the client gets it: its row is the accepted one
        row = turn.ledger[refusal.row]
        turn.ledger[refusal.row] = attrs.evolve(row, accepted=True, outcome=fc.OK if last else row.outcome)
    turn.answer = refusal.answer
    return WalkDone(ok=True, entry=refusal.entry)


# what [outcomes.refusal_settles] may give, and what each does (checked when a turn binds the spec)
SETTLE: dict[str, Callable[[Turn, Refusal, WalkDone], WalkDone]] = {
    "stands": _stands,
    "answer": _answer,
    "client_error": _client_error,
}

"""The refusal policy of a turn (reliability.on_refusal), sans-I/O.

A refusal is a provider's content policy answering instead of the model: a completion whose
finish reason is content_filter, or a content-policy 400 or in-band error. What one makes of its
attempt is specs/turn.toml's [outcomes.refusal], by the configured mode: with "return" it is
what it always was (an answer, or a client error); with "advance" the walk moves past it to the
next entry and the profile is not asked again in the turn, unless output was already shown (then
the stream's rules stand). When nothing is left to advance to, [outcomes.refusal_settles] says
what the last refusal makes of the turn: the answer as it came, or the client error it was.

Nothing here knows the turn: the turn (turn_core.py) hands in the records a settlement amends.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from . import classify as fc
from .candidates import WalkDone
from .ledger import LedgerRow
from .plan import PlannedEntry
from .results import AttemptRecord, Completion
from .tables import OutcomeTable
from .vocab import ErrorReason, Mode

# the ends of a walk that found nothing better than the last refusal: it settles them
SETTLED_BY_REFUSAL = frozenset({ErrorReason.EXHAUSTED, ErrorReason.SEMANTIC_EMPTY,
                                ErrorReason.NO_CANDIDATE})
# what [outcomes.refusal] may give (checked when a turn binds the spec): the walk moves past it;
# it is the answer; it is a client error; it cuts output already shown, named a refusal
REFUSAL_WAYS = frozenset({"advance", "answer", "client_error", "cut"})


@attrs.frozen
class Refusal:
    """The turn's last refusal (on_refusal = "advance"): when nothing is left to advance to, it is
    the answer (a refusal completion) or the error (a content-policy 400 is a client error)."""

    entry: PlannedEntry
    answer: Completion | None  # None: an HTTP 400 or an in-band error event
    attempt: int  # its index in the turn's attempts
    row: int | None  # its index in the turn's ledger, when it was billed
    mode: Mode


@attrs.frozen
class RefusalCase:
    """What specs/turn.toml's [outcomes.refusal] reads of one refusal."""

    refusals_advance: bool  # reliability.on_refusal = "advance"
    refusal_answered: bool  # it came as an answer (finish reason content_filter)
    output_shown: bool  # the refused call extends output the turn already showed


def way(table: OutcomeTable, *, advance: bool, answered: bool, shown: bool) -> str:
    """What a refusal makes of its attempt, as [outcomes.refusal] says."""
    return table.decide(RefusalCase(advance, answered, shown))


def as_client_error(failure: fc.Failure) -> fc.Failure:
    """A content-policy error that stands (on_refusal = "return"): the client error it always
    was."""
    return attrs.evolve(failure, kind=fc.REJECTED)


@attrs.frozen
class Settlement:
    """What specs/turn.toml's [outcomes.refusal_settles] reads: the walk's end and the last
    refusal."""

    refusal: Refusal
    done: WalkDone

    @property
    def walk_found_nothing(self) -> bool:
        return not self.done.ok and self.done.error in SETTLED_BY_REFUSAL

    @property
    def refusal_answered(self) -> bool:
        return self.refusal.answer is not None


def settle(table: OutcomeTable, refusal: Refusal, done: WalkDone, attempts: list[AttemptRecord],
           ledger: list[LedgerRow]) -> WalkDone:
    """The end of the walk that advanced past the last refusal, as [outcomes.refusal_settles]
    (`table`) says: it stands, or the refusal is the answer as it came (the walk's end is then
    an answer whose entry is the refusal's; the turn takes `refusal.answer`), or the client
    error it was. The turn's `attempts` and `ledger` are amended to say so."""
    how = table.decide(Settlement(refusal, done))
    return SETTLE[how](refusal, done, attempts, ledger)


def _stands(refusal: Refusal, done: WalkDone, attempts: list[AttemptRecord],
            ledger: list[LedgerRow]) -> WalkDone:
    return done


def _client_error(refusal: Refusal, done: WalkDone, attempts: list[AttemptRecord],
                  ledger: list[LedgerRow]) -> WalkDone:
    if refusal.attempt == len(attempts) - 1:  # nothing was tried after it: not advanced past
        attempts[-1] = attrs.evolve(attempts[-1], outcome=fc.REJECTED)
    return WalkDone(ok=False, entry=refusal.entry, error=ErrorReason.CLIENT_ERROR)


def _answer(refusal: Refusal, done: WalkDone, attempts: list[AttemptRecord],
            ledger: list[LedgerRow]) -> WalkDone:
    last = refusal.attempt == len(attempts) - 1  # nothing was tried after it: not advanced past
    if last:
        attempts[-1] = attrs.evolve(attempts[-1], outcome=fc.OK, reason=None)
    if refusal.row is not None:  # the client gets it: its row is the accepted one
        row = ledger[refusal.row]
        ledger[refusal.row] = attrs.evolve(row, accepted=True,
                                           outcome=fc.OK if last else row.outcome)
    return WalkDone(ok=True, entry=refusal.entry)


Settle = Callable[[Refusal, WalkDone, list[AttemptRecord], list[LedgerRow]], WalkDone]
# what [outcomes.refusal_settles] may give, and what each does (checked when a turn binds the
# spec)
SETTLE: dict[str, Settle] = {
    "stands": _stands,
    "answer": _answer,
    "client_error": _client_error,
}

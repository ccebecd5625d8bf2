"""What entering each state of a turn, and of its cancellation, does (specs/turn.toml and
specs/cancellation.toml [entry_actions]), sans-I/O.

The turn fires a trigger; the spec's guards choose the state; the functions here, bound to the
state's entry actions by name, act: open the stream or start a walk, continue an interrupted
stream, or end the turn with its result. Each takes the turn and returns what the driver does
next; the last one a state runs gives it."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from . import classify as fc
from . import refusals
from .candidates import Call, Need, WalkDone, key_index
from .lifecycle import Spec, bind_entry_actions, check_outcomes
from .plan import PlannedEntry
from .results import Action, Finish, delivery
from .stream import Event
from .turn_core import TurnCore
from .vocab import (
    CancellationState,
    CancellationTrigger,
    ErrorReason,
    Mode,
    Outcome,
    StreamOutcome,
    TurnState,
)
from .walk import Walk

_STREAM, _COMPLETE_MODE = Mode.STREAM, Mode.COMPLETE
_FINISH, _CANCEL = CancellationTrigger.FINISH, CancellationTrigger.CANCEL


# -- entry actions (specs/turn.toml [entry_actions]) ------------------------------------------

def stream(turn: TurnCore) -> Action:
    walk, now = turn.walk, turn.now
    if walk is not None:  # re-entered after a failed attempt: the walk it belongs to decides it
        return turn._follow(walk.on_result(_failure(turn), now), now)
    # (the guard that chose this entry) the walk picks each streamed attempt
    if turn.streaming_recovery:
        streams = Need(stream=True, tools=turn.tools)
        return turn._walk_from(Walk(turn.plan, turn.config, turn.health, mode_for=lambda e: (
            _STREAM if streams.met_by(e.provider.capabilities) else _COMPLETE_MODE)), now)
    entry = turn._first_stream()
    assert entry is not None, "streaming without an entry that can stream"
    turn.health.before_attempt(entry.profile, now)
    budget = turn.config.reliability.provider_retries + 1
    return turn._begin(Call(entry, _STREAM, key_index(turn.health.store, entry), 1, budget), now)


def walk_plan(turn: TurnCore) -> Action:
    return turn._walk_from(Walk(turn.plan, turn.config, turn.health), turn.now)


def recover(turn: TurnCore) -> Action:
    return _recovery(turn, turn._call().entry, _failure(turn), turn.now)


def semantic_empty_walk(turn: TurnCore) -> Action:
    return _semantic_empty_recovery(turn, turn._call().entry, turn.now)


def continue_stream(turn: TurnCore) -> Action:
    candidate = turn.continuation
    assert candidate is not None, "continuing without a candidate"
    turn.health.before_attempt(candidate.profile, turn.now)
    return turn._begin(Call(candidate, _STREAM, key_index(turn.health.store, candidate), 1, 1,
                            prefill="".join(turn.forwarded)), turn.now)


def answered(turn: TurnCore) -> Finish:
    done = turn.walk_result
    served = done.entry if done is not None else turn._call().entry  # (None: a stream's end)
    mode = turn.answer_mode
    return _finish(turn, Outcome.OK, None, served, None, _delivery(turn, mode))


def ended_failed(turn: TurnCore) -> Finish:
    done = turn.walk_result
    if done is None:  # a stream's end led here, not a walk's
        done = _stopped(turn) if turn.failure is not None else WalkDone(
            ok=False, entry=turn._call().entry, error=ErrorReason.SEMANTIC_EMPTY)
        if turn.refusal is not None:
            done = turn._settled(done)
    return _finish(turn, Outcome.ERROR, done.error or ErrorReason.EXHAUSTED, None, None)


def ended_interrupted(turn: TurnCore) -> Finish:
    return _finish(turn, Outcome.INTERRUPTED, ErrorReason.INTERRUPTED, None,
                   "".join(turn.forwarded))


def ended_cancelled(turn: TurnCore) -> Finish:
    partial: str | None = turn.cancellation.step(_CANCEL, turn, turn.cancellation_actions)
    return Finish(turn.result(Outcome.CANCELLED, ErrorReason.CANCELLED, None, partial))


# -- entry actions (specs/cancellation.toml [entry_actions]) ------------------------------

def settle(turn: TurnCore) -> str | None:
    partial: str | None = turn.cancellation.step(CancellationTrigger.SETTLE, turn,
                                                 turn.cancellation_actions)
    return partial


def keep_partial(turn: TurnCore) -> str:
    return "".join(turn.forwarded)


def drop_partial(turn: TurnCore) -> None:
    return None


# -- what the entry actions share ---------------------------------------------------------

def _failure(turn: TurnCore) -> fc.Failure:
    failure: fc.Failure | None = turn.failure
    assert failure is not None, "no stream failure is being decided"
    return failure


def _stopped(turn: TurnCore) -> WalkDone:
    """A stream failure the policy stops on, as a walk states it (and records its path)."""
    entry = turn._call().entry
    walk = Walk(turn.plan, turn.config, turn.health, exclude=frozenset({entry.index}))
    turn.walks.append(walk)
    stopped = walk.note_failure(entry.index, _failure(turn), turn.now)
    assert stopped is not None, "a failure the policy stops on"
    return stopped


def _finish(turn: TurnCore, outcome: Outcome, error: ErrorReason | None,
            served: PlannedEntry | None, partial: str | None,
            deliver: tuple[Event, ...] = ()) -> Finish:
    """The turn's end: nothing is pending, every probe it holds is handed back, and the
    cancellation lifecycle learns the turn finished first."""
    turn.call = None
    if turn.health.probes:  # (a walk that ended released them)
        turn.health.release_all()
    turn.cancellation.fire(_FINISH)
    return Finish(turn.result(outcome, error, served, partial), deliver)


def _semantic_empty_recovery(turn: TurnCore, entry: PlannedEntry, now: float) -> Action:
    # the exact entry gets one non-streaming recovery attempt when retries > 0
    # (replay-safe), or when it is the only candidate; both at once merge into one attempt
    index = entry.index
    turn.now = now
    allowance = ALLOWANCES[turn.life.spec.outcomes["semantic_empty_allowance"].decide(turn)]
    # the other candidates get their normal budgets, less what this turn already spent on
    # them (stream.recovery = streaming may have walked them before this stream)
    normal = turn.config.reliability.provider_retries + 1
    budgets = {j: max(0, normal - n) for j, n in turn.spent.items()}
    budgets[index] = allowance
    walk = Walk(turn.plan, turn.config, turn.health, budgets=budgets)
    walk.last_failure = fc.EMPTY
    return turn._walk_from(walk, now)


def _recovery(turn: TurnCore, entry: PlannedEntry, failure: fc.Failure, now: float) -> Action:
    """stream.recovery = non_streaming: the walk in configured order, skipping the exact
    entry, unless it is the only candidate (then the stream was its first attempt)."""
    index = entry.index
    if turn._only_candidate(index, now):
        walk = Walk(turn.plan, turn.config, turn.health)
        return turn._walk_from(walk, now, walk.adopt(index, failure, now))
    walk = Walk(turn.plan, turn.config, turn.health, exclude=frozenset({index}))
    walk.note_failure(index, failure, now)
    return turn._walk_from(walk, now)


def _delivery(turn: TurnCore, mode: Mode) -> tuple[Event, ...]:
    """A stream turn answered by an entry that did not stream: the answer as one delivery,
    whose text is then forwarded."""
    answer = turn.answer
    if answer is None or not turn.stream_requested or mode != _COMPLETE_MODE:
        return ()
    if answer.text:
        turn.forwarded.append(answer.text)
    return delivery(answer, turn.shown_reasoning)


# the entry actions specs/turn.toml and specs/cancellation.toml name, checked against them when a
# turn binds them
ENTRY_ACTIONS: dict[str, Callable[[TurnCore], object]] = {
    "stream": stream,
    "walk": walk_plan,
    "recover": recover,
    "semantic_empty_walk": semantic_empty_walk,
    "continue_stream": continue_stream,
    "answered": answered,
    "ended_failed": ended_failed,
    "ended_interrupted": ended_interrupted,
    "ended_cancelled": ended_cancelled,
}
CANCELLATION_ACTIONS: dict[str, Callable[[TurnCore], object]] = {
    "settle": settle,
    "keep_partial": keep_partial,
    "drop_partial": drop_partial,
}


# what the turn spec's outcome tables may give, and what the turn does with each
ALLOWANCES = {"one_more": 1, "none": 0}


@attrs.frozen
class FailedStreamRecord:
    """How the attempt of a failed stream is recorded, by what [outcomes.failed_stream] gives."""

    outcome: StreamOutcome  # interrupted (its output had reached the sink) or stream_failed
    continuation: bool  # the detail names the continuation whose stream failed
    billed: bool  # billed even without usage; else only as the provider reported it
    estimated: bool  # without usage, billed at relayline's estimate of the text shown
    counts_rejection: bool  # a client's rejection counts as one (nothing was shown)


# what [outcomes.failed_stream] may give, and what each records (checked when a turn binds the
# spec)
FAILED_STREAM = {
    "failed": FailedStreamRecord(StreamOutcome.STREAM_FAILED, continuation=False, billed=False,
                                 estimated=False, counts_rejection=True),
    "interrupted": FailedStreamRecord(StreamOutcome.INTERRUPTED, continuation=False, billed=True,
                                      estimated=True, counts_rejection=False),
    "continuation_failed": FailedStreamRecord(StreamOutcome.STREAM_FAILED, continuation=True,
                                              billed=True, estimated=False,
                                              counts_rejection=False),
    "continuation_interrupted": FailedStreamRecord(StreamOutcome.INTERRUPTED, continuation=True,
                                                   billed=False, estimated=False,
                                                   counts_rejection=False),
}


def bind(spec: Spec) -> dict[str, tuple[Callable[[TurnCore], object], ...]]:
    # entering any state but the first and `committed` (where frames flow on) is what the turn
    # does next: each needs an action
    check_outcomes(spec, "semantic_empty_allowance", ALLOWANCES)
    check_outcomes(spec, "failed_stream", FAILED_STREAM)
    check_outcomes(spec, "refusal_settles", refusals.SETTLE)
    check_outcomes(spec, "refusal", refusals.REFUSAL_WAYS)
    required = set(spec.states) - {spec.initial, TurnState.COMMITTED}
    return bind_entry_actions(spec, ENTRY_ACTIONS, required=required)


def bind_cancellation(spec: Spec) -> dict[str, tuple[Callable[[TurnCore], object], ...]]:
    # a cancellation settles at once, and each way it settles says what is persisted
    required = set(spec.states) - {spec.initial, CancellationState.FINISHED}
    return bind_entry_actions(spec, CANCELLATION_ACTIONS, required=required)

"""One turn, end to end (specs/turn.toml and specs/cancellation.toml), sans-I/O.

The turn composes the pieces: it opens the stream on the first entry that can serve it, feeds
frames through the commit gate, hands a pre-commit failure to a recovery walk, gives a
semantic-empty stream its allowances, and settles cancellation. It records every attempt, skip
and ledger row, and builds the result: attribution, notice, aggregated error.

The driver calls it in the h11 style: `start` returns the first action; each reported result
(`on_completion`, `stream_*`, `on_timer`) returns the next one, until a `Finish`. The turn's
state, records and steps are turn_core.py; what entering a state does turn_actions.py; the
records results.py; the refusal policy refusals.py.
"""

from __future__ import annotations

from . import classify as fc
from . import turn_actions
from .candidates import Call, Sleep, WalkDone
from .errors import IllegalTransition
from .ledger import Usage
from .plan import PlannedEntry
from .refusals import as_client_error
from .results import (
    Action,
    AttemptRecord,
    Completion,
    Finish,
    Rejection,
    TurnResult,
)
from .stream import Event, Frame
from .turn_core import EntryActions, TurnCore
from .vocab import (
    ErrorReason,
    EventKind,
    FailureClass,
    Mode,
    Outcome,
    StreamOutcome,
    StreamState,
    TurnState,
    TurnTrigger,
    WalkState,
)
from .wire import CONTENT_FILTER

# the records a turn gives back live in results.py; the library and the gateway import them from
# here too
__all__ = ["Action", "AttemptRecord", "Call", "Completion", "Finish", "Rejection", "Sleep", "Turn",
           "TurnResult"]

# the words a turn reads a dozen times, once as module names: an enum member read is dearer
_STREAMING, _CONTINUING = TurnState.STREAMING, TurnState.CONTINUING
_START, _COMMIT, _COMPLETE, _FAIL = (TurnTrigger.START, TurnTrigger.COMMIT, TurnTrigger.COMPLETE,
                                     TurnTrigger.FAIL)
_STREAM = Mode.STREAM
# (and per event of a stream: stream_frame tells them apart for every event it forwards)
_TEXT, _REASONING, _EXECUTED_TOOL = EventKind.TEXT, EventKind.REASONING, EventKind.EXECUTED_TOOL


class Turn(TurnCore):
    __slots__ = ()
    # the entry actions it binds when it is made (TurnCore's __init__)
    turn_entry = EntryActions(turn_actions.ENTRY_ACTIONS, turn_actions.bind)
    cancellation_entry = EntryActions(turn_actions.CANCELLATION_ACTIONS,
                                      turn_actions.bind_cancellation)

    def start(self, now: float) -> Action:
        """The turn's first action: the spec's `start` chooses stream or walk by its guards, and
        the state it enters says how (its entry actions)."""
        self.now = now
        return self._step(_START)

    def on_timer(self, now: float) -> Action:
        return self._follow(self._walk().on_timer(now), now)

    # -- non-streaming results ----------------------------------------------------------------

    def on_completion(self, result: Completion | fc.Failure, now: float) -> Action:
        """The pending complete-mode call answered (a Completion) or failed (a Failure). A
        refusal among them does what [outcomes.refusal] says (nothing was shown by this call)."""
        if isinstance(result, fc.Failure):
            if result.kind == fc.REFUSED:
                if self._refusal_way(answered=False, shown=False) == "advance":
                    failure = self._record_refusal(result, now)
                    return self._follow(self._walk().on_result(failure, now), now)
                result = as_client_error(result)
            self._record(result.kind, now, reason=result.kind, detail=result.detail,
                         usage=None, failure=result)
            return self._follow(self._walk().on_result(result, now), now)
        # an answer the provider gave without counting it (a refusal, an empty one too) is billed
        # at relayline's estimate, as any answer is: a usage not reported is not a usage of zero
        if result.refusal and self._refusal_way(answered=True, shown=False) == "advance":
            failure = self._record_refusal(
                fc.Failure(fc.REFUSED, "refusal: finish reason content_filter"), now,
                answer=result, usage=result.usage)
            return self._follow(self._walk().on_result(failure, now), now)
        if not result.has_answer:
            self._record(fc.EMPTY, now, reason=fc.EMPTY, detail="empty completion",
                         usage=result.usage, shown=True, answer=result)
            empty = fc.Failure(fc.EMPTY, "empty completion")
            return self._follow(self._walk().on_result(empty, now), now)
        # a token count is no completion: the provider bills nothing for it, nor does the ledger;
        # an answer the provider billed but did not count is billed at relayline's estimate
        counted = result.input_count is not None
        self._record(fc.OK, now, usage=result.usage or Usage() if counted else result.usage,
                     accepted=True, bill=not counted, shown=not counted, answer=result)
        self.answer = result
        walk = self.walk
        assert walk is not None, "no walk is running"
        return self._follow(walk.on_result(None, now), now)

    # -- streaming ----------------------------------------------------------------------------

    def stream_headers(self) -> None:
        self._gate().headers()

    def stream_frame(self, frame: Frame) -> tuple[Event, ...]:
        """One frame of the open stream; returns the events to forward to the immutable sink."""
        gate = self.gate
        assert gate is not None, "no stream is open"
        was_committed = gate.committed
        events = gate.feed(frame)
        if events and not was_committed and self.life.state != _CONTINUING:
            # the gate committed: so does the turn (a continuation extends a committed turn)
            self.life.fire(_COMMIT)
            if self.walk is not None and self.walk.life.state == WalkState.CALLING:
                self.walk.on_committed()
        if events and not was_committed and self.call is not None:
            self.shown_by = self.call.entry
        for event in events:
            kind = event.kind
            if kind == _TEXT:
                self.forwarded.append(event.value)
            elif kind == _REASONING:
                self.shown_reasoning = True
            elif kind == _EXECUTED_TOOL:
                self.executed_tools = True
        return events

    def withdraw(self, events: tuple[Event, ...] | list[Event]) -> None:
        """The last `events` stream_frame returned never reached the consumer (it left while
        they waited for it to take them): they are not forwarded, so a cancellation's partial
        text is exactly what the consumer received."""
        texts = [event.value for event in events if event.kind == EventKind.TEXT]
        if texts:
            if self.forwarded[-len(texts):] != texts:
                raise ValueError("only the events stream_frame returned last can be withdrawn")
            del self.forwarded[-len(texts):]

    def stream_done(self, now: float) -> Action:
        """The stream's completion signal arrived. The turn spec's `complete` guards choose what
        it means (completed, the semantic-empty recovery, failed; from a continuation, completed
        or the original interruption); this acts on the state reached. A refusal known before
        commit does what [outcomes.refusal] says (a continuation's extends shown output)."""
        gate = self._gate()
        entry = self._call().entry
        usage = gate.usage or Usage()
        refused_early = gate.finish_reason == CONTENT_FILTER and not gate.committed
        ended = gate.finish()
        if ended not in (StreamState.COMPLETED, StreamState.SEMANTIC_EMPTY):
            raise IllegalTransition(
                f"stream: a completion signal cannot end a stream in {ended!r}")
        continuing = self.life.state == _CONTINUING
        if refused_early and self._refusal_way(answered=True, shown=continuing) == "advance":
            # nothing was shown, so the turn advances as it would after a pre-commit failure
            failure = self._record_refusal(
                fc.Failure(fc.REFUSED, "refusal before output: finish reason content_filter"),
                now, answer=Completion(usage=usage, finish_reason=CONTENT_FILTER),
                usage=gate.usage)
            return self._failed(entry, failure, now)
        # everything forwarded is the answer: one stream's text, or a continuation's two
        answer = Completion("".join(self.forwarded), "", tuple(gate.tools), usage,
                            gate.tool_arguments, tuple(gate.tool_ids), gate.finish_reason,
                            gate.stop_sequence)
        # the gate's verdict, or for a continuation the verdict on both streams' text together
        answered = answer.has_answer if continuing else ended == StreamState.COMPLETED
        if answered or refused_early:
            # the provider's answer (output, or a refusal that stands) without usage counted:
            # billed at relayline's estimate, as a cut stream is, never as zero
            self._record(fc.OK, now, usage=gate.usage, accepted=True, shown=True)
            self.answer = answer
            if self.life.state == _STREAMING:
                self.life.fire(_COMMIT)  # a refusal with nothing to show is still the answer
        else:
            self._record(StreamOutcome.SEMANTIC_EMPTY, now, reason=fc.EMPTY, usage=gate.usage,
                         shown=True, detail="stream completed without an answer")
            self.answer = None
        # the profile answered; emptiness is not ill health
        self.health.success(entry.profile, now)
        self.failure, self.now = None, now  # (ended_failed: a completion, not a failure, led there)
        return self._step(_COMPLETE)

    def stream_failed(self, failure: fc.Failure, now: float) -> Action:
        """The open stream failed (HTTP error, in-band error, truncation, timeout, connection).
        The turn spec's `fail` chooses what follows: after commit the continuation or the
        interruption (`continuable`); before commit the walk goes on streaming
        (`streaming_recovery`), the recovery walk runs (`recoverable`) or the turn fails; a
        continuation's failure surfaces the interruption. This records the attempt, as
        [outcomes.refusal] says for a refusal and [outcomes.failed_stream] for the rest, and acts
        on the state reached."""
        gate = self._gate()
        shown = self.stream_shown = gate.fail() == StreamState.INTERRUPTED
        continuing = self.continuation_failed
        if failure.kind == fc.REFUSED:
            way = self._refusal_way(answered=False, shown=shown or continuing)
            if way == "advance":
                self._record_refusal(failure, now, usage=gate.usage)
                return self._failed(self._call().entry, failure, now)
            if way == "client_error":
                failure = as_client_error(failure)
        recorded = self.life.spec.outcomes["failed_stream"].decide(self)
        how = turn_actions.FAILED_STREAM[recorded]
        detail = f"continuation: {failure.detail}" if how.continuation else failure.detail
        self._record(how.outcome, now, reason=failure.kind, detail=detail, usage=gate.usage,
                     bill=how.billed, failure=failure if how.counts_rejection else None,
                     shown=how.estimated)
        return self._failed(self._call().entry, failure, now)

    def _failed(self, entry: PlannedEntry, failure: fc.Failure, now: float) -> Action:
        """A recorded stream failure reaches the profile's health (once: a walk that adopts the
        attempt finds it already counted) and the spec's `fail`."""
        self.health.failure(entry.profile, failure.kind, now)
        self.failure = failure
        self.continuation = self._continuation_candidate(entry, now)
        self.now = now
        return self._step(_FAIL)

    # -- cancellation -------------------------------------------------------------------------

    def cancel(self, now: float) -> Finish:
        """The consumer cancelled. Never a provider call after this; settles what is
        persisted."""
        if self.call is not None:
            usage = self.gate.usage if self.gate is not None else None
            # output already forwarded was billed by the provider, usage or not: a row all the
            # same
            shown = self.call.mode == _STREAM and self.gate is not None and self.gate.committed
            if self.gate is not None and not self.gate.life.terminal:
                self.gate.cancel()
            self._record(StreamOutcome.CANCELLED, now, reason=StreamOutcome.CANCELLED,
                         detail="cancelled by the consumer", usage=usage, bill=False,
                         shown=shown)
            self.call = None
        if self.walk is not None:
            self.walk.cancel()
        self.health.release_all()
        finish = self._step(TurnTrigger.CANCEL)
        assert isinstance(finish, Finish)
        return finish

    # -- ends the walk does not choose --------------------------------------------------------

    def expire(self, now: float) -> Finish:
        """timeouts.total_s passed: the turn ends where it stands and nothing more is sent. An
        attempt in flight is a timeout of the turn's own budget, not evidence against the
        provider (a long answer is not ill health; a silent one already met headers_s or
        idle_s): no breaker failure, a held probe is handed back. Forwarded output ends as
        interrupted, exactly as a stream cut after commit."""
        detail = f"turn deadline: timeouts.total_s ({self.config.timeouts.total_s:g}s) passed"
        gate = self.gate
        committed = gate is not None and gate.committed
        if self.call is not None:
            usage = None
            if self.call.mode == Mode.STREAM and gate is not None:
                usage = gate.usage
                if not gate.life.terminal:
                    gate.fail()
            shown = committed and self.call.mode == Mode.STREAM
            self._record(StreamOutcome.INTERRUPTED if committed else FailureClass.TIMEOUT, now,
                         reason=FailureClass.TIMEOUT, detail=detail,
                         usage=usage if shown else usage or (Usage() if committed else None),
                         bill=committed, shown=shown)
            self.call = None
        if self.walk is not None and not self.walk.life.terminal:
            self.walk.cancel()  # the walk ends without a verdict: nothing more is attempted
        self.health.release_all()
        self.continuation = None  # nothing continues past the deadline
        self.walk_result = WalkDone(ok=False, error=ErrorReason.DEADLINE)
        finish = self._step(TurnTrigger.EXPIRE)  # the spec says how the state it stands in ends
        assert isinstance(finish, Finish)
        return finish

    def abort(self, now: float) -> Finish:
        """relayline's own code failed mid-turn (a machine, a sink): settle what is known, hand
        every held probe back, and report an internal error. The machines may be in any state
        here, so this fires nothing: it only builds the result."""
        if self.call is not None:
            self._record(FailureClass.INTERNAL, now, reason=FailureClass.INTERNAL,
                         detail="the turn failed inside relayline",
                         usage=self.gate.usage if self.gate is not None else None, bill=False)
            self.call = None
        self.health.release_all()
        return Finish(self.result(Outcome.ERROR, ErrorReason.INTERNAL, None, None))

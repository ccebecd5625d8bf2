"""One turn, end to end (specs/turn.toml and specs/cancellation.toml), sans-I/O.

The turn composes the pieces: it opens the stream on the first entry that can serve it, feeds
frames through the commit gate, hands a pre-commit failure to a recovery walk, gives a
semantic-empty stream its allowances, and settles cancellation. It records every attempt, skip
and ledger row, and builds the result: attribution, notice, aggregated error.

The driver calls it in the h11 style: `start` returns the first action; each reported result
(`on_completion`, `stream_*`, `on_timer`) returns the next one, until a `Finish`. What entering
a state does is turn_actions.py; the records results.py; the refusal policy refusals.py.
"""

from __future__ import annotations

from collections.abc import Callable

from . import classify as fc
from . import refusals, turn_actions
from .config import Config
from .engine import Lifecycle, load_spec
from .errors import IllegalTransition
from .health import HealthStore
from .ledger import LedgerRow, Usage, estimated_tokens, row
from .plan import Plan, PlannedEntry
from .results import (
    Action,
    AttemptRecord,
    Completion,
    Finish,
    Rejection,
    TurnResult,
    rejection_of,
    turn_result,
)
from .stream import Event, Frame, StreamGate
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
from .walk import (
    Call,
    Need,
    Sleep,
    TurnHealth,
    Walk,
    WalkDone,
    another_candidate,
    first_candidate,
    stop_error,
)
from .wire import CONTENT_FILTER

# the records a turn gives back live in results.py; the library and the gateway import them from here too
__all__ = ["Action", "AttemptRecord", "Call", "Completion", "Finish", "Rejection", "Sleep", "Turn", "TurnResult"]

# the words a turn reads a dozen times, once as module names: an enum member read is dearer
_STREAMING, _CONTINUING, _COMPLETED = TurnState.STREAMING, TurnState.CONTINUING, TurnState.COMPLETED
_START, _COMMIT, _COMPLETE, _FAIL, _END = (TurnTrigger.START, TurnTrigger.COMMIT, TurnTrigger.COMPLETE,
                                          TurnTrigger.FAIL, TurnTrigger.END)
_STREAM, _COMPLETE_MODE = Mode.STREAM, Mode.COMPLETE
# (and per event of a stream: stream_frame tells them apart for every event it forwards)
_TEXT, _REASONING, _EXECUTED_TOOL = EventKind.TEXT, EventKind.REASONING, EventKind.EXECUTED_TOOL


class Turn:
    # slotted, as the walk and the lifecycles: a turn's attributes are read and written some
    # hundred times a turn, and each held stream keeps its turn
    __slots__ = ("plan", "config", "health", "stream_requested", "tools", "life", "cancellation", "attempts",
                 "ledger", "walk", "gate", "walks", "gates", "call", "call_at", "answer", "forwarded",
                 "shown_reasoning", "executed_tools", "failure", "continuation", "walk_result", "spent", "refusal",
                 "advance_refusals", "rejections", "prompt_chars", "shown_by", "call_text_from", "now",
                 "entry_actions", "cancellation_actions", "first_stream", "answer_mode", "stream_shown")

    def __init__(self, plan: Plan, config: Config, store: HealthStore, *, stream: bool, tools: bool = False,
                 prompt_chars: Callable[[], int] = lambda: 0):
        self.plan = plan
        self.config = config
        self.health = TurnHealth(store)
        self.stream_requested = stream
        self.tools = tools
        self.life = Lifecycle(spec := load_spec("turn"))
        self.entry_actions = spec.derived.get(id(turn_actions.ENTRY_ACTIONS)) or turn_actions.bind(spec)
        self.cancellation = Lifecycle(spec := load_spec("cancellation"))
        self.cancellation_actions = spec.derived.get(id(turn_actions.CANCELLATION_ACTIONS)) or turn_actions.bind_cancellation(spec)
        self.attempts: list[AttemptRecord] = []
        self.ledger: list[LedgerRow] = []
        self.walk: Walk | None = None
        self.gate: StreamGate | None = None
        self.walks: list[Walk] = []  # every walk and gate of the turn, for audits of their paths
        self.gates: list[StreamGate] = []
        self.call: Call | None = None
        self.call_at = 0.0
        self.answer: Completion | None = None
        self.forwarded: list[str] = []  # text that reached the immutable sink, across the turn
        self.shown_reasoning = False
        self.executed_tools = False
        self.failure: fc.Failure | None = None  # the stream failure being decided (guard recoverable)
        self.continuation: PlannedEntry | None = None  # guard continuable: the entry that would continue
        self.walk_result: WalkDone | None = None  # guard walk_succeeded
        self.spent: dict[int, int] = {}  # attempts made per entry index, across the turn's walks
        self.refusal: refusals.Refusal | None = None
        self.advance_refusals = config.reliability.on_refusal == "advance"
        self.rejections: list[Rejection | None] = []  # per failed attempt: its client rejection, if it was one
        self.prompt_chars = prompt_chars  # the request's text (wire.Request.prompt_chars), counted only when needed
        self.shown_by: PlannedEntry | None = None  # the entry of the last stream that committed
        self.call_text_from = 0  # where the pending call's text begins in `forwarded`
        self.now = 0.0  # the time of the result being acted on (the entry actions read it)
        # guard stream_entry: the first entry that can open a stream, once looked for (None: none can)
        self.first_stream: PlannedEntry | None | bool = False  # False: not looked for yet
        self.answer_mode = _STREAM  # the mode of the call whose answer the turn ends with
        self.stream_shown = False  # guard stream_shown: the failed stream's output had reached the sink

    @property
    def lifecycles(self) -> list[Lifecycle]:
        """Every machine this turn ran, in the order they started."""
        return [self.life, self.cancellation, *(w.life for w in self.walks), *(g.life for g in self.gates)]

    def _walk(self) -> Walk:
        assert self.walk is not None, "no walk is running"
        return self.walk

    def _gate(self) -> StreamGate:
        assert self.gate is not None, "no stream is open"
        return self.gate

    def _call(self) -> Call:
        assert self.call is not None, "no call is pending"
        return self.call

    # -- guards (specs/turn.toml, specs/cancellation.toml) ------------------------------------

    @property
    def has_answer(self) -> bool:
        return self.answer is not None and self.answer.has_answer

    @property
    def replay_safe(self) -> bool:
        return not self.executed_tools

    @property
    def continuable(self) -> bool:
        return self.continuation is not None

    @property
    def recoverable(self) -> bool:
        assert self.failure is not None, "no stream failure is being decided"
        return stop_error(self.config.reliability, self.failure) is None

    @property
    def streaming_recovery(self) -> bool:
        return self.config.stream.recovery == "streaming"

    @property
    def stream_entry(self) -> bool:
        return self._first_stream() is not None

    @property
    def retries_configured(self) -> bool:
        return self.config.reliability.provider_retries > 0

    @property
    def only_candidate(self) -> bool:
        return self._only_candidate(self._call().entry.index, self.now)

    @property
    def continuation_failed(self) -> bool:
        return self._call().prefill is not None

    @property
    def walk_succeeded(self) -> bool:
        return self.walk_result is not None and self.walk_result.ok

    @property
    def has_forwarded_text(self) -> bool:
        return bool("".join(self.forwarded))

    # -- start --------------------------------------------------------------------------------

    def start(self, now: float) -> Action:
        """The turn's first action: the spec's `start` chooses stream or walk by its guards, and
        the state it enters says how (its entry actions)."""
        self.now = now
        return self._step(_START)

    def _step(self, trigger: str) -> Action:
        """Fire `trigger`; the entry actions of the state reached say what happens next."""
        result: Action = self.life.step(trigger, self, self.entry_actions)
        return result

    def _first_stream(self) -> PlannedEntry | None:
        """The first entry, in configured order, that can open a stream now; the ones before it
        are recorded as skipped. Looked for once: the `start` guards read it twice."""
        found = self.first_stream
        if found is False:
            j = first_candidate(self.plan, self.health, self.now, range(len(self.plan.entries)),
                                Need(stream=True, tools=self.tools), record_skips=True)
            found = None if j is None else self.plan.entries[j]
            self.first_stream = found
        assert found is not True
        return found

    def _begin(self, call: Call, now: float) -> Call:
        self.call, self.call_at = call, now
        self.call_text_from = len(self.forwarded)
        if call.mode == _STREAM:
            self.gate = StreamGate()
            self.gates.append(self.gate)
        return call

    def _walk_from(self, walk: Walk, now: float, action: Call | Sleep | WalkDone | None = None) -> Action:
        self.walk = walk
        self.walks.append(walk)
        return self._follow(action if action is not None else walk.start(now), now)

    def _follow(self, action: Call | Sleep | WalkDone, now: float) -> Action:
        if isinstance(action, Call):
            if self.life.state == _STREAMING and self.attempts and action.mode == _STREAM:
                self.life.fire(TurnTrigger.RETRY_STREAM)
            return self._begin(action, now)
        if isinstance(action, Sleep):
            self.call = None
            return action
        return self._done(action, now)

    def on_timer(self, now: float) -> Action:
        return self._follow(self._walk().on_timer(now), now)

    # -- records ------------------------------------------------------------------------------

    def _record(self, outcome: Outcome | FailureClass | StreamOutcome, now: float, *,
                reason: FailureClass | StreamOutcome | None = None, detail: str = "",
                usage: Usage | None = None, accepted: bool = False, bill: bool = True,
                failure: fc.Failure | None = None, shown: bool = False, answer: Completion | None = None) -> None:
        """One attempt, and its ledger row when it was billed. `shown`: the provider billed what
        the consumer saw (or the answer it gave): when it reported no usage, the row is billed at
        relayline's estimate (`_estimated_usage`) and marked so."""
        call = self.call
        assert call is not None, "no call is pending"
        if outcome != fc.OK:
            self.rejections.append(rejection_of(failure))
        entry = call.entry
        self.spent[entry.index] = self.spent.get(entry.index, 0) + 1
        self.attempts.append(AttemptRecord(entry.profile, entry.model, call.mode, outcome, reason,
                                           self.call_at, call.key_index, call.try_number, call.budget, detail, now))
        estimated = shown and usage is None
        if estimated:
            usage, bill = self._estimated_usage(answer), True
        if usage is not None and (bill or usage.billable):
            self.ledger.append(row(entry.profile, entry.model, entry.price, usage,
                                   accepted=accepted, outcome=outcome, mode=call.mode, estimated=estimated))

    def _estimated_usage(self, answer: Completion | None = None) -> Usage:
        """What the pending call is estimated to have cost when the provider reported no usage:
        the request's text in; out, the text and tool calls it answered (`answer`, a complete-mode
        reply) or, for a stream, forwarded."""
        call = self.call
        assert call is not None
        if answer is not None:
            out = len(answer.text) + sum(map(len, answer.tool_calls)) + sum(map(len, answer.tool_arguments))
        else:
            assert self.gate is not None
            out = sum(map(len, self.forwarded[self.call_text_from:]))
            out += sum(map(len, self.gate.tools)) + sum(map(len, self.gate.tool_arguments))
        prompt = self.prompt_chars() + (len(call.prefill) if call.prefill else 0)
        return Usage(estimated_tokens(prompt), estimated_tokens(out))

    # -- non-streaming results ----------------------------------------------------------------

    def on_completion(self, result: Completion | fc.Failure, now: float) -> Action:
        """The pending complete-mode call answered (a Completion) or failed (a Failure)."""
        if isinstance(result, fc.Failure):
            result = refusals.as_configured(result, self.advance_refusals)
            if result.kind == fc.REFUSED:
                return self._follow(self._walk().on_result(refusals.record(self, result, now), now), now)
            self._record(result.kind, now, reason=result.kind, detail=result.detail,
                         usage=None, failure=result)
            return self._follow(self._walk().on_result(result, now), now)
        usage = result.usage or Usage()
        if result.refusal and self.advance_refusals:
            failure = refusals.record(self, fc.Failure(fc.REFUSED, "refusal: finish reason content_filter"), now,
                                    answer=result, usage=usage)
            return self._follow(self._walk().on_result(failure, now), now)
        if not result.has_answer:
            self._record(fc.EMPTY, now, reason=fc.EMPTY, detail="empty completion", usage=usage)
            return self._follow(self._walk().on_result(fc.Failure(fc.EMPTY, "empty completion"), now), now)
        # a token count is no completion: the provider bills nothing for it, nor does the ledger;
        # an answer the provider billed but did not count is billed at relayline's estimate
        counted = result.input_count is not None
        self._record(fc.OK, now, usage=usage if counted else result.usage, accepted=True, bill=not counted,
                     shown=not counted, answer=result)
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
        it means (completed, the semantic-empty recovery, failed; from a continuation, completed or
        the original interruption); this acts on the state reached."""
        gate = self._gate()
        entry = self._call().entry
        usage = gate.usage or Usage()
        refused_early = gate.finish_reason == CONTENT_FILTER and not gate.committed
        ended = gate.finish()
        if ended not in (StreamState.COMPLETED, StreamState.SEMANTIC_EMPTY):
            raise IllegalTransition(f"stream: a completion signal cannot end a stream in {ended!r}")
        if refused_early and self.advance_refusals and self.life.state == _STREAMING:
            # a refusal known before commit: nothing was shown, so the turn advances as it
            # would after a pre-commit failure (after commit the stream rules stand)
            failure = refusals.record(self, fc.Failure(fc.REFUSED, "refusal before output: finish reason content_filter"),
                                    now, answer=Completion(usage=usage, finish_reason=CONTENT_FILTER), usage=usage)
            return self._failed(entry, failure, now)
        # everything forwarded is the answer: one stream's text, or a continuation's two
        answer = Completion("".join(self.forwarded), "", tuple(gate.tools), usage, gate.tool_arguments,
                            tuple(gate.tool_ids), gate.finish_reason, gate.stop_sequence)
        # the gate's verdict, or for a continuation the verdict on both streams' text together
        answered = answer.has_answer if self.life.state == _CONTINUING else ended == StreamState.COMPLETED
        if answered or refused_early:
            # output shown, no usage counted: billed at relayline's estimate, as a cut stream is
            self._record(fc.OK, now, usage=gate.usage if answered else usage, accepted=True, shown=answered)
            self.answer = answer
            if self.life.state == _STREAMING:
                self.life.fire(_COMMIT)  # a refusal with nothing to show is still the answer
        else:
            self._record(StreamOutcome.SEMANTIC_EMPTY, now, reason=fc.EMPTY, usage=usage,
                         detail="stream completed without an answer")
            self.answer = None
        self.health.success(entry.profile, now)  # the profile answered; emptiness is not ill health
        self.failure, self.now = None, now  # (ended_failed: a completion, not a failure, led there)
        return self._step(_COMPLETE)

    def stream_failed(self, failure: fc.Failure, now: float) -> Action:
        """The open stream failed (HTTP error, in-band error, truncation, timeout, connection).
        The turn spec's `fail` chooses what follows: after commit the continuation or the
        interruption (`continuable`); before commit the walk goes on streaming
        (`streaming_recovery`), the recovery walk runs (`recoverable`) or the turn fails; a
        continuation's failure surfaces the interruption. This records the attempt and acts on
        the state reached."""
        failure = refusals.as_configured(failure, self.advance_refusals)
        gate = self._gate()
        shown = self.stream_shown = gate.fail() == StreamState.INTERRUPTED
        continuing = self.continuation_failed
        # what reached the sink decides the row: text forwarded in this turn is final and billed
        # (even without a usage frame; a continuation's, not twice), a failure before it is not
        forwarded = shown or continuing
        if failure.kind == fc.REFUSED and not forwarded:
            refusals.record(self, failure, now, usage=gate.usage)
        else:
            self._record(StreamOutcome.INTERRUPTED if shown else StreamOutcome.STREAM_FAILED, now,
                         reason=failure.kind, detail=f"continuation: {failure.detail}" if continuing else failure.detail,
                         usage=gate.usage, bill=turn_actions.BILLED[self.life.spec.outcomes["failed_stream_row"].decide(self)],
                         failure=None if forwarded else failure, shown=shown and not continuing)
        return self._failed(self._call().entry, failure, now)

    def _failed(self, entry: PlannedEntry, failure: fc.Failure, now: float) -> Action:
        """A recorded stream failure reaches the profile's health (once: a walk that adopts the
        attempt finds it already counted) and the spec's `fail`."""
        self.health.failure(entry.profile, failure.kind, now)
        self.failure = failure
        self.continuation = self._continuation_candidate(entry, now)
        self.now = now
        return self._step(_FAIL)

    def _only_candidate(self, index: int, now: float) -> bool:
        """No other candidate (walk.another_candidate) for the entry: a recovery walk starts over,
        so every entry is within its reach."""
        return not another_candidate(self.plan, self.health, self.plan.entries[index], now,
                                     range(len(self.plan.entries)))

    def _continuation_candidate(self, failed: PlannedEntry, now: float) -> PlannedEntry | None:
        """stream.continue_after_interrupt: the next entry after the failed one that can be
        attempted now with a prefilled stream. Only text can be continued."""
        if not self.config.stream.continue_after_interrupt or not self.has_forwarded_text or self._gate().tools:
            return None
        j = first_candidate(self.plan, self.health, now, range(failed.index + 1, len(self.plan.entries)),
                            Need(stream=True, tools=self.tools, prefill=True))
        return None if j is None else self.plan.entries[j]

    # -- cancellation -------------------------------------------------------------------------

    def cancel(self, now: float) -> Finish:
        """The consumer cancelled. Never a provider call after this; settles what is persisted."""
        if self.call is not None:
            usage = self.gate.usage if self.gate is not None else None
            # output already forwarded was billed by the provider, usage or not: a row all the same
            shown = self.call.mode == _STREAM and self.gate is not None and self.gate.committed
            if self.gate is not None and not self.gate.life.terminal:
                self.gate.cancel()
            self._record(StreamOutcome.CANCELLED, now, reason=StreamOutcome.CANCELLED, detail="cancelled by the consumer",
                         usage=usage, bill=False, shown=shown)
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
                         usage=usage if shown else usage or (Usage() if committed else None), bill=committed, shown=shown)
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
        return Finish(turn_result(self, Outcome.ERROR, ErrorReason.INTERNAL, None, None))

    # -- the end ------------------------------------------------------------------------------

    def _done(self, done: WalkDone, now: float) -> Action:
        """A walk ended: its result reaches the spec (`end`, its `walk_succeeded` guard) and the
        state reached ends the turn (its entry action)."""
        mode = self.call.mode if self.call is not None else _STREAM
        if self.refusal is not None:
            settled = refusals.settle(self, self.refusal, done)
            if settled is not done:
                done, mode = settled, self.refusal.mode
        self.walk_result, self.answer_mode, self.now = done, mode, now
        return self._step(_END)

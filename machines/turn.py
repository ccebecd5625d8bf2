"""One turn, end to end (specs/turn.toml and specs/cancellation.toml), sans-I/O.

The turn composes the pieces: it opens the stream on the first entry that can serve it, feeds
frames through the commit gate, hands a pre-commit failure to a recovery walk, gives a
semantic-empty stream its allowances, and settles cancellation. It records every attempt, skip
and ledger row, and builds the result: attribution, notice, aggregated error.

The driver calls it in the h11 style: `start` returns the first action; each reported result
(`on_completion`, `stream_*`, `on_timer`) returns the next one, until a `Finish`.
"""

from __future__ import annotations

import itertools
import json
import operator
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from . import classify as fc
from .config import Config
from .engine import Lifecycle, load_spec
from .errors import IllegalTransition
from .health import HealthStore
from .ledger import LedgerRow, Usage, estimated_tokens, row
from .plan import Plan, PlannedEntry
from .stream import Event, Frame, StreamGate, strip_think
from .vocab import (
    CancellationState,
    CancellationTrigger,
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
    Skip,
    Sleep,
    TurnHealth,
    Walk,
    WalkDone,
    another_candidate,
    key_index,
    stop_error,
    unavailable,
)
from .wire import CONTENT_FILTER

_COST = operator.attrgetter("cost_usd")
MAX_ERROR_ATTEMPTS = 16
MAX_ERROR_CHARS = 2000
REJECTION_STATUSES = (400, 413, 422)
# the words an answered turn reads, once as module names (as walk.py's and health.py's states):
# on 3.11 an enum member read costs 77 ns, a module name 12, and a turn reads these a dozen times
_STREAMING, _CONTINUING, _COMPLETED = TurnState.STREAMING, TurnState.CONTINUING, TurnState.COMPLETED
_WALK, _OPEN_STREAM, _COMMIT, _COMPLETE, _END = (TurnTrigger.WALK, TurnTrigger.OPEN_STREAM, TurnTrigger.COMMIT,
                                                 TurnTrigger.COMPLETE, TurnTrigger.END)
_FINISH = CancellationTrigger.FINISH
_STREAM, _COMPLETE_MODE = Mode.STREAM, Mode.COMPLETE
# (and per event of a stream: stream_frame tells them apart for every event it forwards)
_TEXT, _REASONING, _EXECUTED_TOOL = EventKind.TEXT, EventKind.REASONING, EventKind.EXECUTED_TOOL


def _rejection(failure: fc.Failure | None) -> Rejection | None:
    if failure is None or failure.kind not in (fc.REJECTED, fc.REFUSED) or failure.status not in REJECTION_STATUSES:
        return None
    return Rejection(failure.status, failure.error_type or "invalid_request_error",
                     failure.error_message or failure.detail)


@attrs.frozen
class Completion:
    """A non-streaming answer (or a stream's aggregate)."""

    text: str = ""
    reasoning: str = ""
    tool_calls: tuple[str, ...] = ()
    usage: Usage | None = None
    tool_arguments: tuple[str, ...] = ()  # each tool call's JSON arguments, aligned with tool_calls
    tool_ids: tuple[str, ...] = ()  # each tool call's id as the provider sent it ("" when absent)
    finish_reason: str | None = None  # canonical (machines/wire.py), as the provider said it
    stop_sequence: str | None = None  # which stop sequence ended it, when the provider says (Anthropic)
    # an Anthropic answer's content blocks as sent, when the canonical fields would lose some of
    # them (thinking and its signature, which the client sends back; citations; server tools)
    blocks: tuple[Mapping[str, Any], ...] = attrs.field(default=(), eq=False)
    # an OpenAI answer's choice logprobs, as sent, when the client asked for them (a stream's ride
    # on its text events' ref, as JSON)
    logprobs: Mapping[str, Any] | None = attrs.field(default=None, eq=False)
    # an OpenAI answer's message.annotations (a search model's url citations), as sent
    annotations: tuple[Mapping[str, Any], ...] = attrs.field(default=(), eq=False)
    # an embeddings answer's items ({index, embedding}), as sent: the answer of an embeddings turn
    vectors: tuple[Mapping[str, Any], ...] = attrs.field(default=(), eq=False)
    input_count: int | None = None  # a token counting answer's count (it bills nothing: no usage)
    # the id a provider that keeps its answers gave this one (a Responses API provider's): the
    # client names it in `previous_response_id` on its next turn, so it reaches the client as sent
    response_id: str | None = None

    @property
    def refusal(self) -> bool:
        return self.finish_reason == CONTENT_FILTER

    @property
    def has_answer(self) -> bool:
        # a refusal is what the provider answered, text or not: retrying it as empty asks the same policy again
        return bool(self.tool_calls) or bool(strip_think(self.text).strip()) or self.refusal or bool(self.vectors) or \
            self.input_count is not None


NO_ANSWER = Completion()  # a result without an answer reads its answer's fields from this one


def _reasoning_events(answer: Completion) -> list[Event]:
    """An answer's reasoning as a stream shows it: each thinking block's words, then its signature
    (a reasoning event with no words carries the signature of those before it), and each redacted
    thinking block, in the provider's order; an answer without blocks, its reasoning's words."""
    events = []
    for block in answer.blocks:
        kind = block.get("type")
        if kind == "thinking":
            events.append(Event(EventKind.REASONING, block["thinking"]))
            signature = block.get("signature")
            if signature and isinstance(signature, str):
                events.append(Event(EventKind.REASONING, "", signature))
        elif kind == "redacted_thinking" and isinstance(block.get("data"), str):
            events.append(Event(EventKind.REDACTED_REASONING, block["data"]))
    if not events and answer.reasoning:
        events.append(Event(EventKind.REASONING, answer.reasoning))
    return events


# the records a turn builds (an attempt each, its result once) are frozen but keep their fields
# in an instance dict, not slots: a frozen slotted class's __init__ sets each field through
# `object.__setattr__` (a method call a field), a dict-backed one stores into its dict, 2-3x
# faster for the result's 21 fields; no record is held by a stream while it runs
@attrs.frozen(slots=False)
class AttemptRecord:
    provider: str
    model: str
    mode: Mode
    outcome: Outcome | FailureClass | StreamOutcome  # ok, a failure class, or a stream's end
    reason: FailureClass | StreamOutcome | None  # the failure class; cancelled for a cancellation
    at: float
    key: int | None
    try_number: int = 1
    budget: int = 1
    detail: str = ""
    ended: float | None = None  # when its outcome was known: the console's attempt latency

    def __str__(self) -> str:
        return f"{self.provider}/{self.model} {self.outcome}"

    @property
    def ended_by_consumer(self) -> bool:
        """The consumer ended it (a hang-up, a cut slow reader, a drain): it says nothing of the
        provider's health, so a success rate leaves it out."""
        return self.outcome == StreamOutcome.CANCELLED

    def as_json(self) -> dict[str, object]:
        return {"provider": self.provider, "model": self.model, "mode": self.mode, "outcome": self.outcome,
                "reason": self.reason, "at": round(self.at, 6), "key": self.key}


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
class Rejection:
    """What the upstream said when it rejected the request itself (400, 413, 422): bounded and
    redacted by the adapter, given back to a client whose every attempt was rejected so."""

    status: int
    type: str
    message: str


@attrs.frozen(slots=False)
class TurnResult:
    outcome: Outcome
    error: ErrorReason | None
    message: str | None
    requested: str
    served: PlannedEntry | None
    text: str | None
    reasoning: str
    tool_calls: tuple[str, ...]
    partial_text: str | None
    notice: str | None
    fallback: bool
    attempts: tuple[AttemptRecord, ...]
    skipped: tuple[Skip, ...]
    ledger: tuple[LedgerRow, ...]
    tool_arguments: tuple[str, ...] = ()
    tool_ids: tuple[str, ...] = ()
    finish_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage | None = None  # the accepted answer's usage
    rejection: Rejection | None = None  # every attempt was a client rejection: the upstream's words
    blocks: tuple[Mapping[str, Any], ...] = attrs.field(default=(), eq=False)  # the answer's (Completion.blocks)
    logprobs: Mapping[str, Any] | None = attrs.field(default=None, eq=False)  # the answer's
    annotations: tuple[Mapping[str, Any], ...] = attrs.field(default=(), eq=False)  # the answer's
    # the entry whose output the consumer saw when nothing was accepted (`partial_text`'s source):
    # `served` stays None, this names who billed it
    partial_from: PlannedEntry | None = None
    vectors: tuple[Mapping[str, Any], ...] = attrs.field(default=(), eq=False)  # an embeddings answer's
    input_count: int | None = None  # a token counting answer's
    response_id: str | None = None  # the answer's (Completion.response_id)
    # the sum of the ledger's rows, once: the answer's header and field, the access line, the
    # console and the log each read it
    cost_usd: float = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self.__dict__["cost_usd"] = sum(map(_COST, self.ledger))


@attrs.frozen
class Finish:
    result: TurnResult
    deliver: tuple[Event, ...] = ()  # a stream turn served without streaming: one decisive delivery


Action = Call | Sleep | Finish  # what the driver does next


class Turn:
    # slotted, as the walk and the lifecycles: a turn's attributes are read and written some
    # hundred times a turn, and each held stream keeps its turn
    __slots__ = ("plan", "config", "health", "stream_requested", "tools", "life", "cancellation", "attempts",
                 "ledger", "walk", "gate", "walks", "gates", "call", "call_at", "answer", "forwarded",
                 "shown_reasoning", "executed_tools", "failure", "continuation", "walk_result", "spent", "refusal",
                 "advance_refusals", "rejections", "prompt_chars", "shown_by", "call_text_from")

    def __init__(self, plan: Plan, config: Config, store: HealthStore, *, stream: bool, tools: bool = False,
                 prompt_chars: Callable[[], int] = lambda: 0):
        self.plan = plan
        self.config = config
        self.health = TurnHealth(store)
        self.stream_requested = stream
        self.tools = tools
        self.life = Lifecycle(load_spec("turn"))
        self.cancellation = Lifecycle(load_spec("cancellation"))
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
        self.refusal: Refusal | None = None
        self.advance_refusals = config.reliability.on_refusal == "advance"
        self.rejections: list[Rejection | None] = []  # per failed attempt: its client rejection, if it was one
        # the request's text (wire.Request.prompt_chars): an estimate's input, counted only for an
        # answer without usage (a long history's count is a pass over every part and tool)
        self.prompt_chars = prompt_chars
        self.shown_by: PlannedEntry | None = None  # the entry of the last stream that committed
        self.call_text_from = 0  # where the pending call's text begins in `forwarded`

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
    def walk_succeeded(self) -> bool:
        return self.walk_result is not None and self.walk_result.ok

    @property
    def has_forwarded_text(self) -> bool:
        return bool("".join(self.forwarded))

    # -- start --------------------------------------------------------------------------------

    def start(self, now: float) -> Action:
        if not self.stream_requested:
            self.life.fire(_WALK)
            return self._walk_from(Walk(self.plan, self.config, self.health), now)
        streams = Need(stream=True, tools=self.tools)
        if self.config.stream.recovery == "streaming":
            self.life.fire(_OPEN_STREAM)
            walk = Walk(self.plan, self.config, self.health,
                        mode_for=lambda e: Mode.STREAM if streams.met_by(e.provider.capabilities) else Mode.COMPLETE)
            return self._walk_from(walk, now)
        for entry in self.plan.entries:
            reason = unavailable(self.plan, self.health, entry, now, streams)
            if reason is None:
                self.life.fire(_OPEN_STREAM)
                self.health.before_attempt(entry.profile, now)
                budget = self.config.reliability.provider_retries + 1
                return self._begin(Call(entry, _STREAM, key_index(self.health.store, entry), 1, budget), now)
            self.health.skip(entry, reason, self.plan.unfit.get(entry.profile, ()))
        # no entry can stream: the walk answers, delivered as one decisive event
        self.life.fire(TurnTrigger.WALK)
        return self._walk_from(Walk(self.plan, self.config, self.health), now)

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
            self.rejections.append(_rejection(failure))
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

    # -- refusals ------------------------------------------------------------------------------

    def _as_configured(self, failure: fc.Failure) -> fc.Failure:
        """on_refusal = "return": a content-policy 400 is the client error it always was."""
        if failure.kind == fc.REFUSED and not self.advance_refusals:
            return attrs.evolve(failure, kind=fc.REJECTED)
        return failure

    def _refused(self, failure: fc.Failure, now: float, *, answer: Completion | None = None,
                 usage: Usage | None = None) -> fc.Failure:
        """Record a refusal the walk advances past; the profile is not asked again this turn."""
        rows = len(self.ledger)
        self._record(fc.REFUSED, now, reason=fc.REFUSED, detail=failure.detail, usage=usage, failure=failure)
        call = self._call()
        entry = call.entry
        self.refusal = Refusal(entry, answer, len(self.attempts) - 1, rows if len(self.ledger) > rows else None,
                               call.mode)
        self.health.refused.add(entry.profile)
        return failure

    def _settle_refusal(self, done: WalkDone) -> WalkDone:
        """Nothing was left to advance to: the last refusal is the answer, as it came."""
        refusal = self.refusal
        if done.ok or refusal is None or done.error not in (ErrorReason.EXHAUSTED, ErrorReason.SEMANTIC_EMPTY,
                                                                 ErrorReason.NO_CANDIDATE):
            return done
        last = refusal.attempt == len(self.attempts) - 1  # nothing was tried after it: not advanced past
        if refusal.answer is None:
            if last:
                self.attempts[-1] = attrs.evolve(self.attempts[-1], outcome=fc.REJECTED)
            return WalkDone(ok=False, entry=refusal.entry, error=ErrorReason.CLIENT_ERROR)
        if last:
            self.attempts[-1] = attrs.evolve(self.attempts[-1], outcome=fc.OK, reason=None)
        if refusal.row is not None:  # the client gets it: its row is the accepted one
            row = self.ledger[refusal.row]
            self.ledger[refusal.row] = attrs.evolve(row, accepted=True, outcome=fc.OK if last else row.outcome)
        self.answer = refusal.answer
        return WalkDone(ok=True, entry=refusal.entry)

    # -- non-streaming results ----------------------------------------------------------------

    def on_completion(self, result: Completion | fc.Failure, now: float) -> Action:
        """The pending complete-mode call answered (a Completion) or failed (a Failure)."""
        if isinstance(result, fc.Failure):
            result = self._as_configured(result)
            if result.kind == fc.REFUSED:
                return self._follow(self._walk().on_result(self._refused(result, now), now), now)
            self._record(result.kind, now, reason=result.kind, detail=result.detail,
                         usage=None, failure=result)
            return self._follow(self._walk().on_result(result, now), now)
        usage = result.usage or Usage()
        if result.refusal and self.advance_refusals:
            failure = self._refused(fc.Failure(fc.REFUSED, "refusal: finish reason content_filter"), now,
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
            failure = self._refused(fc.Failure(fc.REFUSED, "refusal before output: finish reason content_filter"),
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
        self.life.fire(_COMPLETE, self)
        return self._enter(entry, now)

    def stream_failed(self, failure: fc.Failure, now: float) -> Action:
        """The open stream failed (HTTP error, in-band error, truncation, timeout, connection).
        The turn spec's `fail` chooses what follows: after commit the continuation or the
        interruption (`continuable`); before commit the walk goes on streaming
        (`streaming_recovery`), the recovery walk runs (`recoverable`) or the turn fails; a
        continuation's failure surfaces the interruption. This records the attempt and acts on
        the state reached."""
        failure = self._as_configured(failure)
        gate = self._gate()
        shown = gate.fail() == StreamState.INTERRUPTED
        continuing = self.life.state == TurnState.CONTINUING
        # what reached the sink decides the row: text forwarded in this turn is final and billed
        # (even without a usage frame; a continuation's, not twice), a failure before it is not
        forwarded = shown or continuing
        if failure.kind == fc.REFUSED and not forwarded:
            self._refused(failure, now, usage=gate.usage)
        else:
            self._record(StreamOutcome.INTERRUPTED if shown else StreamOutcome.STREAM_FAILED, now,
                         reason=failure.kind, detail=f"continuation: {failure.detail}" if continuing else failure.detail,
                         usage=gate.usage, bill=forwarded and not (continuing and shown),
                         failure=None if forwarded else failure, shown=shown and not continuing)
        return self._failed(self._call().entry, failure, now)

    def _failed(self, entry: PlannedEntry, failure: fc.Failure, now: float) -> Action:
        """A recorded stream failure reaches the profile's health (once: a walk that adopts the
        attempt finds it already counted) and the spec's `fail`."""
        self.health.failure(entry.profile, failure.kind, now)
        self.failure = failure
        self.continuation = self._continuation_candidate(entry, now)
        self.life.fire(TurnTrigger.FAIL, self)
        return self._enter(entry, now, failure)

    def _enter(self, entry: PlannedEntry, now: float, failure: fc.Failure | None = None) -> Action:
        """Act on the state a stream's end (`failure`: its failure) led the turn to."""
        state = self.life.state
        if state == _COMPLETED:
            return self._done(WalkDone(ok=True, entry=entry), now)
        if state == _CONTINUING:
            candidate = self.continuation
            assert candidate is not None
            self.health.before_attempt(candidate.profile, now)
            return self._begin(Call(candidate, _STREAM, key_index(self.health.store, candidate), 1, 1,
                                    prefill="".join(self.forwarded)), now)
        if state == TurnState.SEMANTIC_EMPTY_RECOVERY:
            return self._semantic_empty_recovery(entry, now)
        if state == TurnState.INTERRUPTED:
            return self._done(WalkDone(ok=False, entry=entry, error=ErrorReason.INTERRUPTED), now)
        if failure is None:
            if state == TurnState.FAILED:
                return self._done(WalkDone(ok=False, entry=entry, error=ErrorReason.SEMANTIC_EMPTY), now)
        elif state == TurnState.STREAMING:  # the walk the stream belongs to decides the attempt
            return self._follow(self._walk().on_result(failure, now), now)
        elif state == TurnState.RECOVERING:
            return self._recovery(entry, failure, now)
        elif state == TurnState.FAILED:  # a failure the policy stops on, as the walk states it
            walk = Walk(self.plan, self.config, self.health, exclude=frozenset({entry.index}))
            self.walks.append(walk)
            stopped = walk.note_failure(entry.index, failure, now)
            assert stopped is not None
            return self._done(stopped, now)
        raise IllegalTransition(f"turn: a stream's end cannot lead to state {state!r}")

    def _semantic_empty_recovery(self, entry: PlannedEntry, now: float) -> Action:
        # the exact entry gets one non-streaming recovery attempt when retries > 0
        # (replay-safe), or when it is the only candidate; both at once merge into one attempt
        index = entry.index
        allowance = 1 if (self.config.reliability.provider_retries > 0 or self._only_candidate(index, now)) else 0
        # the other candidates get their normal budgets, less what this turn already spent on
        # them (stream.recovery = streaming may have walked them before this stream)
        normal = self.config.reliability.provider_retries + 1
        budgets = {j: max(0, normal - n) for j, n in self.spent.items()}
        budgets[index] = allowance
        walk = Walk(self.plan, self.config, self.health, budgets=budgets)
        walk.last_failure = fc.EMPTY
        return self._walk_from(walk, now)

    def _recovery(self, entry: PlannedEntry, failure: fc.Failure, now: float) -> Action:
        """stream.recovery = non_streaming: the walk in configured order, skipping the exact
        entry, unless it is the only candidate (then the stream was its first attempt)."""
        index = entry.index
        if self._only_candidate(index, now):
            walk = Walk(self.plan, self.config, self.health)
            return self._walk_from(walk, now, walk.adopt(index, failure, now))
        walk = Walk(self.plan, self.config, self.health, exclude=frozenset({index}))
        walk.note_failure(index, failure, now)
        return self._walk_from(walk, now)

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
        need = Need(stream=True, tools=self.tools, prefill=True)
        return next((entry for entry in self.plan.entries[failed.index + 1:]
                     if unavailable(self.plan, self.health, entry, now, need) is None), None)

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
        self.life.fire(TurnTrigger.CANCEL)
        self.cancellation.fire(CancellationTrigger.CANCEL)
        self.cancellation.fire(CancellationTrigger.SETTLE, self)
        partial = "".join(self.forwarded) if self.cancellation.state == CancellationState.PERSISTED_PARTIAL else None
        return Finish(self._result(Outcome.CANCELLED, ErrorReason.CANCELLED, None, partial))

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
        interrupted = committed or self.life.state == TurnState.CONTINUING
        self.continuation = None  # nothing continues past the deadline
        if self.life.state in (TurnState.COMMITTED, TurnState.CONTINUING):
            self.life.fire(TurnTrigger.FAIL, self)
        elif not self.life.terminal:
            self.walk_result = WalkDone(ok=False, error=ErrorReason.DEADLINE)
            self.life.fire(TurnTrigger.END, self)
        self.cancellation.fire(CancellationTrigger.FINISH)
        if interrupted:
            return Finish(self._result(Outcome.INTERRUPTED, ErrorReason.INTERRUPTED, None, "".join(self.forwarded)))
        return Finish(self._result(Outcome.ERROR, ErrorReason.DEADLINE, None, None))

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
        return Finish(self._result(Outcome.ERROR, ErrorReason.INTERNAL, None, None))

    # -- the end ------------------------------------------------------------------------------

    def _done(self, done: WalkDone, now: float) -> Finish:
        """The turn's end: a walk's result reaches the spec (`end`, its `walk_succeeded` guard),
        a stream's end already did; the outcome is the state the turn lifecycle reached."""
        mode = self.call.mode if self.call is not None else _STREAM
        if self.refusal is not None:
            settled = self._settle_refusal(done)
            if settled is not done:
                done, mode = settled, self.refusal.mode
        self.call = None
        if self.health.probes:  # (a walk that ended released them)
            self.health.release_all()
        self.walk_result = done
        if not self.life.terminal:
            self.life.fire(_END, self)
        self.cancellation.fire(_FINISH)
        state = self.life.state
        if state == _COMPLETED:
            deliver = self._delivery(self.answer) if self.answer and self.stream_requested and mode == _COMPLETE_MODE else ()
            return Finish(self._result(fc.OK, None, done.entry, None), deliver)
        if state == TurnState.INTERRUPTED:
            return Finish(self._result(Outcome.INTERRUPTED, ErrorReason.INTERRUPTED, None, "".join(self.forwarded)))
        if state == TurnState.FAILED:
            return Finish(self._result(Outcome.ERROR, done.error or ErrorReason.EXHAUSTED, None, None))
        raise IllegalTransition(f"turn: a turn cannot end in state {state!r}")

    def _delivery(self, answer: Completion) -> tuple[Event, ...]:
        events = []
        if not self.shown_reasoning:
            events.extend(_reasoning_events(answer))
        if answer.text:
            events.append(Event(EventKind.TEXT, answer.text, json.dumps(answer.logprobs) if answer.logprobs else ""))
            self.forwarded.append(answer.text)
        ids = answer.tool_ids + ("",) * (len(answer.tool_calls) - len(answer.tool_ids))
        for name, arguments, ref in itertools.zip_longest(answer.tool_calls, answer.tool_arguments, ids):
            if name is None:
                break
            events.append(Event(EventKind.TOOL, name, ref))
            if arguments:
                events.append(Event(EventKind.TOOL_ARGS, arguments))
        return tuple(events)

    def _result(self, outcome: Outcome, error: ErrorReason | None, served: PlannedEntry | None,
                partial: str | None) -> TurnResult:
        fallback = served is not None and served.index != 0
        notice = None
        if fallback:
            mode = self.config.notices.model_fallback_notice
            if mode == "redacted":
                notice = "Note: a fallback model answered this request."
            elif served is not None and mode == "detailed":
                requested_entry = self.plan.entries[0].label if self.plan.entries else self.plan.requested
                notice = f"Note: {served.label} answered because {requested_entry} was unavailable."
        answer = self.answer if outcome == fc.OK and self.answer is not None else NO_ANSWER
        # positionally, in the fields' order: 21 keywords cost more to match than to build
        return TurnResult(
            outcome,
            error,
            self._error_message(error) if error else None,  # message
            self.plan.requested,
            served,
            answer.text if answer is not NO_ANSWER else None,
            answer.reasoning,
            answer.tool_calls,
            partial or None,  # partial_text
            notice,
            fallback,
            tuple(self.attempts),
            tuple(self.health.skips),  # skipped
            tuple(self.ledger),
            answer.tool_arguments,
            answer.tool_ids,
            answer.finish_reason,
            answer.stop_sequence,
            answer.usage,
            self._rejection(error) if self.rejections else None,
            answer.blocks,
            answer.logprobs,
            answer.annotations,
            self.shown_by if partial else None,
            answer.vectors,
            answer.input_count,
            answer.response_id,
        )

    def _rejection(self, error: ErrorReason | None) -> Rejection | None:
        """The upstream's own rejection, when every attempt of the turn was one."""
        if not self.rejections or error not in (ErrorReason.EXHAUSTED, ErrorReason.CLIENT_ERROR):
            return None
        if any(r is None for r in self.rejections):
            return None
        return self.rejections[-1]

    def _error_message(self, error: ErrorReason) -> str:
        """The aggregated error: every attempt's number, retry counter and reason class, bounded;
        never a provider body or a secret (details are written by relayline)."""
        head = {
            ErrorReason.EXHAUSTED: "every candidate failed",
            ErrorReason.SEMANTIC_EMPTY: "every candidate answered without text or tool calls",
            ErrorReason.CONTEXT_WINDOW: "the prompt exceeds the model's context window; compact and call again",
            ErrorReason.CLIENT_ERROR: "the provider rejected the request",
            ErrorReason.NO_CANDIDATE: "no entry could be attempted",
            ErrorReason.UNSUPPORTED: "no entry can honour the request as asked: "
                                     + ", ".join(dict.fromkeys(f for s in self.health.skips for f in s.fields)),
            ErrorReason.CANCELLED: "cancelled by the consumer",
            ErrorReason.DEADLINE: f"the turn did not end within timeouts.total_s ({self.config.timeouts.total_s:g}s)",
            ErrorReason.INTERNAL: "relayline failed to make or read the call (an internal error, logged)",
            ErrorReason.INTERRUPTED: "the stream failed after output was forwarded; it is not replayed",
        }[error]
        count = len(self.attempts)
        parts = [f"{head} ({count} attempt{'' if count == 1 else 's'}"
                 + (f", {len(self.health.skips)} skipped" if self.health.skips else "") + ")"]
        for n, a in enumerate(self.attempts[:MAX_ERROR_ATTEMPTS], start=1):
            parts.append(f"#{n} {a.provider}/{a.model} try {a.try_number}/{a.budget} {a.reason or a.outcome}"
                         + (f" ({a.detail})" if a.detail else ""))
        if len(self.attempts) > MAX_ERROR_ATTEMPTS:
            parts.append(f"... and {len(self.attempts) - MAX_ERROR_ATTEMPTS} more")
        message = "; ".join(parts)
        return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."

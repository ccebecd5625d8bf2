"""A turn's state, its records and the steps its entry actions take (specs/turn.toml), sans-I/O.

`TurnCore` is what the entry actions (turn_actions.py) act on: the plan, the turn's machines,
its walks and stream gates, what it forwarded, the attempts and ledger rows it recorded, the
guards its spec reads, and the steps that move it (fire a trigger, begin a call, follow a walk,
end a walk). `Turn` (turn.py) adds what the driver reports: a completion, a stream's frames and
end, a timer, a cancellation, the deadline. The entry actions import this module and the turn
binds them, so neither imports the other's dependent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import attrs

from . import classify as fc
from . import refusals
from .candidates import (
    Call,
    Need,
    Sleep,
    TurnHealth,
    WalkDone,
    another_candidate,
    first_candidate,
    stop_error,
)
from .config import Config
from .engine import Lifecycle, Spec, load_spec
from .health import HealthStore
from .ledger import LedgerRow, Usage, estimated_tokens, row
from .plan import Plan, PlannedEntry
from .results import (
    NO_ANSWER,
    Action,
    AttemptRecord,
    Completion,
    Rejection,
    TurnResult,
    error_message,
    last_rejection,
    rejection_of,
)
from .stream import StreamGate
from .vocab import ErrorReason, FailureClass, Mode, Outcome, StreamOutcome, TurnState, TurnTrigger
from .walk import Walk

# the words a turn reads a dozen times, once as module names: an enum member read is dearer
_STREAMING, _STREAM, _END = TurnState.STREAMING, Mode.STREAM, TurnTrigger.END
# what the turn's entry actions are bound as: state -> its actions, each a function of the turn
Bound = dict[str, tuple[Callable[..., Any], ...]]


@attrs.frozen
class EntryActions:
    """A spec's entry actions as the code performs them: the registry (action name -> function
    of the turn) and how a spec is bound to it, once per spec."""

    registry: Mapping[str, Callable[..., object]]
    bind: Callable[[Spec], Bound]


class TurnCore:
    # what entering each state of the turn's and the cancellation's specs does, by name, and how
    # a spec's actions are bound: the turn (turn.py) names them, as the entry actions import
    # this module and so cannot be imported here
    turn_entry: ClassVar[EntryActions]
    cancellation_entry: ClassVar[EntryActions]

    # slotted, as the walk and the lifecycles: a turn's attributes are read and written some
    # hundred times a turn, and each held stream keeps its turn
    __slots__ = ("plan", "config", "health", "stream_requested", "tools", "life", "cancellation",
                 "attempts", "ledger", "walk", "gate", "walks", "gates", "call", "call_at",
                 "answer", "forwarded", "shown_reasoning", "executed_tools", "failure",
                 "continuation", "walk_result", "spent", "refusal", "refusals_advance",
                 "rejections", "prompt_chars", "shown_by", "call_text_from", "now",
                 "entry_actions", "cancellation_actions", "first_stream", "answer_mode",
                 "stream_shown")

    def __init__(self, plan: Plan, config: Config, store: HealthStore, *, stream: bool,
                 tools: bool = False, prompt_chars: Callable[[], int] = lambda: 0):
        self.plan = plan
        self.config = config
        self.health = TurnHealth(store)
        self.stream_requested = stream
        self.tools = tools
        self.life = Lifecycle(spec := load_spec("turn"))
        actions = self.turn_entry
        self.entry_actions = spec.derived.get(id(actions.registry)) or actions.bind(spec)
        self.cancellation = Lifecycle(spec := load_spec("cancellation"))
        actions = self.cancellation_entry
        self.cancellation_actions = (spec.derived.get(id(actions.registry))
                                     or actions.bind(spec))
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
        # the stream failure being decided (guard recoverable)
        self.failure: fc.Failure | None = None
        # guard continuable: the entry that would continue
        self.continuation: PlannedEntry | None = None
        self.walk_result: WalkDone | None = None  # guard walk_succeeded
        self.spent: dict[int, int] = {}  # attempts made per entry index, across the turn's walks
        self.refusal: refusals.Refusal | None = None
        # guard refusals_advance, read by [outcomes.refusal]: the configured mode, read once
        self.refusals_advance = config.reliability.on_refusal == "advance"
        # per failed attempt: its client rejection, if it was one
        self.rejections: list[Rejection | None] = []
        # the request's text (wire.Request.prompt_chars), counted only when needed
        self.prompt_chars = prompt_chars
        self.shown_by: PlannedEntry | None = None  # the entry of the last stream that committed
        self.call_text_from = 0  # where the pending call's text begins in `forwarded`
        self.now = 0.0  # the time of the result being acted on (the entry actions read it)
        # guard stream_entry: the first entry that can open a stream, once looked for (None:
        # none can; False: not looked for yet)
        self.first_stream: PlannedEntry | None | bool = False
        self.answer_mode = _STREAM  # the mode of the call whose answer the turn ends with
        # guard stream_shown: the failed stream's output had reached the sink
        self.stream_shown = False

    @property
    def lifecycles(self) -> list[Lifecycle]:
        """Every machine this turn ran, in the order they started."""
        return [self.life, self.cancellation, *(w.life for w in self.walks),
                *(g.life for g in self.gates)]

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

    # -- steps --------------------------------------------------------------------------------

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

    def _walk_from(self, walk: Walk, now: float,
                   action: Call | Sleep | WalkDone | None = None) -> Action:
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

    def _done(self, done: WalkDone, now: float) -> Action:
        """A walk ended: its result reaches the spec (`end`, its `walk_succeeded` guard) and the
        state reached ends the turn (its entry action)."""
        mode = self.call.mode if self.call is not None else _STREAM
        if self.refusal is not None:
            settled = self._settled(done)
            if settled is not done:
                done, mode = settled, self.refusal.mode
        self.walk_result, self.answer_mode, self.now = done, mode, now
        return self._step(_END)

    # -- candidates ---------------------------------------------------------------------------

    def _only_candidate(self, index: int, now: float) -> bool:
        """No other candidate (walk.another_candidate) for the entry: a recovery walk starts
        over, so every entry is within its reach."""
        return not another_candidate(self.plan, self.health, self.plan.entries[index], now,
                                     range(len(self.plan.entries)))

    def _continuation_candidate(self, failed: PlannedEntry, now: float) -> PlannedEntry | None:
        """stream.continue_after_interrupt: the next entry after the failed one that can be
        attempted now with a prefilled stream. Only text can be continued."""
        if (not self.config.stream.continue_after_interrupt or not self.has_forwarded_text
                or self._gate().tools):
            return None
        j = first_candidate(self.plan, self.health, now,
                            range(failed.index + 1, len(self.plan.entries)),
                            Need(stream=True, tools=self.tools, prefill=True))
        return None if j is None else self.plan.entries[j]

    # -- records ------------------------------------------------------------------------------

    def _record(self, outcome: Outcome | FailureClass | StreamOutcome, now: float, *,
                reason: FailureClass | StreamOutcome | None = None, detail: str = "",
                usage: Usage | None = None, accepted: bool = False, bill: bool = True,
                failure: fc.Failure | None = None, shown: bool = False,
                answer: Completion | None = None) -> None:
        """One attempt, and its ledger row when it was billed. `shown`: the provider billed what
        the consumer saw (or the answer it gave): when it reported no usage, the row is billed
        at relayline's estimate (`_estimated_usage`) and marked so."""
        call = self.call
        assert call is not None, "no call is pending"
        if outcome != fc.OK:
            self.rejections.append(rejection_of(failure))
        entry = call.entry
        self.spent[entry.index] = self.spent.get(entry.index, 0) + 1
        self.attempts.append(AttemptRecord(entry.profile, entry.model, call.mode, outcome, reason,
                                           self.call_at, call.key_index, call.try_number,
                                           call.budget, detail, now))
        estimated = shown and usage is None
        if estimated:
            usage, bill = self._estimated_usage(answer), True
        if usage is not None and (bill or usage.billable):
            self.ledger.append(row(entry.profile, entry.model, entry.price, usage,
                                   accepted=accepted, outcome=outcome, mode=call.mode,
                                   estimated=estimated))

    def _estimated_usage(self, answer: Completion | None = None) -> Usage:
        """What the pending call is estimated to have cost when the provider reported no usage:
        the request's text in; out, the text and tool calls it answered (`answer`, a
        complete-mode reply) or, for a stream, forwarded."""
        call = self.call
        assert call is not None
        if answer is not None:
            out = (len(answer.text) + sum(map(len, answer.tool_calls))
                   + sum(map(len, answer.tool_arguments)))
        else:
            assert self.gate is not None
            out = sum(map(len, self.forwarded[self.call_text_from:]))
            out += sum(map(len, self.gate.tools)) + sum(map(len, self.gate.tool_arguments))
        prompt = self.prompt_chars() + (len(call.prefill) if call.prefill else 0)
        return Usage(estimated_tokens(prompt), estimated_tokens(out))

    # -- refusals (reliability.on_refusal: refusals.py, [outcomes.refusal]) -------------------

    def _refusal_way(self, *, answered: bool, shown: bool) -> str:
        """What the refusal of the pending call makes of its attempt ([outcomes.refusal])."""
        return refusals.way(self.life.spec.outcomes["refusal"], advance=self.refusals_advance,
                            answered=answered, shown=shown)

    def _record_refusal(self, failure: fc.Failure, now: float, *,
                        answer: Completion | None = None,
                        usage: Usage | None = None) -> fc.Failure:
        """Record a refusal the walk advances past; the profile is not asked again this turn."""
        rows = len(self.ledger)
        # the refusal is the provider's answer: without its usage, billed at the estimate (`shown`)
        self._record(fc.REFUSED, now, reason=fc.REFUSED, detail=failure.detail, usage=usage,
                     failure=failure, shown=answer is not None, answer=answer)
        call = self._call()
        billed = rows if len(self.ledger) > rows else None
        self.refusal = refusals.Refusal(call.entry, answer, len(self.attempts) - 1, billed,
                                        call.mode)
        self.health.refused.add(call.entry.profile)
        return failure

    def _settled(self, done: WalkDone) -> WalkDone:
        """The end of the walk that advanced past the turn's last refusal, as
        [outcomes.refusal_settles] says; when the refusal is the answer, the turn takes it."""
        refusal = self.refusal
        assert refusal is not None, "no refusal was advanced past"
        settled = refusals.settle(self.life.spec.outcomes["refusal_settles"], refusal, done,
                                  self.attempts, self.ledger)
        if settled is not done and settled.ok:
            self.answer = refusal.answer
        return settled

    # -- the result ---------------------------------------------------------------------------

    def result(self, outcome: Outcome, error: ErrorReason | None, served: PlannedEntry | None,
               partial: str | None) -> TurnResult:
        """The result a turn ends with: its answer (when it is one), attribution, notice,
        records."""
        fallback = served is not None and served.index != 0
        notice = None
        if fallback:
            mode = self.config.notices.model_fallback_notice
            if mode == "redacted":
                notice = "Note: a fallback model answered this request."
            elif served is not None and mode == "detailed":
                entries = self.plan.entries
                requested_entry = entries[0].label if entries else self.plan.requested
                notice = f"Note: {served.label} answered because {requested_entry} was unavailable."
        answer = self.answer if outcome == fc.OK and self.answer is not None else NO_ANSWER
        # positionally, in the fields' order: 21 keywords cost more to match than to build
        return TurnResult(
            outcome,
            error,
            (error_message(error, self.attempts, self.health.skips, self.config.timeouts.total_s)
         if error else None),
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
            last_rejection(self.rejections, error),
            answer.blocks,
            answer.logprobs,
            answer.annotations,
            self.shown_by if partial else None,
            answer.vectors,
            answer.input_count,
            answer.response_id,
        )

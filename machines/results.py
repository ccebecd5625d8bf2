"""What a turn gives back (machines/turn_core.py builds them): the answer (`Completion`), each
attempt (`AttemptRecord`), the upstream's own rejection (`Rejection`), the result (`TurnResult`)
and the `Finish` that carries it, and the words and events made from them: the aggregated error
message, the delivery of an answer that was not streamed."""

from __future__ import annotations

import itertools
import json
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from . import classify as fc
from .candidates import Call, Skip, Sleep
from .ledger import LedgerRow, Usage
from .plan import PlannedEntry
from .stream import Event, strip_think
from .vocab import ErrorReason, EventKind, FailureClass, Mode, Outcome, StreamOutcome
from .wire import CONTENT_FILTER

_COST = operator.attrgetter("cost_usd")
MAX_ERROR_ATTEMPTS = 16
MAX_ERROR_CHARS = 2000
REJECTION_STATUSES = (400, 413, 422)


def rejection_of(failure: fc.Failure | None) -> Rejection | None:
    """The upstream's words, when `failure` rejected the request itself (400, 413, 422)."""
    if (failure is None or failure.kind not in (fc.REJECTED, fc.REFUSED)
            or failure.status not in REJECTION_STATUSES):
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
    # which stop sequence ended it, when the provider says (Anthropic)
    stop_sequence: str | None = None
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
        # a refusal is what the provider answered, text or not: retrying it as empty asks the
        # same policy again
        return (bool(self.tool_calls) or bool(strip_think(self.text).strip()) or self.refusal
                or bool(self.vectors) or self.input_count is not None)


NO_ANSWER = Completion()  # a result without an answer reads its answer's fields from this one


def reasoning_events(answer: Completion) -> list[Event]:
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
        return {"provider": self.provider, "model": self.model, "mode": self.mode,
                "outcome": self.outcome, "reason": self.reason, "at": round(self.at, 6),
                "key": self.key}


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
    # the answer's (Completion.blocks)
    blocks: tuple[Mapping[str, Any], ...] = attrs.field(default=(), eq=False)
    logprobs: Mapping[str, Any] | None = attrs.field(default=None, eq=False)  # the answer's
    annotations: tuple[Mapping[str, Any], ...] = attrs.field(default=(), eq=False)  # the answer's
    # the entry whose output the consumer saw when nothing was accepted (`partial_text`'s source):
    # `served` stays None, this names who billed it
    partial_from: PlannedEntry | None = None
    # an embeddings answer's
    vectors: tuple[Mapping[str, Any], ...] = attrs.field(default=(), eq=False)
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


def delivery(answer: Completion, shown_reasoning: bool) -> tuple[Event, ...]:
    """A stream turn's answer that came whole (an entry that cannot stream): its events as one
    decisive delivery, its reasoning unless some was shown already."""
    events = []
    if not shown_reasoning:
        events.extend(reasoning_events(answer))
    if answer.text:
        logprobs = json.dumps(answer.logprobs) if answer.logprobs else ""
        events.append(Event(EventKind.TEXT, answer.text, logprobs))
    ids = answer.tool_ids + ("",) * (len(answer.tool_calls) - len(answer.tool_ids))
    calls = itertools.zip_longest(answer.tool_calls, answer.tool_arguments, ids)
    for name, arguments, ref in calls:
        if name is None:
            break
        events.append(Event(EventKind.TOOL, name, ref))
        if arguments:
            events.append(Event(EventKind.TOOL_ARGS, arguments))
    return tuple(events)


def last_rejection(rejections: Sequence[Rejection | None],
                   error: ErrorReason | None) -> Rejection | None:
    """The upstream's own rejection, when every attempt of the turn was one."""
    if not rejections or error not in (ErrorReason.EXHAUSTED, ErrorReason.CLIENT_ERROR):
        return None
    if any(r is None for r in rejections):
        return None
    return rejections[-1]


def error_message(error: ErrorReason, attempts: Sequence[AttemptRecord], skips: Sequence[Skip],
                  total_s: float) -> str:
    """The aggregated error: every attempt's number, retry counter and reason class, bounded;
    never a provider body or a secret (details are written by relayline)."""
    head = {
        ErrorReason.EXHAUSTED: "every candidate failed",
        ErrorReason.SEMANTIC_EMPTY: "every candidate answered without text or tool calls",
        ErrorReason.CONTEXT_WINDOW: ("the prompt exceeds the model's context window; compact and "
                                     "call again"),
        ErrorReason.CLIENT_ERROR: "the provider rejected the request",
        ErrorReason.NO_CANDIDATE: "no entry could be attempted",
        ErrorReason.UNSUPPORTED: "no entry can honour the request as asked: "
                                 + ", ".join(dict.fromkeys(f for s in skips for f in s.fields)),
        ErrorReason.CANCELLED: "cancelled by the consumer",
        ErrorReason.DEADLINE: f"the turn did not end within timeouts.total_s ({total_s:g}s)",
        ErrorReason.INTERNAL: ("relayline failed to make or read the call (an internal error, "
                               "logged)"),
        ErrorReason.INTERRUPTED: "the stream failed after output was forwarded; it is not replayed",
    }[error]
    count = len(attempts)
    parts = [f"{head} ({count} attempt{'' if count == 1 else 's'}"
             + (f", {len(skips)} skipped" if skips else "") + ")"]
    for n, a in enumerate(attempts[:MAX_ERROR_ATTEMPTS], start=1):
        parts.append(f"#{n} {a.provider}/{a.model} try {a.try_number}/{a.budget} "
                     f"{a.reason or a.outcome}" + (f" ({a.detail})" if a.detail else ""))
    if len(attempts) > MAX_ERROR_ATTEMPTS:
        parts.append(f"... and {len(attempts) - MAX_ERROR_ATTEMPTS} more")
    message = "; ".join(parts)
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."

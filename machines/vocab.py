"""The core's words, typed: states, triggers, event kinds, outcomes, error reasons, modes.

Every lifecycle's states and triggers are enumerated here and checked against its spec when the
spec loads (engine.load_spec), so a state renamed in specs/*.toml and not here (or the reverse)
fails at import time instead of as a comparison that is silently never true.

The enums are `StrEnum`s: a member equals its string ("ok" == Outcome.OK), so traces, scenarios,
JSON and the adapters keep reading and writing plain strings.
"""

from __future__ import annotations

from enum import StrEnum

# -- lifecycle states and triggers (specs/*.toml) --------------------------------------------


class TurnState(StrEnum):
    PLANNED = "planned"
    STREAMING = "streaming"
    COMMITTED = "committed"
    WALKING = "walking"
    RECOVERING = "recovering"
    SEMANTIC_EMPTY_RECOVERY = "semantic_empty_recovery"
    CONTINUING = "continuing"
    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"


class TurnTrigger(StrEnum):
    START = "start"
    COMMIT = "commit"
    RETRY_STREAM = "retry_stream"
    COMPLETE = "complete"
    FAIL = "fail"
    END = "end"
    EXPIRE = "expire"
    CANCEL = "cancel"


class StreamState(StrEnum):
    OPENING = "opening"
    HELD = "held"
    COMMITTED = "committed"
    COMPLETED = "completed"
    SEMANTIC_EMPTY = "semantic_empty"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"


class StreamTrigger(StrEnum):
    HEADERS = "headers"
    DECISIVE = "decisive"
    FINISH = "finish"
    FAIL = "fail"
    CANCEL = "cancel"


class WalkState(StrEnum):
    CHOOSING = "choosing"
    CALLING = "calling"
    BACKING_OFF = "backing_off"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class WalkTrigger(StrEnum):
    CALL = "call"
    EXHAUST = "exhaust"
    SUCCEED = "succeed"
    BACKOFF = "backoff"
    TIMER = "timer"
    RETRY_NOW = "retry_now"
    ADVANCE = "advance"
    STOP = "stop"
    CANCEL = "cancel"


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"
    PROBING = "probing"


class BreakerTrigger(StrEnum):
    FAILURE = "failure"
    SUCCESS = "success"
    COOL_OFF = "cool_off"
    FORCE_PROBE = "force_probe"
    PROBE = "probe"
    RELEASE = "release"
    LEASE_EXPIRED = "lease_expired"


class CancellationState(StrEnum):
    RUNNING = "running"
    CANCEL_REQUESTED = "cancel_requested"
    ABORTED = "aborted"
    PERSISTED_PARTIAL = "persisted_partial"
    FINISHED = "finished"


class CancellationTrigger(StrEnum):
    CANCEL = "cancel"
    SETTLE = "settle"
    FINISH = "finish"


class BudgetState(StrEnum):
    OPEN = "open"
    WARNED = "warned"
    SPENT = "spent"


class BudgetTrigger(StrEnum):
    SPEND = "spend"
    PERIOD_END = "period_end"


class AdmissionState(StrEnum):
    ASKED = "asked"
    COUNTED = "counted"
    SETTLED = "settled"
    REFUSED = "refused"


class AdmissionTrigger(StrEnum):
    JUDGE = "judge"
    SETTLE = "settle"


# spec name -> (its states, its triggers); engine.load_spec checks both against the spec
SPEC_VOCABULARY: dict[str, tuple[type[StrEnum], type[StrEnum]]] = {
    "turn": (TurnState, TurnTrigger),
    "stream": (StreamState, StreamTrigger),
    "walk": (WalkState, WalkTrigger),
    "breaker": (BreakerState, BreakerTrigger),
    "cancellation": (CancellationState, CancellationTrigger),
    "budget": (BudgetState, BudgetTrigger),
    "admission": (AdmissionState, AdmissionTrigger),
}


# -- what flows through a turn -----------------------------------------------------------------


class FrameKind(StrEnum):
    """Frames as protocol adapters and the simulator produce them."""

    ROLE = "role"
    PING = "ping"
    PREAMBLE = "preamble"
    TEXT = "text"
    REASONING = "reasoning"
    # an Anthropic redacted_thinking block: its opaque data
    REDACTED_REASONING = "redacted_reasoning"
    TOOL_CALL = "tool_call"
    TOOL_ARGS = "tool_args"  # a fragment of a tool call's JSON arguments, after its TOOL_CALL
    EXECUTED_TOOL = "executed_tool"
    USAGE = "usage"
    # the provider's finish reason (canonical, machines/wire.py): bookkeeping, never shown
    FINISH = "finish"
    DONE = "done"  # a protocol's completion signal


class EventKind(StrEnum):
    """Events as they reach the immutable sink (and the trace: "text:...", "tool:NAME")."""

    TEXT = "text"
    REASONING = "reasoning"
    # reasoning shown only as data the provider reads back
    REDACTED_REASONING = "redacted_reasoning"
    TOOL = "tool"
    TOOL_ARGS = "tool_args"
    EXECUTED_TOOL = "executed_tool"
    # held protocol frames released at commit (not visible to library consumers)
    PREAMBLE = "preamble"


class Mode(StrEnum):
    """How one attempt is made."""

    COMPLETE = "complete"
    STREAM = "stream"


class FailureClass(StrEnum):
    """The failure classes (docs/concepts.md, "The walk"): each is one column of the walk's
    decision table."""

    EMPTY = "empty"
    RETRYABLE = "retryable"
    # a reply that does not parse into the canonical model: retried like retryable
    MALFORMED = "malformed"
    TIMEOUT = "timeout"
    RATE_LIMITED = "rate_limited"
    QUOTA = "quota"
    CONTEXT_WINDOW = "context_window"
    REJECTED = "rejected"
    # a content-policy refusal (docs/concepts.md, "Refusals"): a 400 naming a content policy, or a
    # completion whose finish reason is content_filter. With on_refusal = "return" the turn demotes
    # it to what it was before refusals had a class of their own (rejected, or an ordinary answer).
    REFUSED = "refused"
    TOO_LARGE = "too_large"  # the answer outgrew limits.max_response_bytes: advance, never retried
    # relayline could not make or read the call (its own fault, not the provider's)
    INTERNAL = "internal"


class Outcome(StrEnum):
    """How a turn ended."""

    OK = "ok"
    ERROR = "error"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"


class StreamOutcome(StrEnum):
    """A stream-mode attempt's outcome when it is not a success (a failure class is the reason)."""

    STREAM_FAILED = "stream_failed"
    INTERRUPTED = "interrupted"
    SEMANTIC_EMPTY = "semantic_empty"
    CANCELLED = "cancelled"


class ErrorReason(StrEnum):
    """Why a turn has no accepted answer (TurnError.reason)."""

    EXHAUSTED = "exhausted"
    SEMANTIC_EMPTY = "semantic_empty"
    CONTEXT_WINDOW = "context_window"
    CLIENT_ERROR = "client_error"
    NO_CANDIDATE = "no_candidate"
    UNSUPPORTED = "unsupported"  # no entry can honour the request as asked (docs/wire.md)
    DEADLINE = "deadline"  # timeouts.total_s passed before an answer
    INTERNAL = "internal"  # relayline failed to make or read the call (logged with its stack)
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"
    SHUTDOWN = "shutdown"  # the gateway's drain cancelled the turn (a library turn never ends so)


class SkipReason(StrEnum):
    """Why an entry cannot be attempted now (walk.unavailable); every reason but REFUSED is
    recorded as a skip."""

    COOLDOWN = "cooldown"
    BREAKER = "breaker"
    ALLOWLIST = "allowlist"
    CAPABILITY = "capability"
    UNSUPPORTED = "unsupported"  # the entry cannot honour fields of the request
    # the profile refused in this turn (on_refusal = "advance"): not asked again, and never
    # recorded as a skip, since nothing about its health is known
    REFUSED = "refused"

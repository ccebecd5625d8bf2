"""One exception hierarchy for everything relayline raises on purpose.

Every error carries a short reason class (a stable word callers can switch on) and a message
written by relayline itself: never a provider body, never a secret. Provider text stays out of
exceptions because exceptions end up in logs, traces and HTTP error bodies.
"""

from __future__ import annotations

from .vocab import ErrorReason


class RelaylineError(Exception):
    """Base class. `reason` is a stable machine-readable class of the failure."""

    reason = "error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class SpecError(RelaylineError):
    """A lifecycle spec is malformed or violates one of its invariants."""

    reason = "spec"


class IllegalTransition(RelaylineError):
    """A machine was asked to take a transition its spec does not declare."""

    reason = "illegal_transition"


class ConfigError(RelaylineError):
    """The configuration cannot be used. `problems` lists every problem, each naming its key
    path."""

    reason = "config"

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  {p}" for p in self.problems))


class TurnError(RelaylineError):
    """A turn ended without an accepted answer.

    `reason` is an ErrorReason (a StrEnum: it equals its string): exhausted, semantic_empty,
    context_window, client_error, no_candidate, cancelled, interrupted. `attempts` is the
    bounded aggregated summary (never bodies); `partial_text` what a stream forwarded.
    """

    reason: ErrorReason = ErrorReason.EXHAUSTED

    def __init__(self, message: str, *, reason: str, attempts: tuple[object, ...] = (),
                 partial_text: str | None = None) -> None:
        super().__init__(message)
        self.reason = ErrorReason(reason)
        self.attempts = attempts
        self.partial_text = partial_text


class StreamInterruptedAfterOutput(TurnError):
    """The stream failed after output reached the consumer: it is never replayed."""

    partial_text: str

    def __init__(self, message: str, *, attempts: tuple[object, ...] = (),
                 partial_text: str = "") -> None:
        super().__init__(message, reason="interrupted", attempts=attempts,
                         partial_text=partial_text)

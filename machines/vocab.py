"""The core's words, typed: states, triggers, event kinds, outcomes, error reasons, modes.

Every lifecycle's states and triggers are enumerated here and checked against its spec when the
spec loads (engine.load_spec), so a state renamed in specs/*.toml and not here (or the reverse)
fails at import time instead of as a comparison that is silently never true.

The enums are `StrEnum`s: a member equals its string ("ok" == Outcome.OK), so traces, scenarios,
JSON and the adapters keep reading and writing plain strings.
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    """How a turn ended."""

    OK = "ok"
    ERROR = "error"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"


class ErrorReason(StrEnum):
    """Why a turn has no accepted answer (TurnError.reason)."""

    EXHAUSTED = "exhausted"
    SEMANTIC_EMPTY = "semantic_empty"
    CONTEXT_WINDOW = "context_window"
    CLIENT_ERROR = "client_error"
    NO_CANDIDATE = "no_candidate"
    UNSUPPORTED = "unsupported"  # no entry can honour the request as asked (CONFIG.md "The wire")
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"

"""One provider attempt's deadline, moved as the provider reaches each phase of its answer."""

from __future__ import annotations

import math

import trio

from relayline.machines import classify as fc
from relayline.machines.config import Timeouts


class AttemptClock:
    """One attempt's deadline, moved as the provider reaches each phase, so the provider answers
    only for its own time: `headers_s` runs from the moment the request was written to the
    upstream socket (not while the turn waited for a pooled connection), then `idle_s` bounds
    each gap in a non-streamed body. An adapter that cannot tell when it wrote (the sim family)
    gets the headers clock at once. Timeout messages name the phase that ran out.

    The deadline is set on a scope that may also carry the turn's total budget (`limit`): it is
    never moved past it, so one scope serves both (the turn's, in TurnRun._complete)."""

    __slots__ = ("scope", "timeouts", "phase", "limit")

    def __init__(self, scope: trio.CancelScope, timeouts: Timeouts, *, from_write: bool,
                 limit: float = math.inf) -> None:
        self.scope = scope
        self.timeouts = timeouts
        self.limit = limit
        self.phase = "sending"
        if not from_write:
            self.sent()

    def _after(self, seconds: float) -> float:
        return min(trio.current_time() + seconds, self.limit) if seconds > 0 else self.limit

    def sent(self) -> None:
        """The request is on the wire: the provider's headers clock starts."""
        self.phase = "headers"
        self.scope.deadline = self._after(self.timeouts.headers_s)

    def headers(self) -> None:
        """Response headers arrived: from now on only a stalled body is the provider's delay."""
        self.phase = "body"
        self.scope.deadline = self._after(self.timeouts.idle_s)

    def received(self) -> None:
        if self.phase == "body":
            self.scope.deadline = self._after(self.timeouts.idle_s)

    def read(self) -> None:
        """The whole body is in, and its decoding will be awaited (in a worker process, for a
        large one: started on first use): that is relayline's time, not a stalled provider's; it
        is bounded by the body's size (and by the turn's budget). A body decoded inline awaits
        nothing, so no deadline can fire in it: the adapter does not call this then."""
        self.phase = "decoding"
        self.scope.deadline = self.limit

    def ran_out(self) -> bool:
        """Whether the scope's deadline, when it expired, was this attempt's own and not the
        turn's budget (a tie is the budget's, as an outer scope's would be)."""
        return self.scope.deadline < self.limit

    def failure(self) -> fc.Failure:
        if self.phase == "body":
            return fc.timed_out("response body bytes (a stalled body)", self.timeouts.idle_s)
        return fc.timed_out("response headers", self.timeouts.headers_s)



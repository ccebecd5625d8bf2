"""A streamed attempt, as the driver runs it: the stream opened, its frames run through the
commit gate under `timeouts.first_token_s` and `idle_s`, the text it accumulates bounded by
`limits.max_response_bytes`, and the provider's idle deadline lifted while the consumer is slow.

It is its own module because a stream's frames are the one place where the driver works per
frame, not per attempt: the deadlines re-armed with slack, the sink's pace, the draft shown.
The turn around it (driver.py's `TurnRun`: the turn's scope, its budget, a whole answer's
attempt, the fleet's health) inherits these methods from `StreamAttempts`, so a stream in flight
costs no object of its own and `TurnRun.consumer_paused` is still where the gateway finds it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING

import trio

from relayline.machines import classify as fc
from relayline.machines.config import Timeouts
from relayline.machines.stream import REASONING, TEXT, TOOL_ARGS, Frame
from relayline.machines.turn import Turn
from relayline.machines.walk import Call

from .attempt_clock import AttemptClock
from .providers.base import DONE, CallRequest, ProviderClient, ProviderFailure
from .sinks import Sink

_SIZED = frozenset({TEXT, REASONING, TOOL_ARGS})  # frames whose text a stream accumulates


class Escalated(Exception):
    """Carries an exception raised by relayline's machines or the consumer's sink out of an
    attempt, so that it is not mistaken for the attempt's own failure."""

    def __init__(self, error: Exception) -> None:
        super().__init__(repr(error))
        self.error = error


class StreamAttempts:
    """A turn run's streamed attempts (driver.py's `TurnRun` is one): what they read of the run
    is declared here, and set by the run."""

    turn: Turn
    timeouts: Timeouts
    max_bytes: int
    on_draft: Callable[[str], None] | None
    _frames_scope: trio.CancelScope | None  # the open stream's idle deadline
    _first_token_deadline: float

    if TYPE_CHECKING:
        # the run's own, shared with its non-streamed attempts (driver.py)
        def _request(self, call: Call, clock: AttemptClock | None = None,
                     waiting: Callable[[], Awaitable[None]] | None = None) -> CallRequest: ...

        def _client(self, call: Call) -> ProviderClient: ...

        def _internal(self, call: Call, exc: Exception) -> fc.Failure: ...

    @contextlib.contextmanager
    def consumer_paused(self) -> Iterator[None]:
        """The consumer cannot take more yet (a gateway client reading slowly): the upstream
        read pauses with it, and the provider's idle deadline is lifted meanwhile, since a slow
        reader is not a stalled provider. The deadline starts afresh when the consumer resumes."""
        scope = self._frames_scope
        if scope is None:
            yield
            return
        scope.deadline = math.inf
        try:
            yield
        finally:
            if self._frames_scope is scope:
                self._arm(scope, trio.current_time())

    def _arm(self, scope: trio.CancelScope, now: float) -> None:
        idle = self.timeouts.idle_s
        deadline = now + idle if idle > 0 else math.inf
        gate = self.turn.gate
        assert gate is not None  # (only a stream's frames are armed)
        scope.deadline = deadline if gate.committed else min(self._first_token_deadline, deadline)

    async def _pump(self, call: Call, sink: Sink) -> fc.Failure | None:
        """Open the stream and run its frames through the gate. Returns the failure, or None
        when the completion signal arrived.

        A sink that gathers what it writes (`waiting`: the gateway's wire) is told before each
        upstream read that may block, by an adapter that reports its waits; with any other, it
        is told after each frame that gave it events (one write per frame, never a frame held
        back while the upstream is silent)."""
        client = self._client(call)
        waiting = getattr(sink, "waiting", None)
        reported = waiting is not None and getattr(client, "reports_waits", False)
        try:
            with trio.CancelScope() as scope:
                clock = AttemptClock(scope, self.timeouts,
                                     from_write=getattr(client, "reports_sent", False))
                opened = client.stream(self._request(call, clock, waiting if reported else None))
                frames = await opened.__aenter__()
            if scope.cancelled_caught:  # (the stream was not entered: nothing to exit)
                return clock.failure()
            # the stream is exited by hand, not through an AsyncExitStack: its deque would be
            # memory every in-flight stream holds
            try:
                try:
                    self.turn.stream_headers()
                except Exception as exc:
                    raise Escalated(exc) from None
                failure = await self._frames(frames, sink, None if reported else waiting)
            except BaseException as exc:
                if not await opened.__aexit__(type(exc), exc, exc.__traceback__):
                    raise
                return None  # (suppressed: as `async with` would, the block's end)
            await opened.__aexit__(None, None, None)
            return failure
        except ProviderFailure as exc:
            return exc.failure
        except Escalated:
            raise
        except Exception as exc:
            return self._internal(call, exc)

    async def _frames(self, frames: AsyncIterator[Frame], sink: Sink,
                      each_frame: Callable[[], Awaitable[None]] | None = None) -> fc.Failure | None:
        """Run the frames through the gate under first_token_s and idle_s.

        Moving a cancel scope's deadline costs more than the rest of a frame's handling, so it
        is re-armed at most every `slack` seconds (a stall is caught between idle_s and idle_s
        + slack). A sink that may block (a consumer reading at its own pace, `may_block`) lifts
        the deadline while it runs: a slow consumer is not a stalled provider; a sink that
        blocks only now and then says so with `consumer_paused`. The text the stream
        accumulates is bounded by limits.max_response_bytes."""
        turn = self.turn
        t = self.timeouts
        gate = turn.gate
        assert gate is not None  # (stream_headers opened it)
        # read once a frame: the run's clock, looked up once
        clock = trio.lowlevel.current_clock().current_time
        opened = clock()
        first_token_deadline = opened + t.first_token_s if t.first_token_s > 0 else math.inf
        self._first_token_deadline = first_token_deadline
        idle = t.idle_s if t.idle_s > 0 else math.inf
        slack = min(0.25, idle / 20)
        lift = getattr(sink, "may_block", True)
        room = self.max_bytes
        armed_at = opened
        draft: list[str] = []
        provider = True  # an exception while iterating is the attempt's; in the body, not
        with trio.CancelScope(deadline=min(first_token_deadline, opened + idle)) as scope:
            self._frames_scope = scope
            try:
                async for frame in frames:
                    provider = False
                    if frame.kind == DONE:
                        return None
                    if frame.kind in _SIZED and frame.value:
                        value = frame.value
                        room -= (
                            len(value)
                            if value.isascii()
                            else len(value.encode("utf-8", "surrogatepass"))
                        )
                        if room < 0:
                            return fc.too_large(self.max_bytes, "streamed text")
                    events = turn.stream_frame(frame)
                    if events:
                        if lift:
                            scope.deadline = math.inf
                            armed_at = -math.inf
                        for event in events:
                            await sink(event)
                            # frames that arrived in one read have no checkpoint between them:
                            # a consumer that cancelled in its sink must not be sent one more
                            await trio.lowlevel.checkpoint_if_cancelled()
                            if self.on_draft is not None and event.kind == "text":
                                draft.append(event.value)
                                self.on_draft("".join(draft))
                        if each_frame is not None:
                            await each_frame()
                    now = clock()
                    if now - armed_at >= slack:
                        armed_at = now
                        scope.deadline = (
                            now + idle if gate.committed else min(first_token_deadline, now + idle)
                        )
                    provider = True
            except ProviderFailure as exc:
                return exc.failure
            except Exception as exc:
                if provider:
                    raise
                raise Escalated(exc) from None
            finally:
                self._frames_scope = None
        if scope.cancelled_caught:
            if not gate.committed and trio.current_time() >= first_token_deadline:
                return fc.timed_out("decisive frame", t.first_token_s)
            return fc.timed_out("frame (stalled stream)", t.idle_s)
        return fc.truncated()

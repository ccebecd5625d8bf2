"""The trio driver: executes a turn's actions, and nothing else.

The machines decide (machines/turn.py); this module performs: provider calls through the
protocol adapters, sleeps, sink writes, and the timeouts as trio cancel scopes. Cancellation
arrives as trio.Cancelled from whoever owns the turn (a caller's scope, a gateway client that
went away): the driver records it on the turn, which never retries after it, and re-raises.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Awaitable, Callable, Mapping

import trio

from relayline.machines import classify as fc
from relayline.machines import wire
from relayline.machines.config import Timeouts
from relayline.machines.errors import RelaylineError
from relayline.machines.stream import Event
from relayline.machines.turn import Completion, Finish, Turn, TurnResult
from relayline.machines.walk import Call, Sleep

from .providers.base import DONE, CallRequest, ProviderClient, ProviderFailure

Sink = Callable[[Event], Awaitable[None]]  # may carry `may_block = False` (see TurnRun._frames)


async def _discard(event: Event) -> None:
    return None


_discard.may_block = False


class TurnRun:
    """One turn's execution. `result` is set however the run ends, cancellation included."""

    def __init__(
        self,
        turn: Turn,
        clients: Mapping[str, ProviderClient],
        request: wire.Request,
        *,
        on_draft: Callable[[str], None] | None = None,
    ) -> None:
        self.turn = turn
        self.clients = clients
        self.request = request
        self.timeouts: Timeouts = turn.config.timeouts
        self.on_draft = on_draft
        self.result: TurnResult | None = None
        # a fleet's shared health (stores/health.py): its mirror is synced with the store before
        # each decision of the turn's machines, so each sees the fleet (an answer needs none:
        # whatever the fleet says, the turn is done), and what the turn did is pushed at its end
        self._store = turn.health.store if hasattr(turn.health.store, "sync") else None
        self._profiles = tuple({e.profile: None for e in turn.plan.entries})

    async def _sync_health(self, *, read: bool = True) -> None:
        store = self._store
        if store is not None and (read or store.pending):
            await store.sync(self._profiles if read else ())

    async def run(self, sink: Sink = _discard) -> TurnResult:
        turn = self.turn
        try:
            await self._sync_health()
            action = turn.start(trio.current_time())
            while not isinstance(action, Finish):
                if isinstance(action, Sleep):
                    await trio.sleep(action.seconds)
                    await self._sync_health()
                    action = turn.on_timer(trio.current_time())
                elif action.mode == "stream":
                    action = await self._stream(action, sink)
                else:
                    action = await self._complete(action)
            self.result = action.result
            await self._sync_health(read=False)
            for event in action.deliver:
                await sink(event)
            return self.result
        except trio.Cancelled:
            if self.result is None:
                self.result = turn.cancel(trio.current_time()).result
                with trio.CancelScope(shield=True):  # a held probe goes back to the fleet
                    await self._sync_health(read=False)
            raise

    # -- one call -----------------------------------------------------------------------------

    def _request(self, call: Call) -> CallRequest:
        entry = call.entry
        if call.key_index is not None:
            key = entry.keys[call.key_index]
        else:
            key = entry.keys[0] if entry.keys else None
        request = self.request
        if call.prefill is not None:
            # the forwarded text as a trailing assistant message, byte for byte
            request = request.with_prefill(call.prefill)
        return CallRequest(entry, entry.model, request, key, call.key_index, call.mode == "stream", call.probe,
                           self.turn.config.gateway.drop_unsupported_params)

    def _client(self, call: Call) -> ProviderClient:
        family = call.entry.provider.family
        try:
            return self.clients[family]
        except KeyError:
            raise RelaylineError(f"no protocol adapter for family {family!r}", reason="config") from None

    async def _complete(self, call: Call):
        turn = self.turn
        headers_s = self.timeouts.headers_s
        try:
            with trio.fail_after(headers_s) if headers_s > 0 else contextlib.nullcontext():
                completion = await self._client(call).complete(self._request(call))
        except trio.TooSlowError:
            completion = fc.timed_out("response headers", headers_s)
        except ProviderFailure as exc:
            completion = exc.failure
        if not (isinstance(completion, Completion) and completion.has_answer):
            await self._sync_health()
        return turn.on_completion(completion, trio.current_time())

    async def _stream(self, call: Call, sink: Sink):
        turn = self.turn
        failure = await self._pump(call, sink)
        if failure is not None:
            await self._sync_health()
        now = trio.current_time()
        if failure is None:
            return turn.stream_done(now)
        if not turn.gate.committed and self.on_draft is not None:
            self.on_draft("")  # a pre-commit fallback replaces the draft
        return turn.stream_failed(failure, now)

    async def _pump(self, call: Call, sink: Sink) -> fc.Failure | None:
        """Open the stream and run its frames through the gate. Returns the failure, or None
        when the completion signal arrived."""
        turn = self.turn
        t = self.timeouts
        async with contextlib.AsyncExitStack() as stack:
            try:
                with trio.move_on_after(t.headers_s if t.headers_s > 0 else math.inf) as headers_scope:
                    frames = await stack.enter_async_context(self._client(call).stream(self._request(call)))
            except ProviderFailure as exc:
                return exc.failure
            if headers_scope.cancelled_caught:
                return fc.timed_out("response headers", t.headers_s)
            turn.stream_headers()
            return await self._frames(frames, sink)

    async def _frames(self, frames, sink: Sink) -> fc.Failure | None:
        """Run the frames through the gate under first_token_s and idle_s.

        Moving a cancel scope's deadline costs more than the rest of a frame's handling, so it
        is re-armed at most every `slack` seconds (a stall is caught between idle_s and idle_s
        + slack). A sink that may block (a consumer reading at its own pace, `may_block`) lifts
        the deadline while it runs: a slow consumer is not a stalled provider."""
        turn = self.turn
        t = self.timeouts
        gate = turn.gate
        opened = trio.current_time()
        first_token_deadline = opened + t.first_token_s if t.first_token_s > 0 else math.inf
        idle = t.idle_s if t.idle_s > 0 else math.inf
        slack = min(0.25, idle / 20)
        lift = getattr(sink, "may_block", True)
        armed_at = opened
        draft: list[str] = []
        with trio.CancelScope(deadline=min(first_token_deadline, opened + idle)) as scope:
            try:
                async for frame in frames:
                    if frame.kind == DONE:
                        return None
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
                    now = trio.current_time()
                    if now - armed_at >= slack:
                        armed_at = now
                        scope.deadline = now + idle if gate.committed else min(first_token_deadline, now + idle)
            except ProviderFailure as exc:
                return exc.failure
        if scope.cancelled_caught:
            if not gate.committed and trio.current_time() >= first_token_deadline:
                return fc.timed_out("decisive frame", t.first_token_s)
            return fc.timed_out("frame (stalled stream)", t.idle_s)
        return fc.truncated()

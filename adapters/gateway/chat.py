"""The chat path: one chat-like request (chat completions, messages, responses, embeddings,
token counts) from its shedding check to its answer.

Chat requests beyond `[gateway] max_in_flight`, or during a drain, are shed with 503 and
Retry-After before their body is read. A named key's request is held to its model allowlist
(403) and its key's and team's limits (429) before any work. The turn runs in the request's own
task, watching for the client going away (a disconnect cancels it: never a provider retry, and
the partial-text rules apply) and for a drain running out of time; its ledger rows are written
before its answer ends. A stream's answer goes out through its `StreamWire`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

import attrs
import trio

from relayline.machines import wire
from relayline.machines.limits import Refusal
from relayline.machines.turn import TurnResult
from relayline.machines.vocab import ErrorReason, Outcome

from ..codecs.dialects import Dialect
from ..driver import TurnRun
from ..providers.http import REQUEST_ID
from ..relay import turns_of
from .bookkeeping import Bookkeeping, attribution, dropped_header, relayline_field
from .chat_request import Reading, read_request
from .exchange import Exchange, respond, respond_json
from .http11 import Receive, Scope, Send
from .in_flight import Canceller, TurnsInFlight
from .limits import Admitted, Limiter, refusal_headers
from .stream_wire import GateTimer, StreamWire

if TYPE_CHECKING:
    from .metrics import Metrics


class ChatPath:
    """Serves the chat routes of one gateway: `serve` answers one request."""

    def __init__(self, now: Reading, turns: TurnsInFlight, limiter: Limiter, metrics: Metrics,
                 books: Bookkeeping) -> None:
        self.now = now  # the gateway as it is now: a reload swaps its relay, access and settings
        self.turns = turns
        self.limiter = limiter
        self.metrics = metrics
        self.books = books
        self.gates = GateTimer()  # every held stream's gate_commit_s

    async def serve(self, exchange: Exchange, dialect: Dialect, scope: Scope,
                    receive: Receive) -> None:
        """Run a chat request unless the gateway is full or draining: then 503 with Retry-After,
        before its body is read (load shedding costs next to nothing)."""
        turns = self.turns
        why = turns.shed(self.now.settings.max_in_flight)
        if why is not None:
            status, body = _unavailable(dialect, f"{why}: retry shortly")
            await respond(exchange, status, body, headers=[(b"retry-after", b"1")]
                          + ([(b"connection", b"close")] if turns.draining else []))
            return
        turns.enter()
        try:
            request = await read_request(self.now, dialect, scope, receive, exchange)
            del scope  # (read: a stream's frames need not keep it)
            if request is None or not await self._allowed(exchange, dialect, request):
                return
            if not await self._admitted(exchange, dialect, request):
                return
            turn_id = dialect.new_id()
            if request.stream:
                stream = StreamWire(turn_id, exchange, dialect, request)
                result = await self._run_turn(exchange, turn_id, receive, request, stream)
                await stream.settled()  # a commit the gate timer began is written whole first
            else:
                result = await self._run_turn(exchange, turn_id, receive, request)
            if result is not None and exchange.drained:
                result = _shut_down(result)
            elif result is None or result.outcome == "cancelled":
                return  # the client went away
            if request.stream and (stream.started or result.outcome == "ok"):
                await stream.finish(result, relayline_field(result))
            elif result.outcome != "ok":
                # a stream that sent nothing: a failure before commit still gets a real status and
                # body
                await _error_response(exchange, dialect, result)
            else:
                await respond_json(
                    exchange,
                    200,
                    dialect.completion(turn_id, result, relayline_field(result), request),
                    headers=attribution(result) + dropped_header(request, result.served),
                )
        finally:
            if exchange.admission is not None:
                # what the turn billed counts, whoever went away
                with trio.CancelScope(shield=True):
                    await self.limiter.settle(exchange.admission, exchange.result)
            turns.leave()

    async def _admitted(self, exchange: Exchange, dialect: Dialect, request: wire.Request) -> bool:
        """The one admission point of every chat-like request: a named key's request within its
        key's and team's limits goes on (counted); one over them is a 429 in the dialect's shape,
        and nothing is sent upstream or billed."""
        who = exchange.caller
        if who is None or not who.name:
            return True
        decision = await self.limiter.admit(self.now.relay.config, who.name, request)
        if decision is None or isinstance(decision, Admitted):
            exchange.admission = decision
            if decision is not None:
                self.metrics.key_decision(who.name, "admitted")
            return True
        self.metrics.key_decision(
            who.name, "budget_exceeded" if decision.limit == "budget" else "rate_limited"
        )
        await _refuse(exchange, dialect, decision)
        return False

    async def _allowed(self, exchange: Exchange, dialect: Dialect, request: wire.Request) -> bool:
        """A named key with a model allowlist may name only those models (a route hint given as
        `hint:NAME` is its NAME): anything else is a 403 that names the model, before any work."""
        who = exchange.caller
        if who is None or who.models is None:
            return True
        model = request.model or ""
        if who.may_use(model.removeprefix("hint:")):
            return True
        allowed = ", ".join(sorted(who.models))
        self.metrics.key_decision(who.name, "forbidden")
        await respond(exchange, 403, dialect.http_error(
            403, f"the key {who.name!r} may not use model {model[:200]!r} (it may use: {allowed})",
            "model_not_allowed"))
        return False

    async def _run_turn(self, exchange: Exchange, turn_id: str, receive: Receive,
                        request: wire.Request,
                        stream: StreamWire | None = None) -> TurnResult | None:
        """Run one turn while watching for the client going away (a disconnect cancels it) and
        for a drain running out of time, then write its ledger rows (before any response ends;
        the rest of its bookkeeping waits for the answer: `Bookkeeping.after`). The run is driven
        here, in the request's own task and with the run's own cancel scope alone where the
        server calls back on a hang-up: a held stream keeps every coroutine frame of its path
        (docs/performance-history.md, "Memory per held stream")."""
        started = trio.current_time()
        REQUEST_ID.set(exchange.request_id)  # sent upstream as x-request-id
        relay = self.now.relay  # the turn runs on this one to its end, whatever a reload does
        turns = self.turns
        turns.on(relay)
        run: TurnRun | None = None
        owner: Canceller | None = None
        try:
            run = turns_of(relay).new_run(request, model=request.model, stream=stream is not None,
                                          gateway=True)
            # the server's call-back on a hang-up cancels the run itself; else a task watches
            hangup = exchange.hangup
            watching: AbstractAsyncContextManager[trio.CancelScope | None] = (
                contextlib.nullcontext() if hangup is not None else _watching(receive))
            async with watching as turn_scope:
                owner = run if turn_scope is None else turn_scope
                if stream is not None:  # a hang-up or a drain also cuts short a write in progress
                    stream.bind(run, owner.cancel)
                    owner = stream
                    # the gate holds from the request's start, and only once the run exists: the
                    # `finally` below, before any await, is the one place it is let go
                    gate_s = relay.config.timeouts.gate_commit_s
                    if gate_s > 0:
                        self.gates.hold(stream, started + gate_s)
                try:
                    turns.admit(owner)
                    if hangup is not None:
                        hangup(owner.cancel)
                    await (run.run() if stream is None else run.run(stream))
                except Exception:
                    if run.result is None:
                        raise
                    # the driver settled the turn (outcome error, reason internal) and logged it:
                    # it is answered and accounted like any failed turn
                finally:
                    if stream is not None:
                        # the run is over: the gate timer may no longer commit the held headers
                        # (while the turn is accounted below: a ledger commit takes its time),
                        # the result decides what the answer is
                        stream.ending()
        finally:
            turns.forget(owner)
            # retired by a reload: its last turn ended
            if turns.off(relay) and relay is not self.now.relay:
                with trio.CancelScope(shield=True):
                    await relay.aclose()
            # whatever raised (relayline's own bug), a turn that has a result is accounted: its
            # ledger rows are what the providers will bill
            result = run.result if run is not None else None
            if result is not None:
                exchange.result, exchange.turn, exchange.relay = result, turn_id, relay
                exchange.turn_started, exchange.turn_ended = started, trio.current_time()
                await self.books.record(exchange, turn_id, result)
        exchange.drained = turns.drained(owner)
        return run.result


@contextlib.asynccontextmanager
async def _watching(receive: Receive) -> AsyncIterator[trio.CancelScope]:
    """For a server that does not call back on a hang-up: a scope around the turn, and a task of
    its own that cancels it when the client disconnects."""
    with trio.CancelScope() as turn_scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, turn_scope)
            try:
                yield turn_scope
            finally:
                nursery.cancel_scope.cancel()


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def _refuse(exchange: Exchange, dialect: Dialect, refusal: Refusal) -> None:
    await respond(exchange, 429, dialect.http_error(429, refusal.message, refusal.code),
                  headers=refusal_headers(refusal))


async def _error_response(send: Send, dialect: Dialect, result: TurnResult) -> None:
    status, body = dialect.error(result)
    headers = attribution(result)
    if result.error == "shutdown":
        headers.append((b"retry-after", b"1"))
    if result.attempts:
        # relayline already spent its own retries on this turn: an SDK's would multiply them
        headers.append((b"x-should-retry", b"false"))
    await respond(send, status, body, headers=headers)


def _shut_down(result: TurnResult) -> TurnResult:
    """A turn the drain cancelled: said as such to its client, never as a client disconnect."""
    return attrs.evolve(result, outcome=Outcome.ERROR, error=ErrorReason.SHUTDOWN,
                        message="the gateway is shutting down: this turn was cancelled before it "
                                "finished")


def _unavailable(dialect: Dialect, message: str) -> tuple[int, bytes]:
    return 503, dialect.http_error(503, message, "overloaded")

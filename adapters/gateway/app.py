"""The OpenAI-compatible gateway: a plain ASGI app run by hypercorn's trio worker.

The stream commit boundary reaches the wire here. A streamed request sends nothing, not even
response headers, until the turn commits (its first decisive frame), so a turn that fails or
recovers before commit can still answer with a proper status code and a clean body. After
`timeouts.gate_commit_s` with nothing decisive, the held headers and role frame are committed
anyway (a slow model is not an error). After commit, a failure ends the stream with an explicit
error event and no `[DONE]`, never a clean-looking truncated success. A client that goes away
cancels the turn: never a provider retry, and the partial-text rules apply.

Endpoints: POST /v1/chat/completions, GET /v1/models, GET /admin/plan, GET /admin/health,
GET /metrics. Attribution rides on x-relayline-* headers and a `relayline` field in bodies.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import time
from collections import defaultdict, deque
from functools import partial
from urllib.parse import parse_qs

import trio

from relayline.machines import wire
from relayline.machines.stream import Event
from relayline.machines.turn import TurnResult

from ..driver import TurnRun
from ..relay import Relay
from ..stores.ledger import LedgerStore, open_ledger
from .console import Console
from .dialects import ANTHROPIC, OPENAI

log = logging.getLogger("relayline.gateway")

SEND_GRACE_S = 10.0
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
class Metrics:
    """Prometheus text exposition, kept as plain counters (no client library needed)."""

    def __init__(self) -> None:
        self.attempts: dict[tuple[str, str], int] = defaultdict(int)
        self.turns: dict[str, int] = defaultdict(int)
        self.fallbacks = 0
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0

    def observe(self, result: TurnResult, seconds: float) -> None:
        self.turns[result.outcome] += 1
        self.fallbacks += int(result.fallback)
        for attempt in result.attempts:
            self.attempts[(attempt.provider, attempt.outcome)] += 1
        self.latency_sum += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.latency_counts[i] += 1
                break
        else:
            self.latency_counts[-1] += 1

    def render(self, relay: Relay) -> str:
        lines = ["# HELP relayline_attempts_total Provider attempts by profile and outcome.",
                 "# TYPE relayline_attempts_total counter"]
        for (provider, outcome), n in sorted(self.attempts.items()):
            lines.append(f'relayline_attempts_total{{provider="{provider}",outcome="{outcome}"}} {n}')
        lines += ["# HELP relayline_turns_total Turns by outcome.", "# TYPE relayline_turns_total counter"]
        for outcome, n in sorted(self.turns.items()):
            lines.append(f'relayline_turns_total{{outcome="{outcome}"}} {n}')
        lines += ["# HELP relayline_fallbacks_total Turns answered by a fallback entry.",
                  "# TYPE relayline_fallbacks_total counter", f"relayline_fallbacks_total {self.fallbacks}"]
        lines += ["# HELP relayline_breaker_transitions_total Breaker state changes by profile.",
                  "# TYPE relayline_breaker_transitions_total counter"]
        for alias in sorted(relay.config.providers):
            lines.append(f'relayline_breaker_transitions_total{{provider="{alias}"}} '
                         f'{relay.health.breaker(alias).transitions}')
        lines += ["# HELP relayline_turn_seconds Turn latency.", "# TYPE relayline_turn_seconds histogram"]
        cumulative = 0
        for bound, n in zip(LATENCY_BUCKETS, self.latency_counts, strict=False):
            cumulative += n
            lines.append(f'relayline_turn_seconds_bucket{{le="{bound}"}} {cumulative}')
        cumulative += self.latency_counts[-1]
        lines.append(f'relayline_turn_seconds_bucket{{le="+Inf"}} {cumulative}')
        lines.append(f"relayline_turn_seconds_sum {self.latency_sum:.6f}")
        lines.append(f"relayline_turn_seconds_count {cumulative}")
        return "\n".join(lines) + "\n"


class Gateway:
    def __init__(self, relay: Relay, *, api_keys: set[str] | None = None, ledger: LedgerStore | None = None) -> None:
        self.relay = relay
        self.api_keys = {k for k in (api_keys or ()) if k}
        self.ledger = ledger
        self.metrics = Metrics()
        self.max_body = relay.config.gateway.max_body_bytes
        self._outcomes: dict[str, deque[tuple[float, bool]]] = defaultdict(deque)
        self.console = Console(self)

    @classmethod
    def from_relay_config(cls, relay: Relay, env=None) -> Gateway:
        env = os.environ if env is None else env
        cfg = relay.config
        keys = set()
        if cfg.gateway.api_keys_env:
            keys = {k.strip() for k in env.get(cfg.gateway.api_keys_env, "").split(",") if k.strip()}
        return cls(relay, api_keys=keys, ledger=open_ledger(cfg.ledger))

    # -- ASGI -----------------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        # every answer on the Anthropic route speaks Anthropic, errors included (CONFIG.md "The wire")
        dialect = ANTHROPIC if path.startswith("/v1/messages") else OPENAI
        if path == "/metrics" and method == "GET":
            if await self._authorised(scope, send, dialect):
                await self._respond(send, 200, self.metrics.render(self.relay).encode(),
                                    content_type="text/plain; version=0.0.4")
            return
        if not await self._authorised(scope, send, dialect):
            return
        if path == "/v1/chat/completions" and method == "POST":
            await self._chat(OPENAI, scope, receive, send)
        elif path == "/v1/messages" and method == "POST":
            await self._chat(ANTHROPIC, scope, receive, send)
        elif path == "/v1/models" and method == "GET":
            await self._json(send, 200, self._models())
        elif path == "/admin/plan" and method == "GET":
            query = parse_qs(scope.get("query_string", b"").decode())
            plan = self.relay.plan(model=query.get("model", [None])[0], text=query.get("text", [""])[0], gateway=True)
            await self._json(send, 200, plan.as_json())
        elif path == "/admin/health" and method == "GET":
            await self._json(send, 200, self.health())
        elif path == "/admin/" or path.startswith("/admin/console/"):
            await self.console.handle(scope, receive, send)
        else:
            await self._respond(send, 404, dialect.http_error(404, f"no route for {method} {path}", "not_found"))

    # -- plumbing -------------------------------------------------------------------------------

    async def _respond(self, send, status: int, body: bytes, *, content_type="application/json", headers=()) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type.encode()), *headers]})
        await send({"type": "http.response.body", "body": body})

    async def _json(self, send, status: int, obj, headers=()) -> None:
        await self._respond(send, status, json.dumps(obj).encode(), headers=headers)

    async def _authorised(self, scope, send, dialect) -> bool:
        if not self.api_keys:
            return True
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"").decode("latin-1")
        token = given[7:] if given.lower().startswith("bearer ") else headers.get(b"x-api-key", b"").decode("latin-1")
        if any(hmac.compare_digest(token.encode(), key.encode()) for key in self.api_keys):
            return True
        await self._respond(send, 401, dialect.http_error(401, "missing or invalid gateway API key", "invalid_api_key"))
        return False

    async def _read_body(self, receive, send, dialect) -> bytes | None:
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body:
                await self._respond(send, 413, dialect.http_error(413, f"request body larger than {self.max_body} bytes",
                                                                  "request_too_large"))
                return None
            if not message.get("more_body"):
                return body

    def _models(self) -> dict:
        created = int(time.time())
        # what clients may name: route hints, catalog models, and the default model
        ids = [*self.relay.router.domains, *self.relay.router.catalog]
        default = self.relay.router.default.entries[0].model if self.relay.router.default.entries else None
        if default and default not in ids:
            ids.append(default)
        return {"object": "list", "data": [{"id": i, "object": "model", "created": created, "owned_by": "relayline"}
                                          for i in ids]}

    def health(self) -> dict:
        now = trio.current_time()
        window = self.relay.config.breaker.window_s
        profiles = {}
        for alias in sorted(self.relay.config.providers):
            breaker = self.relay.health.breaker(alias)
            breaker.refresh(now)
            seen = self._outcomes[alias]
            while seen and seen[0][0] < now - window:
                seen.popleft()
            cooling = self.relay.health.cooldown_until(alias) - now
            profiles[alias] = {
                "breaker": breaker.state,
                "recent_failures": len(breaker.failures),
                "open_for_s": round(max(0.0, breaker.open_until - now), 3) if breaker.state == "open" else 0.0,
                "cooldown_s": round(cooling, 3) if cooling > 0 else 0.0,
                "attempts_in_window": len(seen),
                "success_rate": round(sum(ok for _, ok in seen) / len(seen), 4) if seen else None,
            }
        return {"window_s": window, "profiles": profiles, "fallback_record": dict(self.relay.fallback_record)}

    async def _finish_turn(self, turn_id: str, result: TurnResult, started: float) -> None:
        now = trio.current_time()
        for attempt in result.attempts:
            self._outcomes[attempt.provider].append((now, attempt.outcome == "ok"))
        self.metrics.observe(result, now - started)
        self.console.observe(turn_id, result, now - started)
        if self.ledger is not None and result.ledger:
            await self.ledger.record(turn_id, result)

    def _attribution(self, result: TurnResult) -> list[tuple[bytes, bytes]]:
        return [
            (b"x-relayline-requested", result.requested.encode()),
            (b"x-relayline-served", (result.served.label if result.served else "none").encode()),
            (b"x-relayline-attempts", str(len(result.attempts)).encode()),
            (b"x-relayline-fallback", b"true" if result.fallback else b"false"),
            (b"x-relayline-cost-usd", f"{result.cost_usd:.8f}".encode()),
        ]

    def _relayline_field(self, result: TurnResult) -> dict:
        return {
            "requested": result.requested,
            "served": result.served.label if result.served else None,
            "fallback": result.fallback,
            "notice": result.notice,
            "cost_usd": result.cost_usd,
            "attempts": [str(a) for a in result.attempts],
            "skipped": [str(s) for s in result.skipped],
        }

    # -- chat completions -----------------------------------------------------------------------

    async def _chat(self, dialect, scope, receive, send) -> None:
        raw = await self._read_body(receive, send, dialect)
        if raw is None:
            return
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = wire.WireError("", "the body is not valid JSON")
        try:
            if isinstance(body, wire.WireError):
                raise body
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers") or ()]
            request = dialect.parse(body, headers)
        except wire.WireError as error:
            status, body = dialect.bad_request(error)
            await self._respond(send, status, body)
            return
        except RecursionError:
            status, body = dialect.bad_request(wire.WireError("", "the body is nested too deeply"))
            await self._respond(send, status, body)
            return
        turn_id = dialect.new_id()
        kwargs = dict(messages=request, model=request.model)
        if request.stream:
            runs: list[TurnRun] = []
            stream = _StreamWire(turn_id, send, runs, dialect, request)
            gate_s = self.relay.config.timeouts.gate_commit_s
            tasks = [stream.flusher] + ([partial(stream.commit_after, gate_s)] if gate_s > 0 else [])
            result = await self._run_turn(turn_id, receive, runs, tasks, stream=True, sink=stream.event, **kwargs)
            if result is None or result.outcome == "cancelled":
                return  # the client went away
            if not stream.started and result.outcome != "ok":
                # nothing was sent: a failure before commit still gets a real status and body
                await self._error_response(send, dialect, result)
                return
            await stream._start()  # an answer with nothing to show (a refusal) still is a stream
            await stream.finish(result, self._relayline_field(result))
            return
        result = await self._run_turn(turn_id, receive, [], **kwargs)
        if result is None or result.outcome == "cancelled":
            return  # the client went away
        if result.outcome != "ok":
            await self._error_response(send, dialect, result)
            return
        await self._json(send, 200, dialect.completion(turn_id, result, self._relayline_field(result)),
                         headers=self._attribution(result) + dropped_header(request, result.served))

    async def _run_turn(self, turn_id: str, receive, runs: list[TurnRun], tasks=(), **kwargs) -> TurnResult | None:
        """Run one turn while watching for the client going away (a disconnect cancels it),
        then account for it: metrics, health view, ledger rows (before any response ends)."""
        started = trio.current_time()
        with trio.CancelScope() as turn_scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, turn_scope)
                for task in tasks:
                    nursery.start_soon(task)
                try:
                    await self.relay._run_turn(gateway=True, run_hook=runs.append, **kwargs)
                finally:
                    nursery.cancel_scope.cancel()
        result = runs[0].result if runs else None
        if result is not None:
            await self._finish_turn(turn_id, result, started)
        return result

    async def _error_response(self, send, dialect, result: TurnResult) -> None:
        status, body = dialect.error(result)
        headers = self._attribution(result)
        if result.attempts:
            # relayline already spent its own retries on this turn: an SDK's would multiply them
            headers.append((b"x-should-retry", b"false"))
        await self._respond(send, status, body, headers=headers)

    async def _watch_disconnect(self, receive, scope: trio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                scope.cancel()
                return

def dropped_header(request: wire.Request, entry) -> list[tuple[bytes, bytes]]:
    """x-relayline-dropped: the fields `drop_unsupported_params` dropped for the serving entry."""
    if entry is None or request is None:
        return []
    provider = entry.provider
    dropped = wire.unsupported(request, provider.family, provider.capabilities)
    return [(b"x-relayline-dropped", ", ".join(dropped).encode())] if dropped else []


class _StreamWire:
    """One streamed response: held headers, the commit, and a bounded write buffer.

    The dialect renders; the wire decides when bytes go out. Events are rendered into a pending
    buffer and a flusher task writes whatever has gathered in one ASGI send: frames that arrive
    together leave together, and an idle stream still sends each frame at once. Past
    MAX_PENDING the turn waits for the flusher.
    """

    MAX_PENDING = 256 * 1024

    def __init__(self, turn_id: str, send, runs: list[TurnRun], dialect, request: wire.Request) -> None:
        self.send = send
        self.runs = runs
        self.request = request
        self.render = dialect.stream_renderer(turn_id, request)
        self.started = False
        self._lock = trio.Lock()  # the gate timer, the flusher and the end all write: keep the wire ordered
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._wake = trio.Event()
        self._room = trio.Event()

    def _served_entry(self):
        run = self.runs[0] if self.runs else None
        if run is None:
            return None
        if run.result is not None and run.result.served is not None:
            return run.result.served
        return run.turn.call.entry if run.turn.call is not None else None

    async def _send_whole(self, message: dict) -> None:
        # the turn's end cancels the flusher and the gate timer: a write they began must finish
        # (bytes taken from the buffer would otherwise be lost), bounded in case the peer is stuck
        with trio.move_on_after(SEND_GRACE_S) as scope:
            scope.shield = True
            await self.send(message)

    async def _start(self) -> None:
        if self.started:
            return
        async with self._lock:
            if self.started:
                return
            self.started = True
            entry = self._served_entry()
            run = self.runs[0] if self.runs else None
            headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                       (b"x-relayline-served", (entry.label if entry else "none").encode())]
            if run is not None:
                headers.append((b"x-relayline-requested", run.turn.plan.requested.encode()))
                headers.append((b"x-relayline-attempts", str(len(run.turn.attempts) + 1).encode()))
            headers += dropped_header(self.request, entry)
            await self._send_whole({"type": "http.response.start", "status": 200, "headers": headers})
        gate = self.runs[0].turn.gate if self.runs else None
        await self._queue(self.render.opening(entry.model if entry is not None else "",
                                              gate.usage if gate is not None else None))

    async def commit_after(self, seconds: float) -> None:
        await trio.sleep(seconds)
        await self._start()  # a slow model is not an error: the held headers and preamble go out

    async def _queue(self, data: bytes) -> None:
        if not data:
            return
        self._pending.append(data)
        self._pending_bytes += len(data)
        self._wake.set()
        while self._pending_bytes > self.MAX_PENDING:
            self._room = trio.Event()
            await self._room.wait()

    async def flusher(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            async with self._lock:
                while self._pending:
                    data = b"".join(self._pending)
                    self._pending.clear()
                    self._pending_bytes = 0
                    await self._send_whole({"type": "http.response.body", "body": data, "more_body": True})
                self._room.set()

    async def event(self, event: Event) -> None:
        if not event.visible:
            return  # held protocol frames: the dialect's preamble is rendered at commit
        first = not self.started
        await self._start()
        await self._queue(self.render.event(event))
        if first:
            await trio.lowlevel.checkpoint()  # let the flusher put the first bytes on the wire now

    event.may_block = False  # bounded buffer: it waits only for the flusher, never for the client

    async def finish(self, result: TurnResult, relayline: dict) -> None:
        """The end of the response; whatever the flusher had not sent yet goes first."""
        body = self.render.ok(result, relayline) if result.outcome == "ok" else self.render.failed(result, relayline)
        async with self._lock:
            body = b"".join(self._pending) + body
            self._pending.clear()
            await self.send({"type": "http.response.body", "body": body, "more_body": False})


async def serve(gateway: Gateway, *, host: str = "127.0.0.1", port: int = 8080,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run the gateway on hypercorn's trio worker until cancelled. Reports the bound URLs."""
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve as hypercorn_serve

    config = HypercornConfig()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.keep_alive_timeout = 75
    config.backlog = 2048  # bursts of new connections must queue, not be refused
    connected = getattr(gateway.relay.health, "connected", None)
    async with connected() if connected is not None else contextlib.nullcontext():
        await hypercorn_serve(gateway, config, task_status=task_status)

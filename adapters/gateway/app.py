"""The OpenAI-compatible gateway: a plain ASGI app, served by the HTTP/1.1 server in http11.py.

The stream commit boundary reaches the wire here. A streamed request sends nothing, not even
response headers, until the turn commits (its first decisive frame), so a turn that fails or
recovers before commit can still answer with a proper status code and a clean body. After
`timeouts.gate_commit_s` with nothing decisive, the held headers and role frame are committed
anyway (a slow model is not an error). After commit, a failure ends the stream with an explicit
error event and no `[DONE]`, never a clean-looking truncated success. A client that goes away
cancels the turn: never a provider retry, and the partial-text rules apply.

Endpoints: POST /v1/chat/completions, POST /v1/messages, POST /v1/responses, POST /v1/embeddings,
POST /v1/messages/count_tokens, GET /v1/models (client keys);
GET /admin/plan, GET /admin/health, GET /metrics (admin keys, auth.py); GET /healthz, GET /readyz
(no key: probes). Attribution rides on x-relayline-* headers and a `relayline` field in bodies.

Operating it: one access line per request (logger relayline.access), a request id accepted or
made, echoed and sent upstream; chat requests beyond `[gateway] max_in_flight`, or during a
drain, are shed with 503 and Retry-After before their body is read; a body slower than
`body_timeout_s` is a 408. `drain()` is what SIGTERM runs (server.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import heapq
import itertools
import json
import logging
import os
import re
import sqlite3
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs

import attrs
import trio

from relayline.machines import wire
from relayline.machines.errors import ConfigError
from relayline.machines.limits import Refusal
from relayline.machines.plan import model_offered
from relayline.machines.stream import Event
from relayline.machines.turn import TurnResult
from relayline.machines.vocab import FailureClass, Mode

from .. import jsoncodec
from ..codecs.dialects import ANTHROPIC, COUNT_TOKENS, EMBEDDINGS, OPENAI, RESPONSES
from ..driver import TurnRun
from ..logs import event
from ..otel import Tracing
from ..providers.base import TRAVELLING
from ..providers.http import REQUEST_ID
from ..relay import Relay
from ..stores.ledger import DEFAULT_PATH, LedgerStore, LedgerUnavailable, open_ledger
from .auth import (
    CREDENTIAL_HEADERS,
    Access,
    Caller,
    KeyRing,
    bearer,
    credential_header,
    is_loopback,
    load_access,
)
from .console import Console
from .limits import Admitted, Limiter, refusal_headers
from .metrics import CONTENT_TYPE, Metrics, configured_models, named_keys

log = logging.getLogger("relayline.gateway")
access_log = logging.getLogger("relayline.access")

SEND_GRACE_S = 10.0
REQUEST_ID_SHAPE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
QUIET_ERRORS = {"client_error", "context_window"}  # the client's own doing: the access line says enough
MAX_OUTCOMES = 4096  # per profile, for /admin/health's success rate: bounded between reads
READY_WAIT_S = 2.0  # a readiness check of the ledger that takes longer says not ready


TRIM_AFTER_BYTES = 8 * 1024 * 1024  # an answer at least this large is followed by a malloc_trim


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _read_too_much(result: TurnResult | None) -> bool:
    """A body refused as too_large was read up to limits.max_response_bytes first: its heap
    is handed back like a large answer's (bench/memory.py: without it, +34 MiB stay after a
    100 MiB reply refused, once an earlier large answer raised glibc's mmap threshold)."""
    return result is not None and any(FailureClass.TOO_LARGE in (a.outcome, a.reason) for a in result.attempts)


class Exchange:
    """One HTTP request as the access line and the metrics see it: a wrapper around ASGI `send`
    that notes the status and the first body byte, and echoes the request id. An answer sent
    before the request's body was read (401, 503 shed, 413, 408) says `connection: close`: the
    server will not serve that body, so the client must not reuse the connection. It first drains
    a small body, bounded in bytes and time: a socket closed with unread input is reset, and the
    reset can destroy the answer before the client has read it."""

    DRAIN_BYTES = 64 * 1024
    DRAIN_S = 0.5

    __slots__ = ("send", "dialect", "method", "path", "request_id", "started", "status", "first_byte", "result", "client",
                 "drained", "turn", "unread_body", "receive", "sent", "declared_length", "hangup",
                 "body_here", "relay", "turn_started", "turn_ended", "query", "caller", "admission")

    def __init__(self, send, method: str, path: str, request_id: str, headers: dict[bytes, bytes],
                 receive=None, query: bytes = b"") -> None:
        self.send = send
        self.query = query  # the URL's query, shown in the access line
        length = headers.get(b"content-length", b"0").partition(b",")[0].strip()  # the server checked its shape
        self.declared_length = int(length) if length.isdigit() else 0
        self.unread_body = self.declared_length > 0 or b"transfer-encoding" in headers
        # a client waiting for 100-continue has sent no body: an early answer reads none of it
        self.receive = None if headers.get(b"expect", b"").lower() == b"100-continue" else receive
        # every answer on the Anthropic route speaks Anthropic, errors included (docs/wire.md)
        # and GET /v1/models answers an Anthropic client (it sends anthropic-version) in Anthropic's list shape
        self.dialect = ANTHROPIC if path.startswith("/v1/messages") or (
            path == "/v1/models" and b"anthropic-version" in headers) else OPENAI
        self.method = method
        self.path = path
        self.request_id = request_id
        self.started = trio.current_time()
        self.status: int | None = None
        self.first_byte: float | None = None
        self.sent = 0  # response body bytes
        self.result: TurnResult | None = None
        # the relay the turn ran on and the turn's start and end (trio's clock): what is observed
        # of it once the answer is out (`Gateway._observe_turn`)
        self.relay: Relay | None = None
        self.turn_started = self.turn_ended = 0.0
        self.client = ""
        self.caller: Caller | None = None  # who the client key says the caller is
        self.admission = None  # the turn's admission against its key's and team's limits (limits.py)
        self.drained = False
        self.turn: str | None = None
        # the server's call-back when the client hangs up (http11.py), where it offers one
        self.hangup: Callable[[Callable[[], None]], None] | None = None
        # the server's word that the whole request body has arrived (http11.py), where it offers it
        self.body_here: Callable[[], bool] | None = None

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            headers = [*message.get("headers", ()), (b"x-request-id", self.request_id.encode())]
            if self.admission is not None:  # the key's remaining limits, on every admitted answer
                headers += self.admission.headers()
            if self.unread_body and self.status != 408:
                await self._drain()
            if self.unread_body and not any(k == b"connection" for k, _ in headers):
                headers.append((b"connection", b"close"))
            message = {**message, "headers": headers}
        elif body := message.get("body"):
            self.sent += len(body)
            if self.first_byte is None:
                self.first_byte = trio.current_time()
        await self.send(message)

    async def _drain(self) -> None:
        """Read and discard what is left of a small request body, bounded in bytes and time."""
        if self.receive is None:
            return
        seen = 0
        with trio.move_on_after(self.DRAIN_S):
            while seen <= self.DRAIN_BYTES:
                message = await self.receive()
                if message["type"] != "http.request":
                    return
                seen += len(message.get("body", b""))
                if not message.get("more_body"):
                    return


def request_id(headers: dict[bytes, bytes]) -> str:
    """The client's x-request-id when it is a plain token, else a new one: it is echoed, logged
    and sent upstream, so nothing a client sends reaches a log or a header unchecked."""
    given = headers.get(b"x-request-id")
    if given is not None:  # (most clients send none: no decode and no match for them)
        text = given.decode("latin-1")
        if REQUEST_ID_SHAPE.match(text):
            return text
    return os.urandom(16).hex()


def _repeated_credential(headers) -> str | None:
    """The credential header a request carries more than once, if any: which of two keys
    authenticates it is no guess to make (proxies in front may each read another one)."""
    seen = set()
    for name, _ in headers:
        if name in (b"authorization", b"x-api-key"):
            if name in seen:
                return name.decode()
            seen.add(name)
    return None


def travelling_headers(config) -> frozenset[bytes]:
    """The client request header names some entry may be sent (providers/base.py): the families'
    own and every profile's `forward_headers`. Only these are decoded for a chat request."""
    named = {name.lower() for p in config.providers.values() for name in p.forward_headers}
    return frozenset(name.encode("latin-1") for name in TRAVELLING | named)


_CHAT_DIALECTS = {"/v1/chat/completions": OPENAI, "/v1/messages": ANTHROPIC, "/v1/responses": RESPONSES,
                  "/v1/embeddings": EMBEDDINGS, "/v1/messages/count_tokens": COUNT_TOKENS}

# the methods of each route, for a 405's Allow header (a HEAD is answered wherever a GET is)
ALLOWED = {path: b"POST" for path in (*_CHAT_DIALECTS, "/admin/reload")} | \
    {path: b"GET, HEAD" for path in ("/v1/models", "/admin/plan", "/admin/health", "/metrics", "/healthz", "/readyz")}


class Gateway:
    ROUTES = frozenset(ALLOWED)

    def __init__(self, relay: Relay, *, api_keys: set[str] | None = None, ledger: LedgerStore | None = None,
                 access: Access | None = None) -> None:
        self.relay = relay
        self.access = access if access is not None else Access(clients=KeyRing.of(api_keys or ()))
        self.ledger = ledger
        if isinstance(ledger, LedgerStore):
            # turns finishing together share a commit; a turn alone is committed at once
            ledger.together = lambda: self.in_flight > 1
        self.settings = relay.config.gateway
        self.metrics = Metrics(relay.config, self.ROUTES, self._live)
        self.tracing = Tracing()  # OpenTelemetry spans when relayline[otel] is installed
        self._families = {alias: p.family for alias, p in relay.config.providers.items()}
        self._travelling = travelling_headers(relay.config)
        self.max_body = self.settings.max_body_bytes
        self._outcomes: dict[str, deque[tuple[float, bool]]] = defaultdict(deque)
        self._breakers: dict[str, str] = {}
        # readiness checks beyond "config loaded": name -> callable answering an error or None
        self.readiness: dict[str, Callable[[], Awaitable[str | None]]] = {}
        # what /readyz reports without failing it: the gateway serves without it. A shared health
        # store is one: when it is down each worker serves on local health (docs/gateway.md), and a
        # 503 from every worker at once would have the load balancer take the whole fleet out
        # for an outage the fleet rides through
        self.degradations: dict[str, Callable[[], Awaitable[str | None]]] = {}
        if ledger is not None:
            self.readiness["ledger"] = self._ledger_ready
            self._ready_limiter = trio.CapacityLimiter(1)
        if hasattr(relay.health, "reachable"):  # a shared health store (stores/health.py)
            self.degradations["shared_store"] = self._store_ready
        self.in_flight = 0
        self.draining = False
        self._trimming = False
        # what cancels each turn in flight: its run, its stream's wire, or the scope around it
        self._turns: set[TurnRun | _StreamWire | trio.CancelScope] = set()
        self._cancelled_by_drain: set[TurnRun | _StreamWire | trio.CancelScope] = set()
        self._gates = _GateTimer()  # every held stream's gate_commit_s
        self._cut = False  # the drain ran out of time: a turn that starts now is cancelled at once
        self._idle = trio.Event()
        self._idle.set()
        self.reloader = None  # a Reloader (gateway/reload.py) when serving from a config file
        self._turns_of: dict[Relay, int] = {}  # turns in flight per relay (a reload retires one)
        self.console = Console(self)
        # named keys' limits, counted in the shared store when there is one; `workers` is the
        # fleet's size when `serve --workers N` started this process (a worker's share of a limit)
        self.limiter = Limiter(relay.health, ledger)

    async def swap(self, relay: Relay, access: Access) -> None:
        """A reload (checked: reload.py): new turns use `relay` and `access`; turns in flight
        finish on the relay they started with, which is closed when its last turn ends."""
        old, self.relay = self.relay, relay
        self.access = access
        self.settings = relay.config.gateway
        self.max_body = self.settings.max_body_bytes
        self._travelling = travelling_headers(relay.config)
        self.metrics.providers = frozenset(relay.config.providers)
        self.metrics.models = configured_models(relay.config)
        self.metrics.keys = named_keys(relay.config)
        if old is not relay and not self._turns_of.get(old):
            await old.aclose()

    @classmethod
    def from_relay_config(cls, relay: Relay, env=None) -> Gateway:
        """The gateway a config describes. Raises ConfigError when a key variable it names is
        unset or empty (fail closed), or the ledger cannot be opened."""
        env = os.environ if env is None else env
        cfg = relay.config
        access = load_access(cfg, env)
        try:
            ledger = open_ledger(cfg.ledger)
        except (OSError, sqlite3.Error, RuntimeError) as exc:
            where = "ledger.url" if cfg.ledger.url else "ledger.path"
            raise ConfigError([str(exc) if isinstance(exc, RuntimeError) else f"{where}: cannot open "
                               f"{cfg.ledger.path or DEFAULT_PATH}: {exc}"]) from None
        return cls(relay, ledger=ledger, access=access)

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
        headers = dict(scope.get("headers") or [])
        exchange = Exchange(send, scope["method"], scope["path"], request_id(headers), headers, receive,
                            scope.get("query_string") or b"")
        extensions = scope.get("extensions")
        if extensions:
            exchange.hangup = extensions.get("relayline.hangup")
            exchange.body_here = extensions.get("relayline.body_here")
        try:
            route = self._route(exchange, scope, headers, receive)
            del scope, headers  # (a frame's locals live as long as its request: a stream's whole life)
            await route
        except Exception:
            # relayline's own bug: logged once with its stack; the client gets a JSON 500, never
            # an empty body (after the headers went out, the connection is all that is left)
            log.exception("gateway_internal_error request_id=%s path=%s", exchange.request_id, exchange.path[:200])
            if exchange.status is None:
                await self._respond(exchange, 500, exchange.dialect.http_error(
                    500, "internal error in the gateway (logged)", "internal_error"))
        finally:
            self._after(exchange)
        if exchange.sent >= TRIM_AFTER_BYTES or _read_too_much(exchange.result):
            exchange.result = None  # the answer's text is freed before the trim
            await self._give_back_memory()

    async def _give_back_memory(self) -> None:
        """Hand the C heap's free pages back to the OS after a large answer. A large stream's
        64 KiB frames are freed between long-lived small objects, so glibc cannot shrink its heap
        from the top and RSS would stay at its peak for good (bench/memory.py: +66 MiB after a
        32 MiB stream); malloc_trim releases every free page. It takes a few ms on a large heap:
        in a worker thread, one at a time."""
        trim = _malloc_trim()
        if trim is None or self._trimming:
            return
        self._trimming = True
        try:
            await trio.to_thread.run_sync(trim, 0)
        finally:
            self._trimming = False

    async def _route(self, exchange: Exchange, scope, headers, receive) -> None:
        method, path, send = exchange.method, exchange.path, exchange
        method = "GET" if method == "HEAD" else method  # a HEAD is a GET whose body the server does not send
        # the server bounds a head still arriving; a whole one that came in one read is checked here,
        # where its 431 is in the route's dialect (an Anthropic client's error shape) and has its
        # access line and request id, which the server's own refusal (no route seen) cannot give
        head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + sum(
            len(k) + len(v) + 4 for k, v in scope.get("headers") or ())
        if head > self.settings.max_header_bytes:
            await self._respond(send, 431, send.dialect.http_error(
                431, f"request headers larger than {self.settings.max_header_bytes} bytes", "headers_too_large"),
                headers=[(b"connection", b"close")])
            return
        if len(headers) < len(scope.get("headers") or ()):  # a name came twice (the dict kept one)
            repeated = _repeated_credential(scope["headers"])
            if repeated is not None:
                await self._respond(send, 400, send.dialect.http_error(
                    400, f"more than one {repeated} header: send one credential", "malformed_request"))
                return
        if path == "/healthz" and method == "GET":
            await self._json(send, 200, {"status": "ok"})
            return
        if path == "/readyz" and method == "GET":
            await self._ready(send)
            return
        if path == "/admin":
            # the console's address as people type it: its own page is /admin/ (where a browser
            # without credentials is asked for them)
            query = scope.get("query_string") or b""
            await self._respond(send, 308, b"", content_type="text/plain",
                                headers=[(b"location", b"/admin/" + (b"?" + query if query else b""))])
            return
        if path == "/metrics" or path.startswith("/admin/"):
            if not await self._admin(scope, headers, send):
                return
            if path == "/metrics" and method == "GET":
                await self._respond(send, 200, self.metrics.render(), content_type=CONTENT_TYPE)
            elif path == "/admin/plan" and method == "GET":
                query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
                plan = self.relay.plan(model=query.get("model", [None])[0], text=query.get("text", [""])[0],
                                       gateway=True)
                await self._json(send, 200, plan.as_json())
            elif path == "/admin/health" and method == "GET":
                sync = getattr(self.relay.health, "sync", None)
                if sync is not None:  # a fleet: the shared state, not only this worker's mirror
                    await sync(self.relay.config.providers)
                await self._json(send, 200, self.health())
            elif path == "/admin/reload" and method == "POST":
                await self._reload(send)
            elif path == "/admin/" or path.startswith("/admin/console/"):
                await self.console.handle(scope, receive, send)
            else:
                await self._not_found(send, path)
            return
        if not await self._authorised(exchange, headers):
            return
        del headers
        if method == "POST" and path in _CHAT_DIALECTS:
            chat = self._chat(exchange, _CHAT_DIALECTS[path], scope, receive)
            del scope  # the chat's own frame frees it once the request is read
            await chat
        elif path == "/v1/models" and method == "GET":
            await self._json(send, 200, send.dialect.model_list(self._model_ids(), send.query.decode("latin-1")))
        else:
            await self._not_found(send, path)

    async def _reload(self, send) -> None:
        """POST /admin/reload: 200 with the profiles now served, or 422 listing the problems of a
        file that was refused (nothing changed). In a fleet, a 200 then reloads every worker."""
        if self.reloader is None:
            await self._respond(send, 409, OPENAI.http_error(409, "this gateway serves no config file to reload",
                                                            "no_config_file"))
            return
        report = await self.reloader.reload()
        await self._json(send, 200 if report.ok else 422, report.as_json())
        if report.ok and self.reloader.fleet is not None:
            self.reloader.fleet()  # the other workers take the file as on a SIGHUP to the supervisor

    # -- plumbing -------------------------------------------------------------------------------

    async def _respond(self, send, status: int, body: bytes, *, content_type="application/json", headers=()) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type.encode()), *headers]})
        await send({"type": "http.response.body", "body": body})

    async def _json(self, send, status: int, obj, headers=()) -> None:
        await self._respond(send, status, jsoncodec.dumps(obj), headers=headers)

    async def _not_found(self, send, path: str) -> None:
        allowed = ALLOWED.get(path)
        if allowed is not None:
            await self._respond(send, 405, send.dialect.http_error(
                405, f"{path} answers {allowed.decode()}, not {send.method}", "method_not_allowed"),
                headers=[(b"allow", allowed)])
            return
        await self._respond(send, 404, send.dialect.http_error(404, f"no route for {send.method} {path[:200]}",
                                                               "not_found"))

    async def _unauthorised(self, send, message: str) -> None:
        challenges = [(b"www-authenticate", b"Bearer")]
        if send.path == "/admin/":
            # a browser opening the console asks its user for the key
            challenges.append((b"www-authenticate", b'Basic realm="relayline admin", charset="UTF-8"'))
        await self._respond(send, 401, send.dialect.http_error(401, message, "invalid_api_key"), headers=challenges)

    async def _authorised(self, exchange: Exchange, headers) -> bool:
        if not self.access.clients:
            return True
        who = self.access.clients.caller(bearer(headers))
        if who is not None:
            exchange.client, exchange.caller = who.id, who
            return True
        await self._unauthorised(exchange, "missing or invalid gateway API key")
        return False

    async def _admin(self, scope, headers, send) -> bool:
        """/admin/* and /metrics: an admin key when admin keys are configured, else a client key
        when client keys are, else loopback clients only."""
        if self.access.admins:
            if self.access.admins.match(bearer(headers)) is not None:
                return True
            await self._unauthorised(send, "missing or invalid admin key")
            return False
        if self.access.clients:
            if self.access.clients.match(bearer(headers)) is not None:
                return True
            await self._unauthorised(send, "missing or invalid gateway API key")
            return False
        if is_loopback(scope.get("client")):
            return True
        await self._respond(send, 403, send.dialect.http_error(
            403, "admin endpoints answer loopback clients only when no admin or client keys are configured "
            "([gateway] admin_keys_env)", "forbidden"))
        return False

    async def _ready(self, send) -> None:
        checks = {"config": None}
        for name, check in self.readiness.items():
            checks[name] = await check()
        if self.draining:
            checks["draining"] = "the gateway is shutting down"
        ready = all(problem is None for problem in checks.values())
        degraded = False
        for name, check in self.degradations.items():
            checks[name] = problem = await check()
            degraded = degraded or problem is not None
        body = {"status": "not ready" if not ready else "degraded" if degraded else "ready",
                "checks": {name: problem or "ok" for name, problem in checks.items()}}
        await self._json(send, 200 if ready else 503, body)

    async def _store_ready(self) -> str | None:
        health = self.relay.health
        return None if health.reachable else (f"the shared health store at {health.where} does not answer: "
                                              "serving on this worker's own health")

    async def _ledger_ready(self) -> str | None:
        # a ledger server that hangs would hold the check (and /readyz) forever: it is waited for
        # READY_WAIT_S, and one at a time, so that a prober polling it leaves at most one thread
        # hung on the server, not one per poll
        with trio.move_on_after(READY_WAIT_S):
            writable = await trio.to_thread.run_sync(self.ledger.writable, limiter=self._ready_limiter,
                                                     abandon_on_cancel=True)
            return None if writable else "the ledger is not writable"
        return f"the ledger did not answer within {READY_WAIT_S:g} s"

    async def _read_body(self, receive, send, dialect) -> bytes | None:
        if send.declared_length > self.max_body:  # refused before a byte of it is read (or 100-continue'd)
            await self._respond(send, 413, dialect.http_error(
                413, f"request body larger than {self.max_body} bytes", "request_too_large"),
                headers=[(b"connection", b"close")])
            return None
        # the server may say the whole body is here (a small one comes with its head): then
        # receive() answers all of it without waiting, and no timer is needed
        here = send.body_here is not None and send.body_here()
        body = bytearray()  # (appended in place: `bytes +=` copies all that came before, each piece)
        with contextlib.nullcontext() if here else trio.move_on_after(self.settings.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                body += message.get("body", b"")
                if len(body) > self.max_body:
                    await self._respond(send, 413, dialect.http_error(
                        413, f"request body larger than {self.max_body} bytes", "request_too_large"),
                        headers=[(b"connection", b"close")])
                    return None
                if not message.get("more_body"):
                    send.unread_body = False
                    return bytes(body)
        await self._respond(send, 408, dialect.http_error(
            408, f"the request body did not arrive within {self.settings.body_timeout_s:g} s", "request_timeout"),
            headers=[(b"connection", b"close")])
        return None

    def _model_ids(self) -> list[str]:
        # what clients may name: route hints, catalog models, and the default model
        ids = [*self.relay.router.domains, *self.relay.router.catalog]
        default = self.relay.router.default.entries[0].model if self.relay.router.default.entries else None
        if default and default not in ids:
            ids.append(default)
        return ids

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
                "transitions": breaker.transitions,
            }
        self._note_breakers({alias: profile["breaker"] for alias, profile in profiles.items()})
        return {"window_s": window, "profiles": profiles, "fallback_record": dict(self.relay.fallback_record),
                "in_flight": self.in_flight, "draining": self.draining, "limits": self.limiter.view(self.relay.config)}

    def _live(self) -> dict:
        return self.health()

    def _note_breakers(self, states: dict[str, str]) -> None:
        """Each profile's breaker state (alias -> state): a change since the last is logged."""
        for alias, state in states.items():
            before = self._breakers.get(alias, "closed")
            if state != before:
                event(log, logging.WARNING, "breaker_transition", **{"profile": alias, "from": before, "to": state})
            self._breakers[alias] = state

    async def _record(self, exchange: Exchange, result: TurnResult) -> None:
        """The turn's ledger rows, committed before its answer completes: a client that saw an
        answer can find what it cost."""
        if self.ledger is not None and result.ledger:
            # the answer was made and the providers bill it: the client still gets it; the
            # operator gets the lost rows in the log (and /readyz reports the ledger)
            lost = "ledger_write_error request_id=%s turn=%s rows=%d cost_usd=%.8f"
            try:
                who = exchange.caller
                await self.ledger.record(exchange.turn, result, client=exchange.client, key=who.name if who else "",
                                         team=who.team if who else "")
            except LedgerUnavailable as exc:  # an outage: its reason, not a trace per answer
                log.error(lost + " error=ledger_timeout waited_s=%g", exchange.request_id, exchange.turn,
                          len(result.ledger), result.cost_usd, exc.waited_s)
            except Exception:
                log.exception(lost, exchange.request_id, exchange.turn, len(result.ledger), result.cost_usd)

    def _after(self, exchange: Exchange) -> None:
        """What the client does not wait for, done once its answer's bytes are written (or it
        went away): the turn observed (relay, health view, metrics, console, trace, log lines),
        then the access line and the request metrics. The answer is out: a failure here is
        logged, never the request's error."""
        try:
            if exchange.result is not None and exchange.relay is not None:
                self._observe_turn(exchange, exchange.result)
        except Exception:
            log.exception("turn_bookkeeping_error request_id=%s turn=%s", exchange.request_id, exchange.turn)
        try:
            self._account(exchange)
        except Exception:
            log.exception("access_bookkeeping_error request_id=%s", exchange.request_id)

    def _observe_turn(self, exchange: Exchange, result: TurnResult) -> None:
        started, now = exchange.turn_started, exchange.turn_ended
        exchange.relay._observe(result)  # the relay the turn ran on (a reload may have retired it)
        horizon = now - self.relay.config.breaker.window_s
        tried: dict[str, None] = {}  # the profiles the turn tried, once each
        for attempt in result.attempts:
            tried[attempt.provider] = None
            if attempt.ended_by_consumer:
                continue  # (not the provider's success nor its failure)
            seen = self._outcomes[attempt.provider]
            seen.append((now, attempt.outcome == "ok"))
            while seen and (seen[0][0] < horizon or len(seen) > MAX_OUTCOMES):
                seen.popleft()
        self.metrics.turn(result, now - started)
        if exchange.caller is not None and exchange.caller.name:
            self.metrics.key_turn(exchange.caller.name, result)
        self.console.observe(exchange.turn, result, now - started, now)
        self.tracing.turn(result, started=started, ended=now, request_id=exchange.request_id, families=self._families)
        if result.fallback:
            event(log, logging.WARNING, "fallback", request_id=exchange.request_id, requested=result.requested,
                  served=result.served.label if result.served else None, attempts=len(result.attempts))
        if result.outcome in ("error", "interrupted") and result.error not in QUIET_ERRORS:
            event(log, logging.WARNING, "turn_failed", request_id=exchange.request_id, outcome=result.outcome,
                  reason=result.error, requested=result.requested, attempts=len(result.attempts))
        health = self.relay.health
        self._note_breakers({alias: health.breaker(alias).refresh(now) for alias in tried})

    def _account(self, exchange: Exchange) -> None:
        """The access line and the request metrics, once the response ended (or the client left)."""
        status = exchange.status if exchange.status is not None else 499  # the client went away first
        self.metrics.request(exchange.path, status)
        result = exchange.result
        if result is not None and exchange.first_byte is not None and result.served is not None:
            self.metrics.first_token(result.served.profile, result.served.model, exchange.first_byte - exchange.started)
        if not access_log.isEnabledFor(logging.INFO):
            return  # `--log-level warning`: the line is not built at all (nor its clock read)
        now = trio.current_time()
        fields = {
            "method": exchange.method, "path": exchange.path[:200], "status": status,
            "latency_ms": round((now - exchange.started) * 1000, 2),
            "ttfb_ms": round((exchange.first_byte - exchange.started) * 1000, 2) if exchange.first_byte else None,
            "request_id": exchange.request_id, "client": exchange.client or None, "turn": exchange.turn,
        }
        if exchange.query:  # (a client's own parameters, such as Claude Code's ?beta=true)
            fields["query"] = exchange.query[:200].decode("latin-1")
        if exchange.caller is not None and exchange.caller.name:
            fields.update(key=exchange.caller.name, team=exchange.caller.team or None)
        if result is not None:
            fields.update(
                requested=result.requested, served=result.served.label if result.served else None,
                outcome=result.outcome, attempts=len(result.attempts),
                input_tokens=sum(r.input_tokens for r in result.ledger),
                output_tokens=sum(r.output_tokens for r in result.ledger), cost_usd=round(result.cost_usd, 8))
            if result.partial_from is not None:  # nothing accepted: whose output the client saw
                fields["partial_from"] = result.partial_from.label
        access_log.info("access", extra={"fields": fields})

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

    # -- admission and drain --------------------------------------------------------------------

    async def drain(self, seconds: float) -> None:
        """Stop admitting turns, wait up to `seconds` for those in flight, then cancel the rest:
        a cancelled stream ends with the explicit error event, a held one gets a 503, and every
        billable attempt still gets its ledger row. Returns once no turn is in flight."""
        self.draining = True
        with trio.move_on_after(seconds):
            await self._idle.wait()
        self.cancel_turns()
        await self._idle.wait()

    def cancel_turns(self) -> None:
        self._cut = True
        for owner in list(self._turns):
            self._cancelled_by_drain.add(owner)
            owner.cancel()

    # -- chat completions -----------------------------------------------------------------------

    async def _request(self, dialect, scope, receive, send: Exchange) -> wire.Request | None:
        """The request a chat body asks for, or None once it was answered (a 4xx). Its own frame:
        the raw body, its decoded JSON and the decoded headers are needed only here, and a
        stream's turn would otherwise keep them alive for the stream's whole life."""
        raw = await self._read_body(receive, send, dialect)
        if raw is None:
            return None
        try:
            body, encodable = jsoncodec.loads_encodable(raw)
        except (ValueError, RecursionError):
            body, encodable = wire.WireError("", "the body is not valid JSON"), True
        try:
            if isinstance(body, wire.WireError):
                raise body
            # only the headers some entry may be sent are decoded (`travelling_headers`; ASGI's
            # names are lowercase), never the one that carried the client's gateway key: a profile
            # naming `authorization` in forward_headers passes on a client's own provider key, not
            # the gateway's
            travelling = self._travelling
            if self.access.clients and not travelling.isdisjoint(CREDENTIAL_HEADERS):
                travelling = travelling - {credential_header(dict(scope.get("headers") or ()))}
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers") or ()
                       if k in travelling]
            query = scope.get("query_string")
            request = dialect.parse(body, headers, query.decode("latin-1") if query else "")
        except wire.WireError as error:
            await self._respond(send, *dialect.bad_request(error))
            return None
        except RecursionError:
            await self._respond(send, *dialect.bad_request(wire.WireError("", "the body is nested too deeply")))
            return None
        if not encodable:
            await self._respond(send, *dialect.bad_request(wire.WireError(
                "", "the body contains a lone UTF-16 surrogate escape (such as \\ud800), which cannot be sent as UTF-8")))
            return None
        if request.model is None:
            await self._respond(send, *dialect.bad_request(wire.WireError(
                "model", "is required: name one of the models GET /v1/models lists")))
            return None
        if self.settings.unknown_models == "reject" and not model_offered(self.relay.router, request.model):
            await self._respond(send, 404, dialect.http_error(
                404, f"the model {request.model!r} does not exist here: GET /v1/models lists the models on offer",
                "model_not_found"))
            return None
        return request

    async def _chat(self, exchange: Exchange, dialect, scope, receive) -> None:
        """Run a chat request unless the gateway is full or draining: then 503 with Retry-After,
        before its body is read (load shedding costs next to nothing)."""
        limit = self.settings.max_in_flight
        if self.draining or (limit and self.in_flight >= limit):
            why = "the gateway is shutting down" if self.draining else f"{limit} turns are in flight, the limit"
            status, body = _unavailable(dialect, f"{why}: retry shortly")
            await self._respond(exchange, status, body, headers=[(b"retry-after", b"1")]
                                + ([(b"connection", b"close")] if self.draining else []))
            return
        self.in_flight += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        try:
            request = await self._request(dialect, scope, receive, exchange)
            del scope  # (read: a stream's frames need not keep it)
            if request is None or not await self._allowed(exchange, dialect, request):
                return
            if not await self._admitted(exchange, dialect, request):
                return
            turn_id = dialect.new_id()
            if request.stream:
                stream = _StreamWire(turn_id, exchange, dialect, request)
                result = await self._run_turn(exchange, turn_id, receive, request, stream)
                await stream.settled()  # a commit the gate timer began is written whole first
            else:
                result = await self._run_turn(exchange, turn_id, receive, request)
            if result is not None and exchange.drained:
                result = _shut_down(result)
            elif result is None or result.outcome == "cancelled":
                return  # the client went away
            if request.stream and (stream.started or result.outcome == "ok"):
                await stream.finish(result, self._relayline_field(result))
            elif result.outcome != "ok":
                # a stream that sent nothing: a failure before commit still gets a real status and body
                await self._error_response(exchange, dialect, result)
            else:
                await self._json(exchange, 200, dialect.completion(turn_id, result, self._relayline_field(result), request),
                                 headers=self._attribution(result) + dropped_header(request, result.served))
        finally:
            if exchange.admission is not None:
                with trio.CancelScope(shield=True):  # what the turn billed counts, whoever went away
                    await self.limiter.settle(exchange.admission, exchange.result)
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def _admitted(self, exchange: Exchange, dialect, request: wire.Request) -> bool:
        """The one admission point of every chat-like request: a named key's request within its
        key's and team's limits goes on (counted); one over them is a 429 in the dialect's shape,
        and nothing is sent upstream or billed."""
        who = exchange.caller
        if who is None or not who.name:
            return True
        decision = await self.limiter.admit(self.relay.config, who.name, request)
        if decision is None or isinstance(decision, Admitted):
            exchange.admission = decision
            if decision is not None:
                self.metrics.key_decision(who.name, "admitted")
            return True
        self.metrics.key_decision(who.name, "budget_exceeded" if decision.limit == "budget" else "rate_limited")
        await self._refuse(exchange, dialect, decision)
        return False

    async def _refuse(self, exchange: Exchange, dialect, refusal: Refusal) -> None:
        status = 429
        await self._respond(exchange, status, dialect.http_error(status, refusal.message, refusal.code),
                            headers=refusal_headers(refusal))

    async def _allowed(self, exchange: Exchange, dialect, request: wire.Request) -> bool:
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
        await self._respond(exchange, 403, dialect.http_error(
            403, f"the key {who.name!r} may not use model {model[:200]!r} (it may use: {allowed})", "model_not_allowed"))
        return False

    async def _run_turn(self, exchange: Exchange, turn_id: str, receive, request: wire.Request,
                        stream: _StreamWire | None = None) -> TurnResult | None:
        """Run one turn while watching for the client going away (a disconnect cancels it) and
        for a drain running out of time, then write its ledger rows (before any response ends;
        the rest of its bookkeeping waits for the answer: `_after`). The run is driven here, in
        the request's own task and with the run's own cancel scope alone where the server calls
        back on a hang-up: a held stream keeps every coroutine frame of its path
        (docs/performance-history.md, "Memory per held stream")."""
        started = trio.current_time()
        REQUEST_ID.set(exchange.request_id)  # sent upstream as x-request-id
        relay = self.relay  # the turn runs on this one to its end, whatever a reload does
        self._turns_of[relay] = self._turns_of.get(relay, 0) + 1
        run: TurnRun | None = None
        owner: TurnRun | _StreamWire | trio.CancelScope | None = None
        try:
            run = relay._new_run(request, model=request.model, stream=stream is not None, gateway=True)
            # the server's call-back on a hang-up cancels the run itself; else a task watches
            watching = contextlib.nullcontext() if exchange.hangup is not None else self._watching(receive)
            async with watching as turn_scope:
                owner = run if turn_scope is None else turn_scope
                if stream is not None:  # a hang-up or a drain also cuts short a write in progress
                    stream.run = run
                    stream._cancel_turn, owner = owner.cancel, stream
                    # the gate holds from the request's start, and only once the run exists: the
                    # `finally` below, before any await, is the one place it is let go
                    gate_s = relay.config.timeouts.gate_commit_s
                    if gate_s > 0:
                        self._gates.hold(stream, started + gate_s)
                try:
                    self._admit(owner)
                    if turn_scope is None:
                        exchange.hangup(owner.cancel)
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
            if owner is not None:
                self._turns.discard(owner)
            self._turns_of[relay] -= 1
            if not self._turns_of[relay]:
                del self._turns_of[relay]
                if relay is not self.relay:  # retired by a reload: its last turn ended
                    with trio.CancelScope(shield=True):
                        await relay.aclose()
            # whatever raised (relayline's own bug), a turn that has a result is accounted: its
            # ledger rows are what the providers will bill
            result = run.result if run is not None else None
            if result is not None:
                exchange.result, exchange.turn, exchange.relay = result, turn_id, relay
                exchange.turn_started, exchange.turn_ended = started, trio.current_time()
                await self._record(exchange, result)
        exchange.drained = owner in self._cancelled_by_drain
        self._cancelled_by_drain.discard(owner)
        return run.result

    @contextlib.asynccontextmanager
    async def _watching(self, receive):
        """For a server that does not call back on a hang-up: a scope around the turn, and a
        task of its own that cancels it when the client disconnects."""
        with trio.CancelScope() as turn_scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, turn_scope)
                try:
                    yield turn_scope
                finally:
                    nursery.cancel_scope.cancel()

    def _admit(self, owner: TurnRun | _StreamWire | trio.CancelScope) -> None:
        """A turn's canceller (its run, its stream's wire, or the scope around it) joins those a
        drain cancels."""
        self._turns.add(owner)
        if self._cut:
            self._cancelled_by_drain.add(owner)
            owner.cancel()

    async def _error_response(self, send, dialect, result: TurnResult) -> None:
        status, body = dialect.error(result)
        headers = self._attribution(result)
        if result.error == "shutdown":
            headers.append((b"retry-after", b"1"))
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

# a dropped field's name written as it is: printable ASCII but a space, '"', ',' and '\\'
_PLAIN_FIELD = re.compile(r"[\x21\x23-\x2b\x2d-\x5b\x5d-\x7e]+").fullmatch


def dropped_header(request: wire.Request, entry) -> list[tuple[bytes, bytes]]:
    """x-relayline-dropped: the fields `drop_unsupported_params` dropped for the serving entry.
    A name is the client's own JSON key: one that is not plain header text (a line feed, a NUL,
    a comma, non-ASCII) is written as a JSON string in ASCII, so the list stays one legal
    header line that still names it."""
    if entry is None or request is None:
        return []
    provider = entry.provider
    dropped = wire.droppable(request, provider.family, provider.capabilities)
    if not wire.passes_through(request, provider.family, provider.capabilities):
        dropped += request.withdrawn  # built-in tools a translating entry did not offer the model
    if not dropped:
        return []
    names = [name if _PLAIN_FIELD(name) else json.dumps(name).replace("\x7f", "\\u007f") for name in dropped]
    return [(b"x-relayline-dropped", ", ".join(names).encode())]


def _shut_down(result: TurnResult) -> TurnResult:
    """A turn the drain cancelled: said as such to its client, never as a client disconnect."""
    return attrs.evolve(result, outcome="error", error="shutdown",
                        message="the gateway is shutting down: this turn was cancelled before it finished")


def _unavailable(dialect, message: str) -> tuple[int, bytes]:
    return 503, dialect.http_error(503, message, "overloaded")


class _StreamWire:
    """One streamed response: held headers, the commit, and a bounded write buffer; the driver's
    sink for the turn.

    The dialect renders; the wire decides when bytes go out. It has no task of its own (a task
    with its nursery and scopes was about 5 KiB of every stream in flight): events are rendered
    into a pending buffer, and the turn's own task writes it, in one ASGI send, when the
    upstream adapter is about to wait for its next read (`waiting`), so the frames of one read
    leave together and an idle stream still sends each frame at once. The first token is written
    at once; past MAX_PENDING the turn writes before it renders more. A client that reads slowly
    holds the turn's write, and with it the next upstream read (TCP backpressure), its idle
    deadline lifted meanwhile (a slow reader is not a stalled provider). The held headers are
    committed after `gate_commit_s` with nothing decisive by the gateway's one gate timer
    (`_GateTimer`), whatever the turn is waiting on.
    """

    MAX_PENDING = 256 * 1024

    __slots__ = ("send", "run", "request", "render", "started", "_head", "_pending", "_pending_bytes", "_sending",
                 "_ending", "_committing", "_gate", "_cancel_turn", "_unnamed")

    def __init__(self, turn_id: str, send, dialect, request: wire.Request) -> None:
        self.send = send
        self.run: TurnRun | None = None  # the turn's, once it exists
        self.request = request
        self.render = dialect.stream_renderer(turn_id, request)
        self.started = False
        self._head: dict | None = None  # the response's start, written with the first bytes
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._sending: trio.CancelScope | None = None
        self._ending = False
        self._committing: trio.Event | None = None  # while the gate timer writes the held commit
        self._gate: list | None = None  # the gate timer's entry, while the gate holds
        self._cancel_turn: Callable[[], None] | None = None
        self._unnamed = False  # committed before anything served: the chunks name no model yet

    def cancel(self) -> None:
        """A hang-up or a drain: the turn is cancelled, and a write in progress gets SEND_GRACE_S."""
        self.ending()
        if self._cancel_turn is not None:
            self._cancel_turn()

    def _served_entry(self):
        """The entry that serves what this stream shows, once that is certain: the turn's served
        entry, or the stream in flight once it committed (it said something decisive). Headers
        the gate timer commits before then name no one: a pre-commit failure may still hand the
        turn to another entry."""
        run = self.run
        if run is None:
            return None
        if run.result is not None:
            return run.result.served
        turn = run.turn
        call, gate = turn.call, turn.gate
        if call is not None and call.mode == Mode.STREAM and gate is not None and gate.committed:
            return call.entry
        return None

    def _paused(self):
        """The turn's upstream idle deadline lifted while it waits for the client."""
        return self.run.consumer_paused() if self.run is not None else contextlib.nullcontext()

    async def _send_whole(self, message: dict) -> None:
        # a write begun must finish (bytes taken from the buffer would otherwise be lost, and a
        # chunk cut in two would garble the stream for the error event a drain still sends): at
        # the client's pace while the turn runs, SEND_GRACE_S at most once it ended. The shield
        # also keeps the turn's own deadline out, and the write runs in the turn's task: so the
        # turn's budget (timeouts.total_s) bounds it here, or a client that stopped reading would
        # hold the turn and its upstream connection until the server's send watchdog
        with trio.CancelScope(shield=True) as scope:
            if self._ending:
                scope.deadline = trio.current_time() + SEND_GRACE_S
            elif self.run is not None:
                scope.deadline = self.run.budget + SEND_GRACE_S
            self._sending = scope
            try:
                await self.send(message)
            finally:
                self._sending = None

    def ending(self) -> None:
        """The turn is over: a write still in progress gets SEND_GRACE_S, not the client's pace."""
        self._ending = True
        self._disarm()
        if self._sending is not None:
            self._sending.deadline = trio.current_time() + SEND_GRACE_S

    def _disarm(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate[3].release(gate)

    def commit(self) -> None:
        """The held headers and the dialect's opening, queued for the first write."""
        if self.started:
            return
        self.started = True
        self._disarm()
        entry = self._served_entry()
        run = self.run
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        if entry is not None:
            headers.append((b"x-relayline-served", entry.label.encode()))
        elif run is None or run.result is not None:
            headers.append((b"x-relayline-served", b"none"))  # the turn ended with no answer
        else:
            self._unnamed = True  # (the final event says who served: `finish`)
        if run is not None:
            headers.append((b"x-relayline-requested", run.turn.plan.requested.encode()))
            # the attempt in flight is not recorded yet; a recovered answer's already is
            in_flight = 1 if run.turn.call is not None else 0
            headers.append((b"x-relayline-attempts", str(len(run.turn.attempts) + in_flight).encode()))
        headers += dropped_header(self.request, entry)
        self._head = {"type": "http.response.start", "status": 200, "headers": headers}
        gate = run.turn.gate if run is not None else None
        self._put(self.render.opening(entry.model if entry is not None else "", gate.usage if gate is not None else None))

    async def at_gate(self) -> None:
        """`gate_commit_s` passed with nothing decisive: the held headers and preamble go out (a
        slow model is not an error). Run by the gate timer's task while the turn waits; the
        turn's own writes wait for it (`_committing`)."""
        if self.started or self._ending:
            return
        done = self._committing = trio.Event()
        try:
            self.commit()
            await self._write()
        finally:
            self._committing = None
            done.set()

    async def settled(self) -> None:
        """A commit the gate timer began is written whole (before the answer's end, or before
        the request returns)."""
        if self._committing is not None:
            await self._committing.wait()

    def _put(self, data: bytes) -> None:
        if data:
            self._pending.append(data)
            self._pending_bytes += len(data)

    async def _write(self) -> None:
        head, self._head = self._head, None
        if head is not None:
            await self._send_whole(head)
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            self._pending_bytes = 0
            await self._send_whole({"type": "http.response.body", "body": data, "more_body": True})

    async def _flush(self) -> None:
        await self.settled()
        with self._paused():
            await self._write()

    async def __call__(self, event: Event) -> None:
        if not event.visible:
            if event.ref and not self.started:  # what the stream said of itself (a Responses stream's id)
                self.render.event(event)
            return  # held protocol frames: the dialect's preamble is rendered at commit
        if not self.started:
            self.commit()
            self._put(self.render.event(event))
            # the first token goes out now, not once the rest of this upstream read is rendered;
            # a client slow to take it is not a stalled provider
            await self._flush()
            return
        if self._unnamed:
            entry = self._served_entry()
            if entry is not None:  # the first of it after headers the gate timer sent
                self._unnamed = False
                self.render.serving(entry.model)
        # nearly every frame: queued inline (no coroutine of its own for each step)
        data = self.render.event(event)
        if data:
            self._pending.append(data)
            self._pending_bytes += len(data)
            if self._pending_bytes > self.MAX_PENDING:
                await self._flush()

    may_block = False  # bounded buffer: when it must wait for the client, it says so (consumer_paused)

    async def waiting(self) -> None:
        """The upstream adapter is about to wait for its next read: what gathered goes out."""
        if self._pending or self._committing is not None:
            await self._flush()

    async def finish(self, result: TurnResult, relayline: dict) -> None:
        """The end of the response; whatever was not sent yet goes first (after `settled`: a
        commit the gate timer began is written whole)."""
        self.commit()  # an answer with nothing to show (a refusal) still is a stream
        body = self.render.ok(result, relayline) if result.outcome == "ok" else self.render.failed(result, relayline)
        head, self._head = self._head, None
        if head is not None:
            await self.send(head)
        body = b"".join(self._pending) + body
        self._pending.clear()
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


class _GateTimer:
    """Every held stream's gate deadline, served by one task for the whole gateway: a heap of
    deadlines, not a timer task per stream (docs/performance-history.md: each task is memory). A
    stream that commits or ends first only clears its entry; when a deadline passes with the
    stream still held, a short task of the timer's own writes its commit (`_StreamWire.at_gate`:
    the stream's turn task is busy waiting on the upstream). The task ends when no gate holds and
    starts again with the next one."""

    __slots__ = ("_heap", "_count", "_live", "_sleep", "_runner")

    def __init__(self) -> None:
        self._heap: list[list] = []  # [deadline, order, wire (None once released), this timer]
        self._count = itertools.count()
        self._live = 0
        self._sleep: trio.CancelScope | None = None
        self._runner: object | None = None  # the task serving the heap (a token of its own)

    def hold(self, stream: _StreamWire, deadline: float) -> None:
        entry = [deadline, next(self._count), stream, self]
        stream._gate = entry
        heapq.heappush(self._heap, entry)
        self._live += 1
        if self._runner is None:
            self._runner = object()
            trio.lowlevel.spawn_system_task(self._run, self._runner, name="relayline gate timer")
        elif self._sleep is not None and deadline < self._sleep.deadline:
            self._sleep.deadline = deadline  # (a reload shortened gate_commit_s)

    def release(self, entry: list) -> None:
        """The stream committed or ended (or its deadline came): its entry no longer holds it."""
        entry[2] = None
        self._live -= 1
        if len(self._heap) > 64 and len(self._heap) > 2 * self._live:
            # entries cleared by streams that committed early leave the heap in bulk, not one by
            # one when their deadline comes: thousands of streams may commit within
            # gate_commit_s (the timer's task only yields in its sleep, which looks again)
            self._heap = [entry for entry in self._heap if entry[2] is not None]
            heapq.heapify(self._heap)

    async def _run(self, token: object) -> None:
        try:
            async with trio.open_nursery() as nursery:
                while self._heap:  # (a release may compact it into a new list: looked up each time)
                    deadline, _, stream, _ = self._heap[0]
                    if stream is None:
                        heapq.heappop(self._heap)
                        continue
                    if deadline > trio.current_time():
                        with trio.CancelScope(deadline=deadline) as self._sleep:
                            await trio.sleep_forever()
                        self._sleep = None
                        continue
                    heapq.heappop(self._heap)
                    stream._disarm()
                    nursery.start_soon(self._commit, stream)
                self._runner = None  # a gate held from now on starts a new task (this one waits for its commits)
        except Exception:  # a system task's error would end the whole run: log it instead
            log.exception("gate_timer_error")
        finally:
            if self._runner is token:  # cancelled with the run (or failed): no gate outlives its task
                for entry in self._heap:
                    if entry[2] is not None:
                        entry[2]._gate = None
                self._heap, self._live = [], 0
                self._runner = self._sleep = None

    @staticmethod
    async def _commit(stream: _StreamWire) -> None:
        try:
            await stream.at_gate()
        except Exception:
            log.exception("gate_commit_error")

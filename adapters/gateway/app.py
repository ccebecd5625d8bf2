"""The gateway: a plain ASGI app, served by the HTTP/1.1 server in http11/, made of small
collaborators: the route table and its key checks (routes.py), the chat path (chat.py, reading
its request in chat_request.py, streaming through stream_wire.py, its turns in flight in
in_flight.py), the operator side (admin.py), and what each answer leaves behind (bookkeeping.py).

Operating it: one access line per request (logger relayline.access), a request id accepted or
made, echoed and sent upstream; chat requests beyond `[gateway] max_in_flight`, or during a
drain, are shed with 503 and Retry-After before their body is read; a body slower than
`body_timeout_s` is a 408. `drain()` is what SIGTERM runs (serving.py). Attribution rides on
x-relayline-* headers and a `relayline` field in bodies.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sqlite3
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import trio

from relayline.machines.errors import ConfigError
from relayline.machines.turn import TurnResult
from relayline.machines.vocab import FailureClass

from ..otel import Tracing
from ..relay import Relay
from ..stores.ledger import DEFAULT_PATH, LedgerStore, open_ledger
from ..stores.schema import LedgerBackend
from .admin import Admin
from .auth import Access, KeyRing, load_access
from .bookkeeping import Bookkeeping
from .chat import ChatPath
from .chat_request import travelling_headers
from .console import Console
from .exchange import Exchange, request_id, respond
from .http11 import Receive, Scope, Send
from .in_flight import TurnsInFlight
from .limits import Limiter
from .metrics import Metrics, configured_models, named_keys
from .routes import METERED, dispatch

if TYPE_CHECKING:
    from .reload import Reloader

log = logging.getLogger("relayline.gateway")

TRIM_AFTER_BYTES = 8 * 1024 * 1024  # an answer at least this large is followed by a malloc_trim


@functools.cache
def _malloc_trim() -> ctypes._NamedFuncPointer | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _read_too_much(result: TurnResult | None) -> bool:
    """A body refused as too_large was read up to limits.max_response_bytes first: its heap
    is handed back like a large answer's (docs/behaviour.md, "Memory")."""
    return result is not None and any(
        FailureClass.TOO_LARGE in (a.outcome, a.reason) for a in result.attempts
    )


class Gateway:
    """One gateway: the relay, access and settings it serves now (a reload swaps them: `swap`),
    and the collaborators that answer its requests."""

    def __init__(self, relay: Relay, *, api_keys: set[str] | None = None,
                 ledger: LedgerBackend | None = None, access: Access | None = None) -> None:
        self.relay = relay
        self.access = access if access is not None else Access(clients=KeyRing.of(api_keys or ()))
        self.ledger = ledger
        self.settings = relay.config.gateway
        # the client headers some entry may be sent
        self.travelling = travelling_headers(relay.config)
        self.turns = TurnsInFlight()
        if isinstance(ledger, LedgerStore):
            # turns finishing together share a commit; a turn alone is committed at once
            ledger.together = lambda: self.turns.count > 1
        self.metrics = Metrics(relay.config, METERED, self._live)
        self.tracing = Tracing()  # OpenTelemetry spans when relayline[otel] is installed
        self.reloader: Reloader | None = None  # serving from a config file: reloads it
        self.console = Console(self)
        # named keys' limits, counted in the shared store when there is one
        self.limiter = Limiter(relay.health, ledger)
        families = {alias: p.family for alias, p in relay.config.providers.items()}
        self.books = Bookkeeping(self, ledger, self.metrics, self.console, families)
        self.admin = Admin(self, self.books)
        self.chat = ChatPath(self, self.turns, self.limiter, self.metrics, self.books)
        self._trimming = False

    @property
    def in_flight(self) -> int:
        return self.turns.count

    @property
    def draining(self) -> bool:
        return self.turns.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.turns.draining = value

    @property
    def readiness(self) -> dict[str, Callable[[], Awaitable[str | None]]]:
        """Readiness checks beyond "config loaded" (admin.py): name -> check answering a problem or
        None."""
        return self.admin.readiness

    @property
    def degradations(self) -> dict[str, Callable[[], Awaitable[str | None]]]:
        """What /readyz reports without failing it (admin.py): name -> check answering a problem or
        None."""
        return self.admin.degradations

    def health(self) -> dict[str, Any]:
        return self.admin.health()

    def _live(self) -> dict[str, Any]:
        return self.admin.health()

    async def swap(self, relay: Relay, access: Access) -> None:
        """A reload (checked: reload.py): new turns use `relay` and `access`; turns in flight
        finish on the relay they started with, which is closed when its last turn ends."""
        old, self.relay = self.relay, relay
        self.access = access
        self.settings = relay.config.gateway
        self.travelling = travelling_headers(relay.config)
        self.metrics.providers = frozenset(relay.config.providers)
        self.metrics.models = configured_models(relay.config)
        self.metrics.keys = named_keys(relay.config)
        if old is not relay and not self.turns.running_on(old):
            await old.aclose()

    @classmethod
    def from_relay_config(cls, relay: Relay, env: Mapping[str, str] | None = None) -> Gateway:
        """The gateway a config describes. Raises ConfigError when a key variable it names is
        unset or empty (fail closed), or the ledger cannot be opened."""
        env = os.environ if env is None else env
        cfg = relay.config
        access = load_access(cfg, env)
        try:
            ledger = open_ledger(cfg.ledger)
        except (OSError, sqlite3.Error, RuntimeError) as exc:
            where = "ledger.url" if cfg.ledger.url else "ledger.path"
            problem = str(exc) if isinstance(exc, RuntimeError) else (
                f"{where}: cannot open {cfg.ledger.path or DEFAULT_PATH}: {exc}")
            raise ConfigError([problem]) from None
        return cls(relay, ledger=ledger, access=access)

    # -- admission and drain --------------------------------------------------------------------

    async def drain(self, seconds: float) -> None:
        """Stop admitting turns, wait up to `seconds` for those in flight, then cancel the rest:
        a cancelled stream ends with the explicit error event, a held one gets a 503, and every
        billable attempt still gets its ledger row. Returns once no turn is in flight."""
        await self.turns.drain(seconds)

    def cancel_turns(self) -> None:
        self.turns.cancel_all()

    # -- ASGI -----------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
        exchange = Exchange(send, scope["method"], scope["path"], request_id(headers), headers,
                            receive,
                            scope.get("query_string") or b"")
        extensions = scope.get("extensions")
        if extensions:
            exchange.hangup = extensions.get("relayline.hangup")
            exchange.body_here = extensions.get("relayline.body_here")
        try:
            route = dispatch(self, exchange, scope, headers, receive)
            # (a frame's locals live as long as its request: a stream's whole life)
            del scope, headers
            await route
        except Exception:
            # relayline's own bug: logged once with its stack; the client gets a JSON 500, never
            # an empty body (after the headers went out, the connection is all that is left)
            log.exception("gateway_internal_error request_id=%s path=%s", exchange.request_id,
                          exchange.path[:200])
            if exchange.status is None:
                await respond(exchange, 500, exchange.dialect.http_error(
                    500, "internal error in the gateway (logged)", "internal_error"))
        finally:
            self.books.after(exchange)
        if exchange.sent >= TRIM_AFTER_BYTES or _read_too_much(exchange.result):
            exchange.result = None  # the answer's text is freed before the trim
            await self._give_back_memory()

    async def _give_back_memory(self) -> None:
        """Hand the C heap's free pages back to the OS after a large answer. A large stream's
        64 KiB frames are freed between long-lived small objects, so glibc cannot shrink its heap
        from the top and RSS would stay at its peak for good (docs/behaviour.md, "Memory");
        malloc_trim releases every free page. It walks the whole heap, so it runs in a worker
        thread, one at a time."""
        trim = _malloc_trim()
        if trim is None or self._trimming:
            return
        self._trimming = True
        try:
            await trio.to_thread.run_sync(trim, 0)
        finally:
            self._trimming = False

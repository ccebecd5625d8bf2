"""The gateway's operator side: readiness (/readyz), the health view (/admin/health and the
metrics' live state), the plan a request would get (/admin/plan), and a reload of the config
file (/admin/reload). It reads the gateway through `AdminHost`, never the whole gateway."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs

import trio

from ..codecs.dialects import OPENAI
from ..driver import is_fleet
from .bookkeeping import Bookkeeping
from .exchange import respond, respond_json
from .http11 import Send

if TYPE_CHECKING:
    from ..relay import Relay
    from ..stores.schema import LedgerBackend
    from .limits import Limiter
    from .reload import Reloader

READY_WAIT_S = 2.0  # a readiness check of the ledger that takes longer says not ready


class AdminHost(Protocol):
    """What the operator side reads of the gateway: the relay serving now (a reload swaps it),
    its ledger (None: it keeps none), the named keys' limiter, the turns in flight and whether
    it is draining, and the reloader of its config file (None: it serves no file)."""

    relay: Relay
    ledger: LedgerBackend | None
    limiter: Limiter
    reloader: Reloader | None

    @property
    def in_flight(self) -> int: ...

    @property
    def draining(self) -> bool: ...


class Admin:
    def __init__(self, host: AdminHost, books: Bookkeeping) -> None:
        self.host = host
        self.books = books  # each profile's recent outcomes, and its breaker changes logged
        # readiness checks beyond "config loaded": name -> callable answering an error or None
        self.readiness: dict[str, Callable[[], Awaitable[str | None]]] = {}
        # what /readyz reports without failing it: the gateway serves without it. A shared health
        # store is one: when it is down each worker serves on local health (docs/gateway.md), and a
        # 503 from every worker at once would have the load balancer take the whole fleet out
        # for an outage the fleet rides through
        self.degradations: dict[str, Callable[[], Awaitable[str | None]]] = {}
        if host.ledger is not None:
            self.readiness["ledger"] = self.ledger_ready
            self._ready_limiter = trio.CapacityLimiter(1)
        if is_fleet(host.relay.health):  # a shared health store (stores/health.py)
            self.degradations["shared_store"] = self.store_ready

    async def ready(self, send: Send) -> None:
        """GET /readyz: 200 when every readiness check passes (degradations are reported, not
        failed), else 503 naming each problem."""
        checks: dict[str, str | None] = {"config": None}
        for name, check in self.readiness.items():
            checks[name] = await check()
        if self.host.draining:
            checks["draining"] = "the gateway is shutting down"
        ready = all(problem is None for problem in checks.values())
        degraded = False
        for name, check in self.degradations.items():
            checks[name] = problem = await check()
            degraded = degraded or problem is not None
        body = {"status": "not ready" if not ready else "degraded" if degraded else "ready",
                "checks": {name: problem or "ok" for name, problem in checks.items()}}
        await respond_json(send, 200 if ready else 503, body)

    async def store_ready(self) -> str | None:
        health = self.host.relay.health
        if not is_fleet(health) or health.reachable:
            return None
        return (f"the shared health store at {health.where} does not answer: serving on this"
                " worker's own health")

    async def ledger_ready(self) -> str | None:
        # a ledger server that hangs would hold the check (and /readyz) forever: it is waited for
        # READY_WAIT_S, and one at a time, so that a prober polling it leaves at most one thread
        # hung on the server, not one per poll
        ledger = self.host.ledger
        if ledger is None:
            return None
        with trio.move_on_after(READY_WAIT_S):
            writable = await trio.to_thread.run_sync(ledger.writable, limiter=self._ready_limiter,
                                                     abandon_on_cancel=True)
            return None if writable else "the ledger is not writable"
        return f"the ledger did not answer within {READY_WAIT_S:g} s"

    def health(self) -> dict[str, Any]:
        """The health view: each profile's breaker, cooldown and recent success rate, where the
        fallbacks went, the turns in flight and the named keys' limits."""
        host = self.host
        relay = host.relay
        now = trio.current_time()
        window = relay.config.breaker.window_s
        profiles: dict[str, dict[str, Any]] = {}
        for alias in sorted(relay.config.providers):
            breaker = relay.health.breaker(alias)
            breaker.refresh(now)
            seen = self.books.outcomes(alias, now - window)
            cooling = relay.health.cooldown_until(alias) - now
            profiles[alias] = {
                "breaker": breaker.state,
                "recent_failures": len(breaker.failures),
                "open_for_s": round(max(0.0, breaker.open_until - now), 3)
                if breaker.state == "open"
                else 0.0,
                "cooldown_s": round(cooling, 3) if cooling > 0 else 0.0,
                "attempts_in_window": len(seen),
                "success_rate": round(sum(ok for _, ok in seen) / len(seen), 4) if seen else None,
                "transitions": breaker.transitions,
            }
        self.books.note_breakers({alias: profile["breaker"] for alias, profile in profiles.items()})
        return {"window_s": window, "profiles": profiles,
                "fallback_record": dict(relay.fallback_record),
                "in_flight": host.in_flight, "draining": host.draining,
                "limits": host.limiter.view(relay.config)}

    async def answer_health(self, send: Send) -> None:
        """GET /admin/health. In a fleet, the shared state, not only this worker's mirror."""
        relay = self.host.relay
        if is_fleet(relay.health):
            await relay.health.sync(relay.config.providers)
        await respond_json(send, 200, self.health())

    async def answer_plan(self, send: Send, query: bytes) -> None:
        """GET /admin/plan?model=&text=: the plan a gateway request naming them would get."""
        asked = parse_qs(query.decode("latin-1"))
        plan = self.host.relay.plan(model=asked.get("model", [None])[0],
                                    text=asked.get("text", [""])[0],
                                    gateway=True)
        await respond_json(send, 200, plan.as_json())

    async def reload(self, send: Send) -> None:
        """POST /admin/reload: 200 with the profiles now served, 422 listing the problems of a
        file that was refused, or 503 while the gateway drains (nothing changed on either). In a
        fleet, a 200 then reloads every worker."""
        reloader = self.host.reloader
        if reloader is None:
            await respond(send, 409,
                          OPENAI.http_error(409, "this gateway serves no config file to reload",
                                                       "no_config_file"))
            return
        report = await reloader.reload()
        # 503 when the gateway is stopping (nothing wrong with the file: ask the next process)
        await respond_json(send, 200 if report.ok else 503 if report.stopping else 422,
                           report.as_json())
        if report.ok and reloader.fleet is not None:
            reloader.fleet()  # the other workers take the file as on a SIGHUP to the supervisor

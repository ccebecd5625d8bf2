"""The operator's console: one page at GET /admin/ that shows the gateway running.

What it shows comes only from the gateway itself: the routes and their exact chains (the same
plans /admin/plan answers), per-profile health (breaker and cooldown with time left, success
rate and latency over the breaker window, key-pool cursor), the lifecycle diagrams with each
transition labelled with how often it fired since start (the engine's counters), the recent
turns as attempt timelines, and the ledger's cost by profile and model.

The page is static package data (HTML, JS, CSS and a vendored Mermaid with its license): no
build step, nothing fetched from elsewhere at run time (a Content-Security-Policy says so to
the browser). It loads one snapshot, then listens to one server-sent event stream that pushes
a part only when it changed, so an open console costs the gateway one idle connection, not a
polling storm.

Nothing here ever carries prompt or completion text, or a credential: turns are shown by their
attempts (profile, model, mode, outcome, reason, latency, tokens, cost), profiles by their state.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs

import attrs
import trio

from relayline.machines.engine import SPEC_NAMES, Spec, load_spec
from relayline.machines.plan import HINT_PREFIX, Plan
from relayline.machines.turn import TurnResult

from .http11 import Receive, Scope, Send
from .turn_views import EndedTurn, TurnView, attempt_ms

if TYPE_CHECKING:
    from ..relay import Relay
    from .limits import Limiter


class LedgerReport(Protocol):
    def report(self, since: float = 0.0, by: str = "model") -> list[dict[str, Any]]: ...


class ConsoleHost(Protocol):
    """What the console reads of the gateway it is attached to, and nothing more: the relay
    serving now (a reload swaps it), the ledger (None: the gateway keeps none), and whether
    the gateway is shutting down."""

    relay: Relay
    limiter: Limiter
    draining: bool

    @property
    def ledger(self) -> LedgerReport | None: ...

RECENT_TURNS = 200  # kept in memory, newest last; the page shows them all, filtered by outcome
ATTEMPTS_KEPT = 2048  # per profile, for success rate and latency: the window's most recent ones
SSE_TICK_S = 1.0  # how often a stream re-reads state that changes with time alone (time left)
SSE_KEEPALIVE_S = 15.0
# the ledger is re-read for a stream at most this often, and only after new turns
COST_EVERY_S = 5.0
MAX_STREAMS = 16  # concurrent console event streams; more is a misbehaving client
COST_WINDOWS = (("1h", 3600.0), ("24h", 86400.0), ("7d", 7 * 86400.0))
MERMAID = "mermaid-11.17.2.min.js"
STATIC = {
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    MERMAID: "text/javascript; charset=utf-8",
    "mermaid-LICENSE.txt": "text/plain; charset=utf-8",
}
# the page may talk to its own origin only; Mermaid sets inline styles on the SVG it draws
CSP = ("default-src 'none'; script-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "style-src 'self' 'unsafe-inline'; font-src 'self'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")


def edge_counts(spec: Spec) -> list[dict[str, Any]]:
    """Every edge of a lifecycle with how often it fired since the spec was loaded."""
    counts = spec.fired_counts()
    edges = []
    for t in spec.transitions:
        conds = [*t.guards, *(f"!{u}" for u in t.unless)]
        for source in t.sources:
            edges.append({"source": source, "trigger": t.trigger, "dest": t.dest, "guards": conds,
                          "count": counts.get((source, t.trigger, t.dest), 0)})
    return edges


def lifecycle_mermaid(spec: Spec, edges: list[dict[str, Any]]) -> str:
    """Mermaid for one lifecycle, one arrow per (source, transition), labelled with its count.
    Unlike specs/diagrams/*.mmd (one arrow per pair of states), a count belongs to one edge."""
    lines = ["stateDiagram-v2", "  direction LR"]
    lines += [f'  state "{name}" as {name}' for name in spec.states]
    for e in edges:
        label = e["trigger"] + (f" [{' & '.join(e['guards'])}]" if e["guards"] else "")
        lines.append(f"  {e['source']} --> {e['dest']}: {label} ×{e['count']}")
    lines.append(f"  [*] --> {spec.initial}")
    for name, state in spec.states.items():
        if "terminal" in state.tags:
            lines.append(f"  {name} --> [*]")
    # what entering a state does, as `relayline diagram` draws it
    lines += [
        f"  {name} : entry / {', '.join(state.enter)}"
        for name, state in spec.states.items()
        if state.enter
    ]
    return "\n".join(lines) + "\n"


def _left(until: float, now: float) -> float:
    return round(until - now, 1) if until > now else 0.0


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


class Console:
    """The console's state and its HTTP endpoints, attached to one gateway."""

    def __init__(self, gateway: ConsoleHost) -> None:
        self.gateway = gateway
        # the recent turns: each as observed (EndedTurn) until it is first read, then as its view
        self._recent: deque[TurnView | EndedTurn] = deque(maxlen=RECENT_TURNS)
        self._seq = 0
        # per profile: (ended on the trio clock, ok, latency ms) of attempts, pruned to the window
        # and bounded, so a busy gateway's console costs the same as an idle one's
        self._attempts: dict[str, deque[tuple[float, bool, float | None]]] = defaultdict(
            lambda: deque(maxlen=ATTEMPTS_KEPT))
        self._changed = trio.Event()
        self._streams = 0
        self._static: dict[str, bytes] = {}

    @property
    def relay(self) -> Relay:
        return self.gateway.relay  # a reload swaps it: the console shows the one serving now

    # -- what the gateway tells it ----------------------------------------------------------

    def observe(self, turn_id: str, result: TurnResult, latency_s: float,
                ended: float | None = None) -> None:
        """A turn finished (called by the gateway after each turn, once its answer is written), at
        `ended` on trio's clock (None: now). Its view is built when the console first reads it,
        not here: most turns of a busy gateway are never looked at, and a view costs more than
        the rest of this."""
        now = trio.current_time() if ended is None else ended
        self._seq += 1
        self._recent.append(EndedTurn(self._seq, turn_id, result, latency_s, now, time.time()))
        for a in result.attempts:
            if not a.ended_by_consumer:  # (the consumer's end says nothing of the provider)
                self._attempts[a.provider].append((now, a.outcome == "ok", attempt_ms(a, now)))
        if self._streams:
            # wake every open event stream; each re-reads what it shows and sends what changed
            # (with none open, no one waits on the event: it is not replaced every turn)
            self._changed.set()
            self._changed = trio.Event()

    @property
    def turns(self) -> deque[TurnView]:
        """The recent turns' views, newest last (those not read before are built now)."""
        recent = self._recent
        i = len(recent) - 1
        # (built in order: the unread ones are the newest)
        while i >= 0 and type(recent[i]) is EndedTurn:
            i -= 1
        for j in range(i + 1, len(recent)):
            recent[j] = recent[j].view()  # type: ignore[union-attr]
        return recent  # type: ignore[return-value]

    # -- the views --------------------------------------------------------------------------

    def routes(self, now: float) -> list[dict[str, Any]]:
        router = self.relay.router
        config = self.relay.config
        plans: list[tuple[str, str, Plan]] = []
        default = router.default.entries[0].model if router.default.entries else None
        plans.append(("default", "default", self.relay.plan(model=default, gateway=True)))
        for hint in router.domains:
            plans.append(("route", hint, self.relay.plan(model=HINT_PREFIX + hint, gateway=True)))
        for name in router.catalog:
            plans.append(("catalog", name, self.relay.plan(model=name, gateway=True)))
        routing = config.effort_routing
        out = []
        for kind, name, plan in plans:
            allowlist = plan.allowlist
            if (
                routing is not None
                and allowlist is None
                and name in (routing.local_hint, routing.cloud_hint)
            ):
                # what an effort-routed turn to this route may use (an explicit hint is
                # unrestricted)
                localities = ("local",) if name == routing.local_hint else ("local", "cloud")
                allowlist = frozenset(
                    a for a, p in config.providers.items() if p.locality in localities
                )
            entries = []
            for e in plan.entries:
                skip = None
                if allowlist is not None and e.profile not in allowlist:
                    skip = "allowlist"
                elif self.relay.health.cooldown_until(e.profile) > now:
                    skip = "cooldown"
                elif self.relay.health.breaker(e.profile).blocks(now):
                    skip = "breaker"
                entries.append({"profile": e.profile, "model": e.model, "pinned": e.pinned,
                                "price": attrs.asdict(e.price), "skip": skip})
            out.append({"kind": kind, "name": name, "domain": plan.domain,
                        "requested": plan.requested,
                        "allowlist": sorted(allowlist) if allowlist is not None else None,
                        "entries": entries, "warnings": list(plan.warnings)})
        return out

    def health(self, now: float) -> dict[str, Any]:
        config = self.relay.config
        window = config.breaker.window_s
        profiles = []
        for alias in sorted(config.providers):
            breaker = self.relay.health.breaker(alias)
            state = breaker.refresh(now)
            seen = self._attempts[alias]
            while seen and seen[0][0] < now - window:
                seen.popleft()
            latencies = [ms for _, _, ms in seen if ms is not None]
            pool = len(self.relay.router.keys.get(alias, ()))
            profiles.append(
                {
                    "profile": alias,
                    "breaker": state,
                    "breaker_left_s": _left(breaker.open_until, now) if state == "open" else 0.0,
                    "failures": len(breaker.failures),
                    "threshold": config.breaker.failure_threshold,
                    "cooldown_left_s": _left(self.relay.health.cooldown_until(alias), now),
                    "attempts": len(seen),
                    "success_rate": round(sum(ok for _, ok, _ in seen) / len(seen), 4)
                    if seen
                    else None,
                    "latency_p50_ms": _percentile(latencies, 0.5),
                    "latency_p95_ms": _percentile(latencies, 0.95),
                    "key_cursor": self.relay.health.key_cursor(alias) if pool > 1 else None,
                    "key_pool": pool,
                }
            )
        return {"window_s": window, "store": self.store(), "profiles": profiles}

    def store(self) -> dict[str, Any]:
        """Where health lives: this process, or a fleet's shared store (named by host and port
        only: its URL may carry a password)."""
        health = self.relay.health
        where = getattr(health, "where", None)
        if where is None:
            return {"kind": "memory", "shared": False, "state": "this process only"}
        local = getattr(health, "local", False)
        return {"kind": "shared", "shared": True, "where": where,
                "state": "unreachable: serving on local state" if local else "connected",
                "rounds": getattr(health, "rounds", None)}

    def limits(self) -> list[dict[str, Any]]:
        """Named keys' and teams' limits, spend and what is left (gateway/limits.py)."""
        return self.gateway.limiter.view(self.relay.config)

    def lifecycles(self) -> list[dict[str, Any]]:
        out = []
        for name in SPEC_NAMES:
            spec = load_spec(name)
            edges = edge_counts(spec)
            out.append({"name": name, "doc": spec.doc, "edges": edges,
                        "mermaid": lifecycle_mermaid(spec, edges),
                        "fired": sum(e["count"] for e in edges)})
        return out

    def counts(self) -> dict[str, list[int]]:
        """Only the numbers, in edge order: what the event stream sends when they change."""
        return {name: [e["count"] for e in edge_counts(load_spec(name))] for name in SPEC_NAMES}

    async def cost(self) -> dict[str, Any]:
        ledger = self.gateway.ledger
        if ledger is None:
            return {"ledger": False, "windows": {}}
        wall = time.time()

        def report() -> dict[str, Any]:
            return {label: ledger.report(since=wall - seconds) for label, seconds in COST_WINDOWS}

        # a worker thread: a PostgreSQL ledger answers over the network, SQLite from the disk
        return {"ledger": True, "windows": await trio.to_thread.run_sync(report)}

    async def snapshot(self) -> dict[str, Any]:
        cost = await self.cost()
        now = trio.current_time()
        return {"routes": self.routes(now), "health": self.health(now),
                "lifecycles": self.lifecycles(),
                "limits": self.limits(),
                "turns": [t.as_json() for t in self.turns], "cost": cost,
                "recent_limit": RECENT_TURNS}

    # -- HTTP -------------------------------------------------------------------------------

    def _asset(self, name: str) -> bytes:
        try:
            return self._static[name]
        except KeyError:
            data = (
                resources.files("relayline.adapters.gateway").joinpath("static", name).read_bytes()
            )
            self._static[name] = data
            return data

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve a console path (the gateway has already checked the admin key)."""
        method, path = scope["method"], scope["path"]
        if method != "GET":
            await _send(send, 405, b'{"error": {"message": "the console answers GET only"}}',
                        "application/json", [(b"allow", b"GET")])
        elif path == "/admin/":
            await _send(send, 200, self._asset("console.html"), "text/html; charset=utf-8",
                        [(b"content-security-policy", CSP.encode()),
                         (b"cache-control", b"no-cache")])
        elif path == "/admin/console/state":
            await _send(send, 200, json.dumps(await self.snapshot()).encode(), "application/json",
                        [(b"cache-control", b"no-store")])
        elif path == "/admin/console/turns":
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            outcome = query.get("outcome", [None])[0]
            turns = [t.as_json() for t in self.turns if outcome in (None, "", t.outcome)]
            await _send(send, 200, json.dumps({"turns": turns}).encode(), "application/json")
        elif path == "/admin/console/events":
            await self._events(receive, send)
        elif path.startswith("/admin/console/") and path.rsplit("/", 1)[1] in STATIC:
            name = path.rsplit("/", 1)[1]
            # the Mermaid file is named by its version: it may be cached for good
            cache = b"public, max-age=31536000, immutable" if name == MERMAID else b"no-cache"
            await _send(send, 200, self._asset(name), STATIC[name], [(b"cache-control", cache)])
        else:
            await _send(send, 404,
                        json.dumps({"error": {"message": f"no console page at {path}"}}).encode(),
                        "application/json")

    async def _events(self, receive: Receive, send: Send) -> None:
        if self.gateway.draining:
            await _send(send, 503, b'{"error": {"message": "the gateway is shutting down"}}',
                        "application/json")
            return
        if self._streams >= MAX_STREAMS:
            await _send(send, 503, b'{"error": {"message": "too many open console streams"}}',
                        "application/json",
                        [(b"retry-after", b"5")])
            return
        self._streams += 1
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"),
                                    (b"cache-control", b"no-store")]})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_until_disconnect, receive, nursery.cancel_scope)
                await self._push(send)
                nursery.cancel_scope.cancel()
        finally:
            self._streams -= 1

    async def _push(self, send: Send) -> None:
        """Send each part of the state when it differs from what this stream sent last."""
        sent: dict[str, str] = {}
        last_seq = self.turns[-1].seq if self.turns else 0
        quiet_since = trio.current_time()
        cost_seq, cost_at = last_seq, quiet_since
        await send({"type": "http.response.body", "body": b"retry: 2000\n\n", "more_body": True})
        while True:
            if self.gateway.draining:
                # a console must not hold a shutting-down gateway open: end the stream (the page
                # says it lost its connection and retries, and the next gateway answers)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            now = trio.current_time()
            frames = []
            for event, part in (("health", self.health(now)), ("routes", self.routes(now)),
                                ("counts", self.counts()), ("limits", self.limits())):
                data = json.dumps(part, separators=(",", ":"))
                if sent.get(event) != data:
                    sent[event] = data
                    frames.append(f"event: {event}\ndata: {data}\n\n")
            for view in self.turns:
                if view.seq > last_seq:
                    frames.append("event: turn\ndata: "
                                  f"{json.dumps(view.as_json(), separators=(',', ':'))}\n\n")
            if self.turns:
                last_seq = self.turns[-1].seq
            if last_seq != cost_seq and now - cost_at >= COST_EVERY_S:
                cost_seq, cost_at = last_seq, now
                cost = json.dumps(await self.cost(), separators=(",", ":"))
                frames.append(f"event: cost\ndata: {cost}\n\n")
            if not frames and now - quiet_since >= SSE_KEEPALIVE_S:
                frames.append(": keep-alive\n\n")
            if frames:
                quiet_since = now
                await send({"type": "http.response.body", "body": "".join(frames).encode(),
                            "more_body": True})
            changed = self._changed
            with trio.move_on_after(SSE_TICK_S):
                await changed.wait()


async def _until_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _send(send: Send, status: int, body: bytes, content_type: str,
                headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()),
                            (b"x-content-type-options", b"nosniff"),
                            *headers]})
    await send({"type": "http.response.body", "body": body})

"""What a turn leaves behind once its answer is decided: its ledger rows (written before the
answer ends, so a client that saw an answer can find what it cost), the turn observed (the
relay's record, the health view's outcomes, metrics, console, trace, log lines), the access
line, and the attribution a client reads on the answer (x-relayline-* headers, the `relayline`
field)."""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict, deque
from typing import TYPE_CHECKING, Any, Protocol

import trio

from relayline.machines import dropping, wire
from relayline.machines.plan import PlannedEntry
from relayline.machines.turn import TurnResult

from ..logs import event
from ..otel import Tracing
from ..relay import turns_of
from ..stores.schema import LedgerBackend, LedgerUnavailable
from .exchange import Exchange

if TYPE_CHECKING:
    from ..relay import Relay
    from .console import Console
    from .metrics import Metrics

log = logging.getLogger("relayline.gateway")
access_log = logging.getLogger("relayline.access")

# the client's own doing: the access line says enough
QUIET_ERRORS = {"client_error", "context_window"}
MAX_OUTCOMES = 4096  # per profile, for /admin/health's success rate: bounded between reads
# a dropped field's name written as it is: printable ASCII but a space, '"', ',' and '\\'
_PLAIN_FIELD = re.compile(r"[\x21\x23-\x2b\x2d-\x5b\x5d-\x7e]+").fullmatch


class BooksHost(Protocol):
    """What the bookkeeping reads of the gateway as it is now: the relay serving (a reload swaps
    it), and where turns are traced."""

    relay: Relay
    tracing: Tracing


class Bookkeeping:
    """The ledger writes, the turn's observation and the access line of one gateway, and each
    profile's recent attempt outcomes that the health view reads."""

    def __init__(self, host: BooksHost, ledger: LedgerBackend | None, metrics: Metrics,
                 console: Console, families: dict[str, str]) -> None:
        self.host = host
        self.ledger = ledger
        self.metrics = metrics
        self.console = console
        self.families = families  # profile alias -> family, for the trace's attributes
        self._outcomes: dict[str, deque[tuple[float, bool]]] = defaultdict(deque)
        self._breakers: dict[str, str] = {}

    def outcomes(self, alias: str, since: float) -> deque[tuple[float, bool]]:
        """A profile's recent attempts as (ended, ok), those before `since` forgotten."""
        seen = self._outcomes[alias]
        while seen and seen[0][0] < since:
            seen.popleft()
        return seen

    def note_breakers(self, states: dict[str, str]) -> None:
        """Each profile's breaker state (alias -> state): a change since the last is logged."""
        for alias, state in states.items():
            before = self._breakers.get(alias, "closed")
            if state != before:
                event(log, logging.WARNING, "breaker_transition",
                      **{"profile": alias, "from": before, "to": state})
            self._breakers[alias] = state

    async def record(self, exchange: Exchange, turn_id: str, result: TurnResult) -> None:
        """The turn's ledger rows, committed before its answer completes: a client that saw an
        answer can find what it cost."""
        if self.ledger is not None and result.ledger:
            # the answer was made and the providers bill it: the client still gets it; the
            # operator gets the lost rows in the log (and /readyz reports the ledger)
            lost = "ledger_write_error request_id=%s turn=%s rows=%d cost_usd=%.8f"
            try:
                who = exchange.caller
                await self.ledger.record(turn_id, result, client=exchange.client,
                                         key=who.name if who else "", team=who.team if who else "")
            except LedgerUnavailable as exc:  # an outage: its reason, not a trace per answer
                log.error(lost + " error=ledger_timeout waited_s=%g", exchange.request_id,
                          exchange.turn,
                          len(result.ledger), result.cost_usd, exc.waited_s)
            except Exception:
                log.exception(lost, exchange.request_id, exchange.turn, len(result.ledger),
                              result.cost_usd)

    def after(self, exchange: Exchange) -> None:
        """What the client does not wait for, done once its answer's bytes are written (or it
        went away): the turn observed (relay, health view, metrics, console, trace, log lines),
        then the access line and the request metrics. The answer is out: a failure here is
        logged, never the request's error."""
        try:
            turn, ran_on, result = exchange.turn, exchange.relay, exchange.result
            if turn is not None and ran_on is not None and result is not None:
                self._observe_turn(exchange, turn, ran_on, result)
        except Exception:
            log.exception("turn_bookkeeping_error request_id=%s turn=%s", exchange.request_id,
                          exchange.turn)
        try:
            self._account(exchange)
        except Exception:
            log.exception("access_bookkeeping_error request_id=%s", exchange.request_id)

    def _observe_turn(self, exchange: Exchange, turn_id: str, ran_on: Relay,
                      result: TurnResult) -> None:
        started, now = exchange.turn_started, exchange.turn_ended
        turns_of(ran_on).observe(result)  # the relay the turn ran on (a reload may have retired it)
        relay = self.host.relay
        horizon = now - relay.config.breaker.window_s
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
        self.console.observe(turn_id, result, now - started, now)
        self.host.tracing.turn(result, started=started, ended=now, request_id=exchange.request_id,
                               families=self.families)
        if result.fallback:
            event(log, logging.WARNING, "fallback", request_id=exchange.request_id,
                  requested=result.requested,
                  served=result.served.label if result.served else None,
                  attempts=len(result.attempts))
        if result.outcome in ("error", "interrupted") and result.error not in QUIET_ERRORS:
            event(log, logging.WARNING, "turn_failed", request_id=exchange.request_id,
                  outcome=result.outcome,
                  reason=result.error, requested=result.requested, attempts=len(result.attempts))
        health = relay.health
        self.note_breakers({alias: health.breaker(alias).refresh(now) for alias in tried})

    def _account(self, exchange: Exchange) -> None:
        """The access line and the request metrics, once the response ended (or the client left)."""
        # the client went away first
        status = exchange.status if exchange.status is not None else 499
        self.metrics.request(exchange.path, status)
        result = exchange.result
        if result is not None and exchange.first_byte is not None and result.served is not None:
            self.metrics.first_token(result.served.profile, result.served.model,
                                     exchange.first_byte - exchange.started)
        if not access_log.isEnabledFor(logging.INFO):
            return  # `--log-level warning`: the line is not built at all (nor its clock read)
        now = trio.current_time()
        fields = {
            "method": exchange.method,
            "path": exchange.path[:200],
            "status": status,
            "latency_ms": round((now - exchange.started) * 1000, 2),
            "ttfb_ms": round((exchange.first_byte - exchange.started) * 1000, 2)
            if exchange.first_byte
            else None,
            "request_id": exchange.request_id,
            "client": exchange.client or None,
            "turn": exchange.turn,
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
                output_tokens=sum(r.output_tokens for r in result.ledger),
                cost_usd=round(result.cost_usd, 8))
            if result.partial_from is not None:  # nothing accepted: whose output the client saw
                fields["partial_from"] = result.partial_from.label
        access_log.info("access", extra={"fields": fields})


def attribution(result: TurnResult) -> list[tuple[bytes, bytes]]:
    """The x-relayline-* headers of a whole answer: who was asked, who served, at what cost."""
    return [
        (b"x-relayline-requested", result.requested.encode()),
        (b"x-relayline-served", (result.served.label if result.served else "none").encode()),
        (b"x-relayline-attempts", str(len(result.attempts)).encode()),
        (b"x-relayline-fallback", b"true" if result.fallback else b"false"),
        (b"x-relayline-cost-usd", f"{result.cost_usd:.8f}".encode()),
    ]


def relayline_field(result: TurnResult) -> dict[str, Any]:
    """The `relayline` field of an answer's body: the attribution, with each attempt and skip."""
    return {
        "requested": result.requested,
        "served": result.served.label if result.served else None,
        "fallback": result.fallback,
        "notice": result.notice,
        "cost_usd": result.cost_usd,
        "attempts": [str(a) for a in result.attempts],
        "skipped": [str(s) for s in result.skipped],
    }


def dropped_header(request: wire.Request | None,
                   entry: PlannedEntry | None) -> list[tuple[bytes, bytes]]:
    """x-relayline-dropped: the fields `drop_unsupported_params` dropped for the serving entry.
    A name is the client's own JSON key: one that is not plain header text (a line feed, a NUL,
    a comma, non-ASCII) is written as a JSON string in ASCII, so the list stays one legal
    header line that still names it."""
    if entry is None or request is None:
        return []
    provider = entry.provider
    dropped = dropping.droppable(request, provider.family, provider.capabilities)
    if not wire.passes_through(request, provider.family, provider.capabilities):
        dropped += request.withdrawn  # built-in tools a translating entry did not offer the model
    if not dropped:
        return []
    names = [
        name if _PLAIN_FIELD(name) else json.dumps(name).replace("\x7f", "\\u007f")
        for name in dropped
    ]
    return [(b"x-relayline-dropped", ", ".join(names).encode())]

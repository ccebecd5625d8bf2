"""Admission: a named key's request against its key's and its team's limits, before anything is
sent upstream, and its settlement when the turn ends.

Every chat-like request of a named key passes `Limiter.admit` once (gateway/chat.py,
`ChatPath.serve`). The counting is a store's (stores/limits.py): the fleet's Redis when `[health]
store` names one, else this process's memory. A budget's spend is seeded once per period from the
ledger (the turns before this process started, or billed by other workers before the store knew the
key). When the shared store does not answer, `[gateway] limits_on_store_error` decides: "local"
counts in this process against its share of each limit (limit / workers), "closed" refuses, "open"
admits; the outage and its end are logged once each.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial
from typing import Any

import attrs
import trio

from relayline.machines.config import Config, GatewayKey, GatewayTeam
from relayline.machines.health import HealthStore
from relayline.machines.limits import (
    Admission,
    Budget,
    Refusal,
    ScopeLimits,
    Standing,
    estimate_tokens,
    limits_of,
    period_start,
    scopes_of,
)
from relayline.machines.turn import TurnResult
from relayline.machines.wire import Request

from ..stores.health import RedisHealth
from ..stores.limits import AdmitOutcome, LimitsStore, MemoryLimits, RedisLimits, Ticket
from ..stores.schema import LedgerBackend

log = logging.getLogger("relayline.limits")

LEDGER_WAIT_S = 5.0  # a budget's first read of the ledger waits this long, then counts from 0
RETRY_S = 1.0  # while the shared store is down, how often admission tries it again


@attrs.frozen
class Admitted:
    """A request admitted: its ticket in the store that counted it (None: counted nowhere, the
    store being down with limits_on_store_error = "open"), the scopes' standing, and its
    admission's lifecycle (specs/admission.toml), settled when its turn ends."""

    ticket: Ticket | None
    store: LimitsStore | None
    standings: tuple[Standing, ...]
    admission: Admission = attrs.field(factory=Admission, eq=False)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's remaining headers for the tighter scope of each limit, and the budget left."""
        out: list[tuple[bytes, bytes]] = []
        for kind, left, reset, limit in (("requests", "requests_left", "reset_requests_s", "rpm"),
                                         ("tokens", "tokens_left", "reset_tokens_s", "tpm")):
            bound = [s for s in self.standings if getattr(s, left) is not None]
            if bound:
                tight = min(bound, key=partial(_standing_left, left))
                out += [
                    (
                        f"x-ratelimit-limit-{kind}".encode(),
                        str(getattr(tight.limits, limit)).encode(),
                    ),
                    (f"x-ratelimit-remaining-{kind}".encode(), str(getattr(tight, left)).encode()),
                    (
                        f"x-ratelimit-reset-{kind}".encode(),
                        reset_text(getattr(tight, reset)).encode(),
                    ),
                ]
        budgets = [s.budget_left for s in self.standings if s.budget_left is not None]
        if budgets:
            out.append((b"x-relayline-budget-remaining-usd", f"{min(budgets):.6f}".encode()))
        return out


def _standing_left(left: str, standing: Standing) -> int:
    """What a standing says is left of one limit (`left`: requests_left or tokens_left)."""
    value: int = getattr(standing, left)
    return value


def reset_text(seconds: float) -> str:
    """A reset time the way OpenAI writes it: 20ms, 6s, 1m0s."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = math.ceil(seconds)
    return f"{whole}s" if whole < 60 else f"{whole // 60}m{whole % 60}s"


def refusal_headers(refusal: Refusal) -> list[tuple[bytes, bytes]]:
    """Retry-After and OpenAI's headers for the limit that refused; a spent budget, or a request
    too large for any window, is not to be retried as it is."""
    out: list[tuple[bytes, bytes]] = []
    if refusal.retry_after_s is not None:
        out.append((b"retry-after", str(max(1, math.ceil(refusal.retry_after_s))).encode()))
    if refusal.limit == "budget" or refusal.retry_after_s is None:
        out.append((b"x-should-retry", b"false"))
    kind = {"rpm": "requests", "tpm": "tokens"}.get(refusal.limit)
    scope = refusal.scope
    if kind is not None and scope is not None:
        reset = reset_text(refusal.retry_after_s) if refusal.retry_after_s is not None else "0s"
        out += [(f"x-ratelimit-limit-{kind}".encode(), str(getattr(scope, refusal.limit)).encode()),
                (f"x-ratelimit-remaining-{kind}".encode(), b"0"),
                (f"x-ratelimit-reset-{kind}".encode(), reset.encode())]
    return out


def output_default(config: Config) -> int | None:
    """The most output tokens a profile sets (`max_output_tokens`): a request without max_tokens
    is estimated at that, since admission comes before the turn picks its profile."""
    values = [p.max_output_tokens for p in config.providers.values() if p.max_output_tokens]
    return max(values) if values else None


class Limiter:
    """The gateway's one admission point for named keys' limits."""

    def __init__(self, health: HealthStore, ledger: LedgerBackend | None, workers: int = 1) -> None:
        self.shared = RedisLimits(health) if isinstance(health, RedisHealth) else None
        self.local = MemoryLimits()
        self.ledger = ledger
        self.workers = max(1, workers)
        self.down_since: float | None = None
        self._retry_at = 0.0
        self._output: tuple[Config | None, int | None] = (None, None)  # a config's `output_default`
        self.standings: dict[str, Standing] = {}  # each scope's latest, for the console and metrics
        self._budgets: dict[str, Budget] = {}  # each budget's lifecycle as this worker sees it

    @property
    def where(self) -> str:
        return self.shared.where if self.shared is not None else "memory"

    async def admit(self, config: Config, key_name: str,
                    request: Request) -> Admitted | Refusal | None:
        """None: the key has no limits. Else the request is admitted (and counted) or refused."""
        scopes = scopes_of(config.gateway, key_name)
        if not scopes:
            return None
        if self._output[0] is not config:  # (once per config: a reload makes a new one)
            self._output = (config, output_default(config))
        estimate = estimate_tokens(request, self._output[1])
        if self.shared is None:
            return await self._admit_locally(scopes, estimate)
        if not self._resting():
            try:
                return self._noted(await self._admit_in(self.shared, scopes, estimate, 1.0),
                                   self.shared)
            except Exception as exc:  # the store's loss, whatever its client raised
                self._store_lost(exc,
                                 "admitting (limits_on_store_error = "
                                 f"{config.gateway.limits_on_store_error})")
        mode = config.gateway.limits_on_store_error
        if mode == "open":
            return self._open()
        if mode == "closed":
            return self._noted((self._closed(), None, []), None)
        return await self._admit_locally(scopes, estimate)

    async def _admit_locally(self, scopes: tuple[ScopeLimits, ...],
                             estimate: int) -> Admitted | Refusal:
        """This process alone, against its share of each limit (a fleet of `workers`)."""
        local = tuple(scope.share(self.workers) for scope in scopes)
        return self._noted(await self._admit_in(self.local, local, estimate, 1.0 / self.workers),
                           self.local)

    def _open(self) -> Admitted | Refusal:
        """Admitted without counting: the shared store is down and limits_on_store_error = open."""
        return self._noted((None, None, []), None)

    def _resting(self) -> bool:
        """The shared store failed less than RETRY_S ago: not tried again yet (a store that hangs
        would cost every request its timeout)."""
        return self.down_since is not None and trio.current_time() < self._retry_at

    def _closed(self) -> Refusal:
        return Refusal("store", None, 1.0,
                       f"the limits store at {self.where} does not answer and this gateway "
                       "refuses limited keys meanwhile (limits_on_store_error = closed)")

    async def _admit_in(self, store: LimitsStore, scopes: tuple[ScopeLimits, ...], estimate: int,
                        part: float) -> AdmitOutcome:
        wall = time.time()
        for scope in scopes:
            if not store.seeded(scope, wall):
                await store.seed(scope, wall, part * await self._ledger_spend(scope, wall))
        result = await store.admit(scopes, estimate)
        if store is self.shared and self.down_since is not None:
            log.warning("limits_store_reachable store=%s after_s=%.1f", self.where,
                        trio.current_time() - self.down_since)
            self.down_since = None
        return result

    def _noted(self, outcome: AdmitOutcome, store: LimitsStore | None) -> Admitted | Refusal:
        refusal, ticket, standings = outcome
        admission = Admission()
        if admission.judge(refusal) == "refused" and refusal is not None:
            return refusal
        for standing in standings:
            self.standings[standing.limits.id] = standing
            budget = self._budgets.get(standing.limits.id)
            # (moved by another worker, or new)
            if budget is None or budget.spend_usd != standing.spend_usd:
                self._note_budget(standing.limits, standing.spend_usd)
        return Admitted(ticket, store, tuple(standings), admission)

    async def _ledger_spend(self, scope: ScopeLimits, wall: float) -> float:
        """What the ledger says the scope spent in its current period (0 without a ledger)."""
        ledger = self.ledger
        if ledger is None:
            return 0.0
        since = period_start(wall, scope.budget_period)
        with trio.move_on_after(LEDGER_WAIT_S):
            return await trio.to_thread.run_sync(ledger.spend, scope.scope, scope.name, since,
                                                 abandon_on_cancel=True)
        log.warning("budget_seed_unavailable scope=%s waited_s=%g counting_from=0", scope.id,
                    LEDGER_WAIT_S)
        return 0.0

    def _store_lost(self, exc: BaseException, doing: str) -> None:
        """The shared store did not answer: said once per outage (its end is said in
        `_admit_in`)."""
        self._retry_at = trio.current_time() + RETRY_S
        if self.down_since is None:
            self.down_since = trio.current_time()
            log.warning("limits_store_unreachable store=%s error=%s while=%r", self.where,
                        type(exc).__name__, doing)

    async def settle(self, admitted: Admitted, result: TurnResult | None) -> None:
        """The turn's billed tokens and cost replace its estimate (nothing billed: 0)."""
        admitted.admission.settle()
        if admitted.ticket is None or admitted.store is None:
            return
        tokens = (
            sum(r.input_tokens + r.output_tokens for r in result.ledger)
            if result is not None
            else 0
        )
        cost = result.cost_usd if result is not None else 0.0
        try:
            await admitted.store.settle(admitted.ticket, tokens, cost)
        except Exception as exc:
            self._store_lost(exc, "settling (the turn's tokens stay at its estimate)")
            return
        for scope in admitted.ticket.scopes:
            known = self.standings.get(scope.id)
            if known is not None and known.limits.budget_usd is not None:
                known = self.standings[scope.id] = attrs.evolve(
                    known, spend_usd=known.spend_usd + cost
                )
                self._note_budget(scope, known.spend_usd)

    def view(self, config: Config) -> list[dict[str, Any]]:
        """Each configured key's and team's limits and what the latest admission found left of
        them (None: not seen since this process started), for the console and the metrics."""
        out: list[dict[str, Any]] = []
        named: list[tuple[str, GatewayKey | GatewayTeam]] = [
            *(("key", k) for k in config.gateway.keys),
            *(("team", t) for t in config.gateway.teams)]
        for scope, item in named:
            limits = limits_of(scope, item)
            if not limits.limited:
                continue
            seen = self.standings.get(limits.id)
            out.append(
                {
                    "scope": scope,
                    "name": item.name,
                    "team": getattr(item, "team", None),
                    "rpm": limits.rpm,
                    "tpm": limits.tpm,
                    "budget_usd": limits.budget_usd,
                    "budget_period": limits.budget_period,
                    "requests_left": seen.requests_left if seen else None,
                    "tokens_left": seen.tokens_left if seen else None,
                    "spend_usd": seen.spend_usd if seen else None,
                    "budget_left_usd": seen.budget_left if seen else None,
                    "budget_state": budget.state
                    if (budget := self._budgets.get(limits.id))
                    else "open",
                }
            )
        return out

    def _note_budget(self, scope: ScopeLimits, spend: float) -> None:
        """A budget's state change (specs/budget.toml) is logged once, when this worker sees it."""
        if scope.budget_usd is None:
            return
        budget = self._budgets.get(scope.id)
        wall = time.time()
        # (a reload changed the budget: it starts afresh)
        if budget is None or budget.limits != scope:
            budget = self._budgets[scope.id] = Budget(scope, wall)
        before = budget.state
        state = budget.observe(spend, wall)
        if state != before:
            log.warning("budget_state scope=%s from=%s to=%s spend_usd=%.6f budget_usd=%g",
                        scope.id, before, state,
                        spend, scope.budget_usd)

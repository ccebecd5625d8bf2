"""The arithmetic of a named key's and a team's limits: sliding one-minute windows and budget
periods.

Requests per minute and tokens per minute are sliding windows: a request is admitted only when
the requests (or tokens) admitted in the 60 s before it, plus its own, stay within the limit, so
no interval of 60 s ever holds more than the limit. A request's tokens are an estimate when it
is admitted and what the providers billed once its turn ends (settlement). A budget is spend
per calendar period in UTC. Time comes in as a number, wall-clock seconds, so the same code runs
on the real clock, in a shared store's script (which does the same sums) and under Hypothesis.
"""

from __future__ import annotations

import calendar
import functools
import math
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta

import attrs

from .config import Gateway, GatewayKey, GatewayTeam
from .engine import load_spec
from .wire import Request

WINDOW_S = 60.0
CHARS_PER_TOKEN = 4  # a tokenizer-free estimate: about four characters a token in English text
DEFAULT_OUTPUT_TOKENS = 4096  # a request with no max_tokens, on a profile without max_output_tokens
WARN_AT = 0.8  # the share of a budget past which it is "warned" (specs/budget.toml)


@attrs.frozen
class ScopeLimits:
    """One key's or one team's limits; `scope` is "key" or "team"."""

    scope: str
    name: str
    rpm: int | None = None
    tpm: int | None = None
    budget_usd: float | None = None
    budget_period: str = "month"

    @property
    def id(self) -> str:
        return f"{self.scope}:{self.name}"

    @property
    def limited(self) -> bool:
        return self.rpm is not None or self.tpm is not None or self.budget_usd is not None

    def share(self, workers: int) -> ScopeLimits:
        """This worker's part of the limits when a fleet of `workers` cannot share a store."""
        if workers <= 1:
            return self
        budget = None if self.budget_usd is None else self.budget_usd / workers
        return attrs.evolve(self, rpm=_part(self.rpm, workers), tpm=_part(self.tpm, workers),
                            budget_usd=budget)


def _part(limit: int | None, workers: int) -> int | None:
    return None if limit is None else max(1, limit // workers)


def limits_of(scope: str, item: GatewayKey | GatewayTeam) -> ScopeLimits:
    """A configured key's or team's limits as admission counts them."""
    return ScopeLimits(scope, item.name, item.rpm, item.tpm, item.budget_usd, item.budget_period)


@functools.lru_cache(maxsize=1024)
def scopes_of(gateway: Gateway, key_name: str) -> tuple[ScopeLimits, ...]:
    """The limits a named key's request is admitted against: the key's, then its team's (only
    those that set a limit). Cached: every request of a key asks, and a config is a value."""
    key = next((k for k in gateway.keys if k.name == key_name), None)
    if key is None:
        return ()
    found = [limits_of("key", key)]
    team = next((t for t in gateway.teams if t.name == key.team), None)
    if team is not None:
        found.append(limits_of("team", team))
    return tuple(s for s in found if s.limited)


def estimate_tokens(request: Request, output_default: int | None) -> int:
    """Input tokens (every text part, about CHARS_PER_TOKEN characters each, and a token per
    message) plus the most output the turn may produce: `max_tokens`, else the profile's
    default, else DEFAULT_OUTPUT_TOKENS."""
    chars = sum(len(part.text or "") for message in request.messages for part in message.content)
    chars += sum(len(tool.name) + len(tool.description) + len(str(tool.parameters))
                 for tool in request.tools)
    output = request.max_tokens or output_default or DEFAULT_OUTPUT_TOKENS
    return math.ceil(chars / CHARS_PER_TOKEN) + len(request.messages) + output


def period_start(wall: float, period: str) -> float:
    """The start, in epoch seconds, of the calendar period (UTC) that holds `wall`."""
    return _period_start_of_day(int(wall // 86400), period)


@functools.lru_cache(maxsize=64)
def _period_start_of_day(day_number: int, period: str) -> float:
    """The period's start for a UTC day (days since the epoch): each request of a budgeted key
    asks, and the answer changes once a day."""
    day = datetime.fromtimestamp(day_number * 86400, UTC)
    if period == "day":
        start = day
    elif period == "week":
        start = day - timedelta(days=day.weekday())  # from Monday
    else:
        start = day.replace(day=1)
    return start.timestamp()


def period_end(wall: float, period: str) -> float:
    """The end of the period that holds `wall` (the next one's start)."""
    start = datetime.fromtimestamp(period_start(wall, period), UTC)
    if period == "day":
        end = start + timedelta(days=1)
    elif period == "week":
        end = start + timedelta(days=7)
    else:
        end = start + timedelta(days=calendar.monthrange(start.year, start.month)[1])
    return end.timestamp()


def window_wait(entries: Iterable[tuple[float, int]], now: float, limit: int,
                need: int) -> float | None:
    """How long until `need` more fits under `limit` in the window ending at `now`, given the
    window's entries (admitted at, weight) oldest first: 0 when it fits now, None when it never
    can (`need` alone is over the limit)."""
    if need > limit:
        return None
    live = [(at, weight) for at, weight in entries if at > now - WINDOW_S]
    used = sum(weight for _, weight in live)
    if used + need <= limit:
        return 0.0
    for at, weight in live:
        used -= weight
        if used + need <= limit:
            return at + WINDOW_S - now
    return WINDOW_S  # (not reached: every entry gone leaves need <= limit)


@attrs.frozen
class Standing:
    """A scope's use as admission found it, the admitted request included when it was admitted:
    what the remaining headers and the console say."""

    limits: ScopeLimits
    requests: int = 0
    tokens: int = 0
    spend_usd: float = 0.0
    reset_requests_s: float = 0.0  # until the oldest request leaves the window
    reset_tokens_s: float = 0.0

    @property
    def requests_left(self) -> int | None:
        return None if self.limits.rpm is None else max(0, self.limits.rpm - self.requests)

    @property
    def tokens_left(self) -> int | None:
        return None if self.limits.tpm is None else max(0, self.limits.tpm - self.tokens)

    @property
    def budget_left(self) -> float | None:
        budget = self.limits.budget_usd
        return None if budget is None else max(0.0, budget - self.spend_usd)


@attrs.frozen
class Refusal:
    """Why a request was not admitted: the limit ("rpm" | "tpm" | "budget" | "store"), the
    scope that refused it, and how long until it would be admitted (None: never as it is)."""

    limit: str
    scope: ScopeLimits | None
    retry_after_s: float | None
    message: str

    @property
    def code(self) -> str:
        return "budget_exceeded" if self.limit == "budget" else "rate_limit_exceeded"


def judge(limits: ScopeLimits, entries: Sequence[tuple[float, int]], spend: float, estimate: int,
          now: float) -> Refusal | None:
    """Whether one scope admits a request estimated at `estimate` tokens at `now`: its window's
    (time, tokens) per request, oldest first, and its spend in the current period."""
    if limits.budget_usd is not None and spend >= limits.budget_usd:
        return Refusal("budget", limits, period_end(now, limits.budget_period) - now,
                       f"the {limits.scope} {limits.name!r} has spent its budget of "
                       f"${limits.budget_usd:g} for this {limits.budget_period} (UTC)")
    if limits.rpm is not None:
        wait = window_wait(((at, 1) for at, _ in entries), now, limits.rpm, 1)
        if wait:
            return Refusal("rpm", limits, wait,
                           f"the {limits.scope} {limits.name!r} is over its limit of "
                           f"{limits.rpm} requests per minute")
    if limits.tpm is not None:
        wait = window_wait(entries, now, limits.tpm, estimate)
        if wait is None:
            return Refusal("tpm", limits, None,
                           f"the request (about {estimate} tokens with its max output) is larger "
                           f"than the {limits.scope} {limits.name!r}'s limit of "
                           f"{limits.tpm} tokens per minute")
        if wait:
            return Refusal("tpm", limits, wait,
                           f"the {limits.scope} {limits.name!r} is over its limit of "
                           f"{limits.tpm} tokens per minute")
    return None


class Budget:
    """One scope's budget through its periods, executing specs/budget.toml: each spend it is
    told of moves it (open, warned, spent), and a new period opens it again."""

    __slots__ = ("limits", "spend_usd", "period", "life")

    def __init__(self, limits: ScopeLimits, wall: float) -> None:
        self.limits = limits
        self.spend_usd = 0.0
        self.period = period_start(wall, limits.budget_period)
        self.life = load_spec("budget").start(history_limit=16)

    @property
    def state(self) -> str:
        return self.life.state

    @property
    def warning_reached(self) -> bool:
        budget = self.limits.budget_usd
        return budget is not None and self.spend_usd >= WARN_AT * budget

    @property
    def budget_reached(self) -> bool:
        return self.limits.budget_usd is not None and self.spend_usd >= self.limits.budget_usd

    def observe(self, spend_usd: float, wall: float) -> str:
        """The period's spend as of `wall`; the state it leaves the budget in."""
        start = period_start(wall, self.limits.budget_period)
        if start != self.period:
            self.period = start
            self.life.fire("period_end")
        self.spend_usd = spend_usd
        self.life.fire("spend", self)
        return self.life.state


class Admission:
    """One request's admission, executing specs/admission.toml: judged once (counted or
    refused), then settled when its turn ends."""

    __slots__ = ("life", "fits")

    def __init__(self) -> None:
        self.life = load_spec("admission").start(history_limit=4)
        self.fits = False

    @property
    def state(self) -> str:
        return self.life.state

    def judge(self, refusal: Refusal | None) -> str:
        self.fits = refusal is None
        self.life.fire("judge", self)
        return self.life.state

    def settle(self) -> None:
        self.life.fire("settle")

"""Where the windows and the spend of named keys and teams are counted: in this process
(`MemoryLimits`) or in the fleet's Redis (`RedisLimits`), with the same arithmetic
(machines/limits.py).

Admission and settlement are each one atomic step in the store: every scope of a request (its
key's and its team's) is checked and, only when all admit it, counted, so N workers sharing one
store admit what one would. A window is the admitted requests of the last 60 s, each with its
tokens (the estimate, then what was billed); a scope's spend in a budget period is seeded once
from the ledger and grows with each settled turn. A settlement for a period whose spend was
never seeded leaves it to the ledger, which already holds the turn's rows when it is settled.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from relayline.machines.limits import (
    WINDOW_S,
    Refusal,
    ScopeLimits,
    Standing,
    judge,
    period_end,
    period_start,
)

if TYPE_CHECKING:
    from .health import RedisHealth


@attrs.frozen
class Ticket:
    """An admitted request as the store counted it: what its settlement corrects."""

    id: str
    scopes: tuple[ScopeLimits, ...]
    estimate: int


def spend_key(limits: ScopeLimits, wall: float) -> str:
    """The name of a scope's spend in the budget period that holds `wall` ("" without a budget)."""
    if limits.budget_usd is None:
        return ""
    return f"{limits.id}@{int(period_start(wall, limits.budget_period))}"


class _Window:
    """One scope's admitted requests of the last WINDOW_S: [admitted at, ticket id, tokens]."""

    __slots__ = ("entries", "by_id", "tokens")

    def __init__(self) -> None:
        self.entries: deque[list[Any]] = deque()
        self.by_id: dict[str, list[Any]] = {}
        self.tokens = 0

    def prune(self, now: float) -> None:
        entries = self.entries
        while entries and entries[0][0] <= now - WINDOW_S:
            _, ticket, tokens = entries.popleft()
            del self.by_id[ticket]
            self.tokens -= tokens

    def standing(self, limits: ScopeLimits, spend: float, now: float) -> Standing:
        oldest = self.entries[0][0] + WINDOW_S - now if self.entries else 0.0
        return Standing(limits, len(self.entries), self.tokens, spend, oldest, oldest)


# what a store's admission answers: the refusal (None: admitted), the ticket that counted it
# (None: counted nowhere), and each scope's standing
AdmitOutcome = tuple[Refusal | None, Ticket | None, list[Standing]]


class LimitsStore(Protocol):
    """Where named keys' windows and spend are counted: this process (`MemoryLimits`) or a
    fleet's shared store (`RedisLimits`)."""

    def seeded(self, scope: ScopeLimits, wall: float) -> bool: ...

    async def seed(self, scope: ScopeLimits, wall: float, amount: float) -> None: ...

    async def admit(self, scopes: Sequence[ScopeLimits], estimate: int) -> AdmitOutcome: ...

    async def settle(self, ticket: Ticket, tokens: int, cost_usd: float) -> None: ...


class MemoryLimits:
    """The windows and spend of one process. Synchronous underneath (`admit_at`, `settle_at`)
    so that a property test can drive it on its own clock; the gateway awaits `admit`."""

    where = "memory"

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._windows: dict[str, _Window] = {}
        self._spend: dict[str, float] = {}
        self._ids = itertools.count()

    def _window(self, scope: ScopeLimits) -> _Window:
        window = self._windows.get(scope.id)
        if window is None:
            window = self._windows[scope.id] = _Window()
        return window

    def seeded(self, scope: ScopeLimits, wall: float) -> bool:
        key = spend_key(scope, wall)
        return not key or key in self._spend

    async def seed(self, scope: ScopeLimits, wall: float, amount: float) -> None:
        key = spend_key(scope, wall)
        if key:
            self._spend.setdefault(key, amount)

    async def admit(self, scopes: Sequence[ScopeLimits],
                    estimate: int) -> tuple[Refusal | None, Ticket | None,
                                                                                 list[Standing]]:
        return self.admit_at(scopes, estimate, self.clock())

    def admit_at(self, scopes: Sequence[ScopeLimits], estimate: int, now: float
                 ) -> tuple[Refusal | None, Ticket | None, list[Standing]]:
        windows = [self._window(scope) for scope in scopes]
        for scope, window in zip(scopes, windows, strict=True):
            window.prune(now)
            spend = self._spend.get(spend_key(scope, now), 0.0)
            refusal = judge(scope, [(e[0], e[2]) for e in window.entries], spend, estimate,
                            now) if _over(scope, window, spend, estimate) else None
            if refusal is not None:
                return refusal, None, []
        ticket = Ticket(f"m{next(self._ids)}", tuple(scopes), estimate)
        for window in windows:
            entry = [now, ticket.id, estimate]
            window.entries.append(entry)
            window.by_id[ticket.id] = entry
            window.tokens += estimate
        return None, ticket, [w.standing(s, self._spend.get(spend_key(s, now), 0.0), now)
                              for s, w in zip(scopes, windows, strict=True)]

    async def settle(self, ticket: Ticket, tokens: int, cost_usd: float) -> None:
        self.settle_at(ticket, tokens, cost_usd, self.clock())

    def settle_at(self, ticket: Ticket, tokens: int, cost_usd: float, now: float) -> None:
        for scope in ticket.scopes:
            entry = self._window(scope).by_id.get(ticket.id)
            if entry is not None:  # (a turn longer than the window has left it already)
                self._window(scope).tokens += tokens - entry[2]
                entry[2] = tokens
            key = spend_key(scope, now)
            if key in self._spend:
                self._spend[key] += cost_usd

    def standing(self, scope: ScopeLimits) -> Standing:
        now = self.clock()
        window = self._window(scope)
        window.prune(now)
        return window.standing(scope, self._spend.get(spend_key(scope, now), 0.0), now)


def _over(scope: ScopeLimits, window: _Window, spend: float, estimate: int) -> bool:
    """Whether any of the scope's limits is reached (the cheap test before `judge`'s sums)."""
    return ((scope.budget_usd is not None and spend >= scope.budget_usd)
            or (scope.rpm is not None and len(window.entries) >= scope.rpm)
            or (scope.tpm is not None and window.tokens + estimate > scope.tpm))


# KEYS: none (standalone Redis, as the health script). ARGV: prefix, ticket id, estimate, n, then
# per scope: name, rpm, tpm, budget ("" for none), spend key (`spend_key`, "" for none). Returns the
# server's time, then either "ok" and per scope: requests, tokens, spend, oldest request's time; or
# "refused", the scope's index (1-based), its spend, and its window's (time, tokens) oldest first.
ADMIT = """
local pfx, id, est, n = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local horizon = now - 60
local ttl = 61
local keys = {}
local i = 5
for s = 1, n do
  local name = ARGV[i]
  keys[s] = {w = pfx..'w:'..name, t = pfx..'t:'..name, n = pfx..'n:'..name,
             rpm = tonumber(ARGV[i + 1]), tpm = tonumber(ARGV[i + 2]),
             budget = tonumber(ARGV[i + 3]), spend = ARGV[i + 4]}
  i = i + 5
end
for s = 1, n do
  local k = keys[s]
  local gone = redis.call('ZRANGEBYSCORE', k.w, '-inf', horizon)
  local at = 1
  while at <= #gone do
    local chunk = {unpack(gone, at, math.min(at + 999, #gone))}
    local sum = 0
    for _, v in ipairs(redis.call('HMGET', k.t, unpack(chunk))) do
      sum = sum + (tonumber(v) or 0)
    end
    redis.call('DECRBY', k.n, sum)
    redis.call('HDEL', k.t, unpack(chunk))
    at = at + 1000
  end
  redis.call('ZREMRANGEBYSCORE', k.w, '-inf', horizon)
  k.count = redis.call('ZCARD', k.w)
  k.used = tonumber(redis.call('GET', k.n) or '0')
  k.spent = 0
  if k.spend ~= '' then k.spent = tonumber(redis.call('GET', pfx..'s:'..k.spend) or '0') end
  if (k.budget and k.spent >= k.budget) or (k.rpm and k.count >= k.rpm)
      or (k.tpm and k.used + est > k.tpm) then
    local out = {tostring(now), 'refused', tostring(s), tostring(k.spent)}
    local ids = redis.call('ZRANGE', k.w, 0, -1, 'WITHSCORES')
    for j = 1, #ids, 2 do
      out[#out + 1] = ids[j + 1]
      out[#out + 1] = redis.call('HGET', k.t, ids[j]) or '0'
    end
    return out
  end
end
local out = {tostring(now), 'ok'}
for s = 1, n do
  local k = keys[s]
  redis.call('ZADD', k.w, now, id)
  redis.call('HSET', k.t, id, est)
  redis.call('INCRBY', k.n, est)
  for _, key in ipairs({k.w, k.t, k.n}) do redis.call('EXPIRE', key, ttl) end
  local oldest = redis.call('ZRANGE', k.w, 0, 0, 'WITHSCORES')
  out[#out + 1] = tostring(k.count + 1)
  out[#out + 1] = tostring(k.used + est)
  out[#out + 1] = tostring(k.spent)
  out[#out + 1] = oldest[2]
end
return out
"""

# ARGV: prefix, ticket id, tokens billed, cost, n, then per scope: name, spend key ("" for none).
SETTLE = """
local pfx, id, tokens, cost, n = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
local i = 6
for _ = 1, n do
  local name, spend = ARGV[i], ARGV[i + 1]
  i = i + 2
  local old = redis.call('HGET', pfx..'t:'..name, id)
  if old then
    redis.call('HSET', pfx..'t:'..name, id, tokens)
    redis.call('INCRBY', pfx..'n:'..name, tokens - tonumber(old))
  end
  if spend ~= '' and redis.call('EXISTS', pfx..'s:'..spend) == 1 then
    redis.call('INCRBYFLOAT', pfx..'s:'..spend, cost)
  end
end
return 1
"""

# ARGV: prefix, spend key, amount, seconds to keep it. Sets the spend only where none is yet.
SEED = """
redis.call('SET', ARGV[1]..'s:'..ARGV[2], ARGV[3], 'NX', 'EX', tonumber(ARGV[4]))
return 1
"""

SPEND_KEPT_S = 86400  # a period's spend is kept this long past the period's end
# how long a script may take before the store counts as lost. Longer than the health store's
# sync: a script that ran but answered late has counted its request, and the fallback then
# counts it a second time (limits_on_store_error), so a slow store is waited for a little more
SCRIPT_TIMEOUT_S = 2.0


class RedisLimits:
    """The windows and spend of a fleet, in the Redis of `[health] store`, on the health store's
    connection (stores/health.py `run_script`). Every call raises while the store does not
    answer: what admission does then is `[gateway] limits_on_store_error`'s (gateway/limits.py)."""

    def __init__(self, health: RedisHealth) -> None:
        self.health = health
        self.where = health.where
        self.prefix = health.prefix + "lim:"
        self.worker = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self._ids = itertools.count()
        self._seeded: set[str] = set()

    def seeded(self, scope: ScopeLimits, wall: float) -> bool:
        key = spend_key(scope, wall)
        return not key or key in self._seeded

    async def seed(self, scope: ScopeLimits, wall: float, amount: float) -> None:
        key = spend_key(scope, wall)
        if key:
            keep = int(period_end(wall, scope.budget_period) - wall) + SPEND_KEPT_S
            await self.health.run_script(SEED, [self.prefix, key, repr(amount), str(keep)],
                                         SCRIPT_TIMEOUT_S)
            self._seeded.add(key)

    async def admit(self, scopes: Sequence[ScopeLimits],
                    estimate: int) -> tuple[Refusal | None, Ticket | None,
                                                                                 list[Standing]]:
        ticket = Ticket(f"{self.worker}:{next(self._ids)}", tuple(scopes), estimate)
        wall = time.time()
        args = [self.prefix, ticket.id, str(estimate), str(len(scopes))]
        for scope in scopes:
            spend = spend_key(scope, wall)
            args += [scope.id, _number(scope.rpm), _number(scope.tpm), _number(scope.budget_usd),
                     spend]
        reply = await self.health.run_script(ADMIT, args, SCRIPT_TIMEOUT_S)
        now = float(reply[0])
        if reply[1] == "refused":
            scope = scopes[int(reply[2]) - 1]
            values = reply[4:]
            entries = [(float(values[j]),
                        int(float(values[j + 1]))) for j in range(0, len(values), 2)]
            refusal = judge(scope, entries, float(reply[3]), estimate, now)
            return refusal or _store_race(scope), None, []
        standings = []
        for j, scope in enumerate(scopes):
            requests, tokens, spend, oldest = reply[2 + 4 * j:6 + 4 * j]
            reset = float(oldest) + WINDOW_S - now
            standings.append(Standing(scope, int(requests), int(float(tokens)), float(spend), reset,
                                      reset))
        return None, ticket, standings

    async def settle(self, ticket: Ticket, tokens: int, cost_usd: float) -> None:
        wall = time.time()
        args = [self.prefix, ticket.id, str(tokens), repr(cost_usd), str(len(ticket.scopes))]
        for scope in ticket.scopes:
            args += [scope.id, spend_key(scope, wall)]
        await self.health.run_script(SETTLE, args, SCRIPT_TIMEOUT_S)


def _number(value: float | None) -> str:
    return "" if value is None else repr(value)


def _store_race(scope: ScopeLimits) -> Refusal:
    """The script refused where the same sums in Python admit (a float's last digit): refused
    all the same, to be tried again at once."""
    return Refusal("rpm", scope, 1.0, f"the {scope.scope} {scope.name!r} is at its limit")

"""Health shared by a fleet of gateway workers, in Redis ([health] store = "redis://...").

The walk consults health synchronously (machines/health.py's HealthStore) and must stay pure,
so each worker keeps a local mirror that the walk reads and writes as usual, and the driver
syncs it with Redis between the machine's steps (`sync`, before a step and after the last):
one round trip runs a Lua script that applies, in order and atomically, what this worker's
turns did since the last round (failures, probe claims and verdicts, cooldowns, key cursors)
and reads back the fleet's state of the turn's profiles. The fleet's view replaces the mirror's.

The half-open probe. When a profile's open_s has passed, the first worker whose sync reads it
reserves its probe (a short lease under the profile's probe key): only there does the mirror
show it half-open, so only one of that worker's turns can claim it, and the claim turns the
reservation into the probe's lease. Every other worker's mirror shows it probing: skipped,
never force-probed. A reservation that no turn used lapses after RESERVE_S, and any worker may
take it again; a probe lease lapses after max(open_s, 30 s), so a worker that died mid-probe
does not lock the profile out.

Store down: the mirror keeps serving as plain in-memory health (its breakers run the spec
locally), a warning is logged once per outage, Redis is tried again every RETRY_S, and when it
answers the fleet's state replaces the local one. A sync never raises and never waits longer
than TIMEOUT_S: a request never fails because the store did.

Every key lives under key_prefix and has an expiry: the breaker state (open_s + window_s past
its last write), the failure window (window_s), the probe (its lease), the cooldown (its end),
a pool's keys sitting out after a 401 or 403 (the last one's end), the key cursor (a day). A
standalone Redis (or a single shard) is assumed: the script names its keys from the prefix.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Iterable
from contextlib import asynccontextmanager
from types import ModuleType
from typing import Any, Protocol
from urllib.parse import urlsplit

import trio

from relayline.machines.config import Breaker as BreakerConfig
from relayline.machines.config import Health as HealthConfig
from relayline.machines.health import Breaker, InMemoryHealth
from relayline.machines.vocab import BreakerState

log = logging.getLogger("relayline.health")

TIMEOUT_S = 0.5  # a sync that takes longer gives up: the turn goes on with the local mirror
CONNECT_TIMEOUT_S = 3.0  # the first connection at start (a busy machine can be slow to shake hands)
RETRY_S = 1.0  # while the store is down, how often a sync tries it again
RESERVE_S = 1.0  # an unused probe reservation lapses after this
CURSOR_TTL_S = 86400

# KEYS: none (standalone Redis). ARGV: prefix, worker, threshold, window_s, open_s, lease_ms,
# reserve_ms, cursor_ttl_s, n_ops, then n_ops triples (op, profile, value), then the profiles
# to read. Returns strings (Lua numbers would be truncated to integers): the server's time,
# the number of probe claims another worker already held, then per profile read: state,
# open_until, probe ("" | "mine" | "other"), cooldown_until, cursor, n, n failure times, m, and
# m pairs (pool key index, the end of its sit-out after a 401 or 403).
SCRIPT = """
local pfx, me = ARGV[1], ARGV[2]
local threshold, window, open_s = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local lease_ms, reserve_ms, cursor_ttl = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local state_ttl = math.ceil(open_s + window) + 1
local conflicts = 0

local function open_breaker(p)
  redis.call('HSET', pfx..'b:'..p, 'state', 'open', 'open_until', tostring(now + open_s))
  redis.call('EXPIRE', pfx..'b:'..p, state_ttl)
  redis.call('DEL', pfx..'f:'..p)
end

local function holder(p)
  local v = redis.call('GET', pfx..'p:'..p)
  if not v then return nil end
  return string.sub(v, 3)
end

local n = tonumber(ARGV[9])
local i = 10
for _ = 1, n do
  local op, p, v = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  if op == 'fail' then
    -- a counted failure (at most one per turn per profile: the walk decides that)
    local state = redis.call('HGET', pfx..'b:'..p, 'state') or 'closed'
    if state == 'closed' then
      local f = pfx..'f:'..p
      redis.call('ZADD', f, now, v)
      redis.call('ZREMRANGEBYSCORE', f, '-inf', now - window)
      redis.call('EXPIRE', f, math.ceil(window) + 1)
      if redis.call('ZCARD', f) >= threshold then open_breaker(p) end
    end
  elseif op == 'claim' then
    local h = holder(p)
    if h ~= nil and h ~= me then conflicts = conflicts + 1 end
    redis.call('SET', pfx..'p:'..p, 'h:'..me, 'PX', lease_ms)
  elseif op == 'probe_fail' then
    open_breaker(p)
    if holder(p) == me then redis.call('DEL', pfx..'p:'..p) end
  elseif op == 'probe_ok' then
    redis.call('DEL', pfx..'b:'..p, pfx..'f:'..p)
    if holder(p) == me then redis.call('DEL', pfx..'p:'..p) end
  elseif op == 'release' then
    if holder(p) == me then redis.call('DEL', pfx..'p:'..p) end
  elseif op == 'cooldown' then
    local until_ = tonumber(v)
    local c = pfx..'c:'..p
    local old = tonumber(redis.call('GET', c) or '0')
    if until_ > old and until_ > now then
      redis.call('SET', c, tostring(until_), 'PXAT', math.ceil(until_ * 1000))
    end
  elseif op == 'clear_cooldown' then
    redis.call('DEL', pfx..'c:'..p)
  elseif op == 'forget_keys' then
    redis.call('DEL', pfx..'k:'..p, pfx..'kc:'..p)
  elseif op == 'cursor' then
    redis.call('SET', pfx..'k:'..p, v, 'EX', cursor_ttl)
  elseif op == 'key_cooldown' then
    -- v = "index:until": a pool key that drew a 401 or 403 sits out until then
    local sep = string.find(v, ':', 1, true)
    local key, until_ = string.sub(v, 1, sep - 1), tonumber(string.sub(v, sep + 1))
    local kc = pfx..'kc:'..p
    local old = tonumber(redis.call('HGET', kc, key) or '0')
    if until_ > old and until_ > now then
      redis.call('HSET', kc, key, tostring(until_))
      local need = math.ceil(until_ - now) + 1
      if redis.call('TTL', kc) < need then redis.call('EXPIRE', kc, need) end
    end
  end
end

local out = {tostring(now), tostring(conflicts)}
for j = i, #ARGV do
  local p = ARGV[j]
  local b = redis.call('HMGET', pfx..'b:'..p, 'state', 'open_until')
  local state, open_until = b[1] or 'closed', tonumber(b[2] or '0')
  local h = holder(p)
  local probe = ''
  if h ~= nil then probe = (h == me) and 'mine' or 'other' end
  if state == 'open' and now >= open_until and h == nil then
    redis.call('SET', pfx..'p:'..p, 'r:'..me, 'PX', reserve_ms)
    probe = 'mine'
  end
  local fails = {}
  if state == 'closed' then
    fails = redis.call('ZRANGEBYSCORE', pfx..'f:'..p, now - window, '+inf', 'WITHSCORES')
  end
  table.insert(out, state)
  table.insert(out, tostring(open_until))
  table.insert(out, probe)
  table.insert(out, redis.call('GET', pfx..'c:'..p) or '')
  table.insert(out, redis.call('GET', pfx..'k:'..p) or '')
  table.insert(out, tostring(#fails / 2))
  for k = 2, #fails, 2 do table.insert(out, fails[k]) end
  local keys = redis.call('HGETALL', pfx..'kc:'..p)
  table.insert(out, tostring(#keys / 2))
  for k = 1, #keys do table.insert(out, keys[k]) end
end
return out
"""


class SharedBreaker(Breaker):
    """A worker's mirror of one profile's fleet breaker. It runs the breaker spec locally like
    any Breaker, and records what the fleet must learn (its store pushes it at the next sync).
    It turns half-open only where the fleet reserved the probe for this worker, or while the
    store is down (then it is plain local health)."""

    __slots__ = ("profile", "store", "reserved")

    def __init__(self, config: BreakerConfig, profile: str, store: RedisHealth) -> None:
        super().__init__(config)
        self.profile = profile
        self.store = store
        self.reserved = False

    def refresh(self, now: float) -> BreakerState:
        if (
            self.life.state == "open"
            and now >= self.open_until
            and not (self.reserved or self.store.local)
        ):
            # open_s passed, but another worker may hold the probe: the next sync says
            return BreakerState.OPEN
        return super().refresh(now)

    def claim(self, now: float, *, force: bool = False) -> bool:
        claimed = super().claim(now, force=force)
        if claimed:
            self.store.note("claim", self.profile)
        return claimed

    def failure(self, now: float) -> None:
        before = self.life.state
        super().failure(now)
        if before == "probing":
            self.store.note("probe_fail", self.profile)
        else:
            self.store.note("fail", self.profile, self.store.failure_id())

    def success(self, now: float) -> None:
        before = self.life.state
        super().success(now)
        if before == "probing":
            self.store.note("probe_ok", self.profile)

    def release(self) -> None:
        if self.life.state == "probing":
            self.store.note("release", self.profile)
        super().release()


class _Script(Protocol):
    """A Lua script registered on the connection, as the stores call it: no keys, string
    arguments, the script's reply back."""

    def __call__(self, *, keys: list[str], args: list[str]) -> Awaitable[Any]: ...


class RedisHealth(InMemoryHealth):
    """The HealthStore of a fleet: the local mirror the walk reads, synced with Redis."""

    def __init__(self, health: HealthConfig, breaker: BreakerConfig) -> None:
        super().__init__(breaker)
        self.url = health.store
        self.prefix = health.key_prefix
        parts = urlsplit(self.url)
        host = parts.hostname or parts.path
        self.where = f"{host}:{parts.port or 6379}{parts.path if parts.hostname else ''}"
        self.worker = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self._ids = itertools.count()
        self._ops: list[tuple[str, str, str]] = []
        self._wanted: set[str] = set()
        self._lock = trio.Lock()
        self._rounds_started = 0
        self._rounds_done = 0
        self._client = None  # a connected coredis client while `connected()` runs
        self._script: _Script | None = None  # this store's own round
        # other stores' scripts on this connection (`run_script`)
        self._scripts: dict[str, _Script] = {}
        self.local = True  # serving on local state (not connected, or the store is down)
        self._down_since: float | None = None
        self._retry_at = -math.inf
        self._offset = 0.0  # the server's clock minus trio's, measured at each round
        self.conflicts = 0  # probe claims that found another worker's probe (a stalled loop)
        self.rounds = 0
        self._hosted = False  # `connected()` runs: someone keeps the connection
        self._said_unhosted = False

    # -- HealthStore (the mirror; synchronous) ---------------------------------------------

    def breaker(self, profile: str) -> Breaker:
        try:
            return self._breakers[profile]
        except KeyError:
            b = self._breakers[profile] = SharedBreaker(self.breaker_config, profile, self)
            return b

    def _shared(self, profile: str) -> SharedBreaker:
        breaker = self.breaker(profile)
        assert isinstance(breaker, SharedBreaker)  # (the one kind this store makes)
        return breaker

    def set_cooldown(self, profile: str, until: float) -> None:
        super().set_cooldown(profile, until)
        self.note("cooldown", profile, repr(until + self._offset))

    def clear_cooldown(self, profile: str) -> None:
        if profile in self._cooldowns:
            self.note("clear_cooldown", profile)
        super().clear_cooldown(profile)

    def set_key_cursor(self, profile: str, index: int) -> None:
        super().set_key_cursor(profile, index)
        self.note("cursor", profile, str(index))

    def set_key_cooldown(self, profile: str, index: int, until: float) -> None:
        super().set_key_cooldown(profile, index, until)
        self.note("key_cooldown", profile, f"{index}:{until + self._offset!r}")

    def forget_keys(self, profile: str) -> None:
        super().forget_keys(profile)
        self.note("forget_keys", profile)  # for the fleet: the pool changed for every worker

    def note(self, op: str, profile: str, value: str = "") -> None:
        if not self.local:
            self._ops.append((op, profile, value))

    @property
    def pending(self) -> bool:
        """This worker's turns did something the fleet has not learnt yet."""
        return bool(self._ops)

    def failure_id(self) -> str:
        return f"{self.worker}:{next(self._ids)}"

    # -- the connection ------------------------------------------------------------------------

    @property
    def reachable(self) -> bool:
        """The store answered the last round (for /readyz)."""
        return self._client is not None and not self.local

    @asynccontextmanager
    async def connected(self) -> AsyncIterator[RedisHealth]:
        """Keep a Redis connection pool open for as long as the block runs (a gateway's life).
        Redis may be down when it starts: the mirror serves locally until it answers."""
        try:
            import coredis
            from coredis.retry import NoRetryPolicy
        except ImportError:  # pragma: no cover - the fleet extra is part of dev
            raise RuntimeError("health.store = redis://... needs the fleet extra: pip install "
                               "'relayline[fleet]'") from None
        self._hosted = True
        async with trio.open_nursery() as nursery:
            await nursery.start(self._connection, coredis, NoRetryPolicy)
            try:
                yield self
            finally:
                nursery.cancel_scope.cancel()

    async def _connection(self, coredis: ModuleType, no_retry: type,
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Reports started after the first attempt, connected or not: the first turns then
        already share the fleet's state when Redis is up, and never wait on it when it is down."""
        while True:
            client = coredis.Redis.from_url(self.url, decode_responses=True,
                                            connect_timeout=CONNECT_TIMEOUT_S,
                                            stream_timeout=CONNECT_TIMEOUT_S,
                                            retry_policy=no_retry())
            try:
                async with client:
                    with trio.fail_after(CONNECT_TIMEOUT_S):
                        # a pooled connection, made before the first round's deadline
                        await client.ping()
                    self._client = client
                    self._script = client.register_script(SCRIPT)
                    self._scripts = {}
                    await self.sync(())  # connected: take the fleet's view, say so if it was down
                    task_status.started()
                    task_status = trio.TASK_STATUS_IGNORED
                    await trio.sleep_forever()
            except Exception as exc:  # the pool could not start: Redis is down at startup
                self._client = None
                self._went_down(exc)
                task_status.started()
                task_status = trio.TASK_STATUS_IGNORED
                await trio.sleep(RETRY_S)
            finally:
                self._client = None

    def _went_down(self, exc: BaseException) -> None:
        now = trio.current_time()
        self._retry_at = now + RETRY_S
        self._ops.clear()  # the fleet cannot learn them now; the mirror keeps them locally
        if self._down_since is None:
            self._down_since = now
            log.warning("health_store_unreachable store=%s error=%s serving=local_health",
                        self.where,
                        type(exc).__name__)
        self.local = True
        for profile in self._breakers:
            self._shared(profile).reserved = False

    async def run_script(self, source: str, args: list[str],
                         timeout_s: float = TIMEOUT_S) -> list[Any]:
        """Another store's Lua script (stores/limits.py) on this store's connection, with no keys
        and string arguments. Raises while the store is not connected or does not answer within
        `timeout_s`: the caller decides what that means for it."""
        client = self._client
        if client is None:
            raise ConnectionError(f"the shared store at {self.where} is not connected")
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = client.register_script(source)
        with trio.fail_after(timeout_s):
            return await script(keys=[], args=args)

    # -- the sync --------------------------------------------------------------------------------

    async def sync(self, profiles: Iterable[str]) -> None:
        """Push what this worker's turns did and read the fleet's state of `profiles` into the
        mirror. Concurrent callers share rounds: one round covers every request made before
        it started. Never raises for the store's sake; gives up after TIMEOUT_S."""
        self._wanted.update(profiles)
        if self._client is None or trio.current_time() < self._retry_at:
            if not self._hosted and not self._said_unhosted:
                self._said_unhosted = True
                log.warning("health_store_not_connected store=%s serving=local_health hint=%s",
                            self.where,
                            "run turns inside `async with relay:` (a trio host) or the gateway")
            return
        ticket = self._rounds_started
        async with self._lock:
            if self._rounds_done > ticket:
                return  # a round that started after this request covered it
            ops, self._ops = self._ops, []
            wanted, self._wanted = self._wanted, set()
            self._rounds_started += 1
            try:
                await self._round(ops, wanted)
            finally:
                self._rounds_done = self._rounds_started

    async def _round(self, ops: list[tuple[str, str, str]], wanted: set[str]) -> None:
        cfg = self.breaker_config
        profiles = sorted(wanted)
        args = [self.prefix, self.worker, cfg.failure_threshold, cfg.window_s, cfg.open_s,
                int(max(cfg.open_s, 30.0) * 1000), int(RESERVE_S * 1000), CURSOR_TTL_S, len(ops),
                *itertools.chain.from_iterable(ops), *profiles]
        sent = trio.current_time()
        try:
            if self._script is None:
                raise ConnectionError(f"the shared store at {self.where} is not connected")
            with trio.fail_after(TIMEOUT_S):
                reply = await self._script(keys=[], args=[str(a) for a in args])
        except Exception as exc:
            self._went_down(exc)
            return
        now = trio.current_time()
        self.rounds += 1
        if self._down_since is not None:
            log.warning("health_store_reachable store=%s after_s=%.1f serving=shared_health",
                        self.where,
                        now - self._down_since)
            self._down_since = None
        self.local = False
        self._offset = float(reply[0]) - (sent + now) / 2
        self.conflicts += int(reply[1])
        self._adopt(profiles, reply[2:])

    def _adopt(self, profiles: list[str], fields: list[str]) -> None:
        at = 0
        offset = self._offset
        for profile in profiles:
            state, open_until, probe, cooldown, cursor, n = fields[at:at + 6]
            failures = [float(t) - offset for t in fields[at + 6:at + 6 + int(n)]]
            at += 6 + int(n)
            keys = int(fields[at])
            pairs = fields[at + 1:at + 1 + 2 * keys]
            at += 1 + 2 * keys
            self._key_cooldowns[profile] = {
                int(pairs[k]): float(pairs[k + 1]) - offset for k in range(0, len(pairs), 2)
            }
            breaker = self._shared(profile)
            local = breaker.life.state
            if state == "closed":
                view = "closed"
            elif probe == "other":
                view = "probing"  # another worker holds (or reserved) the probe: skip, never force
            elif probe == "mine" and local == "probing":
                view = "probing"  # one of this worker's turns holds it
            elif probe == "mine":
                view = "half_open"
            else:
                view = "open"
            breaker.reserved = probe == "mine"
            breaker.adopt(view, failures, float(open_until) - offset)
            if cooldown:
                self._cooldowns[profile] = float(cooldown) - offset
            else:
                self._cooldowns.pop(profile, None)
            if cursor:
                self._keys[profile] = int(cursor)
            else:  # none in the store (expired, or forgotten when the pool changed): the first key
                self._keys.pop(profile, None)

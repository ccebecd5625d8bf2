"""Upstream connection pools: one per provider profile, of providers/upstream.py's connections.

Why per profile: one profile's burst must not evict another profile's warm connections, and a
profile's connections are its own to count and to bound.

Reuse: a finished exchange puts its connection on top of its origin's idle stack, and the next
request takes the top one (O(1), and a quiet profile reuses its warmest connection, whose TCP
window and TLS state are hot). A connection goes back only when the exchange ended cleanly
on both sides (the answer whole as framed, keep-alive, nothing after the body); anything else
closes it. An idle
connection is checked before it carries a request: one its peer closed is dropped and the next
taken, so a request is never written to a connection known dead.

Stale connections are not retried: once any byte of a request was written, the exchange fails
as a connection error and the driver decides (its retry is a visible attempt in the ledger). A
provider may have read the request and be answering it; sending it again silently could bill a
turn twice. The race is rare because connections idle for KEEPALIVE_S (30 s) are closed, well
before the providers' own idle timeouts (about 60 s).

Expiry: each pool with idle connections has one sleeping system task that closes those no
request took for KEEPALIVE_S, whether or not the pool is used again (after a burst of 5,000
streams, 5,000 sockets and their memory would otherwise stay until exit). The stacks keep the
oldest at the bottom, so expiry pops from there: no scan of the live ones.

Sizing: a turn holds at most one upstream connection at a time, so a profile never needs more
connections than turns in flight. `[gateway] max_in_flight` (when set) bounds each profile's
connections (requests beyond it wait, first come first served); otherwise a pool grows with
demand (the process's file-descriptor limit is the bound), because a cap below the turns in
flight only moves the queue from the gateway into the pool.

Proxies: where the environment names a proxy for a profile's URL (HTTP(S)_PROXY, ALL_PROXY, not
bypassed by NO_PROXY, as urllib reads them), that profile's requests go through httpx, which
honours it (providers/httpx_pool.py); this client does not speak CONNECT.
RELAYLINE_UPSTREAM_CLIENT=httpx sends every profile through httpx (the pool before this client:
an operator's way back, and the benchmark's baseline in the same run).
"""

from __future__ import annotations

import functools
import logging
import os
import ssl
import urllib.request
from collections import deque
from contextlib import AbstractAsyncContextManager
from types import TracebackType

import trio

from ..codecs.http1 import Origin, UpstreamRequest, split_url
from .base import AttemptClockLike
from .httpx_pool import HttpxPool, HttpxResponse
from .upstream import TRANSPORT_ERRORS, Connection, Response, default_ssl_context

log = logging.getLogger("relayline.providers")

KEEPALIVE_S = 30.0  # an idle connection is closed after this (providers drop theirs at ~60 s)


def proxy_for(origin: Origin) -> str | None:
    """The proxy the environment names for this origin, as httpx (trust_env) would use one."""
    proxies = urllib.request.getproxies()
    proxy = proxies.get(origin.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(f"{origin.host}:{origin.port}") or \
            urllib.request.proxy_bypass(origin.host):
        return None
    return proxy


def upstream_client() -> str:
    """RELAYLINE_UPSTREAM_CLIENT: "lean" (the default) or "httpx"."""
    value = os.environ.get("RELAYLINE_UPSTREAM_CLIENT", "").strip().lower() or "lean"
    if value not in ("lean", "httpx"):
        raise ValueError(f"RELAYLINE_UPSTREAM_CLIENT: {value!r} is neither 'lean' nor 'httpx'")
    return value


class ProfilePool:
    """One profile's connections: an idle stack per origin, a bound, the expiry task."""

    def __init__(self, max_connections: int | None = None,
                 ssl_context: ssl.SSLContext | None = None,
                 keepalive_s: float = KEEPALIVE_S, *, through_httpx: bool = False) -> None:
        self.ssl_context = ssl_context
        self.through_httpx = through_httpx
        self.keepalive_s = keepalive_s
        self.max_connections = max_connections or None
        self.bound = trio.Semaphore(max_connections) if max_connections else None
        self.idle: dict[Origin, deque[Connection]] = {}  # each a stack: the warmest on the right
        self.opened = 0  # connections open now, idle or carrying a request
        self.closed = False
        # origins whose requests go through httpx
        self._through: dict[Origin, HttpxPool | None] = {}
        self._httpx: HttpxPool | None = None
        self._expiry: trio.CancelScope | None = None

    def exchange(self, request: UpstreamRequest,
                 clock: AttemptClockLike | None = None) -> _PooledExchange:
        """`async with pool.exchange(request) as response`: send `request` and get the response
        once its head arrived; the block reads the body (or not). On exit the connection goes
        back to the pool if the exchange ended cleanly."""
        return _PooledExchange(self, request, clock)

    async def _take(self, origin: Origin) -> Connection | None:
        stack = self.idle.get(origin)
        while stack:
            connection = stack.pop()
            if connection.idle_and_open():
                return connection
            await self._close(connection)  # its peer closed it while it idled
        return None

    def _keep(self, connection: Connection) -> None:
        connection.idle_since = trio.current_time()
        stack = self.idle.get(connection.origin)
        if stack is None:
            stack = self.idle[connection.origin] = deque()
        stack.append(connection)
        if self._expiry is None:
            self._expiry = trio.CancelScope()
            trio.lowlevel.spawn_system_task(self._expire, self._expiry,
                                            name="relayline upstream pool expiry")

    async def _close(self, connection: Connection) -> None:
        self.opened -= 1
        with trio.CancelScope(shield=True):  # closing does not wait on the network
            try:
                await connection.aclose()
            except TRANSPORT_ERRORS:
                pass

    async def _expire(self, scope: trio.CancelScope) -> None:
        try:
            with scope:
                quiet = False
                while True:
                    oldest = min((stack[0].idle_since for stack in self.idle.values() if stack),
                                 default=None)
                    if oldest is None:
                        # a busy pool's connections are all out at this moment: the task ends only
                        # after a whole period without an idle one (not respawned per request)
                        if quiet:
                            return
                        quiet = True
                        await trio.sleep(self.keepalive_s)
                        continue
                    quiet = False
                    await trio.sleep_until(oldest + self.keepalive_s)
                    now = trio.current_time()
                    # a close yields: an origin may be added meanwhile
                    for stack in list(self.idle.values()):
                        while stack and now - stack[0].idle_since >= self.keepalive_s:
                            await self._close(stack.popleft())
        except Exception:  # a system task's error would end the whole run: log it instead
            log.exception("upstream_pool_expiry_error")
        finally:
            if self._expiry is scope:
                self._expiry = None

    def _httpx_for(self, origin: Origin) -> HttpxPool | None:
        if not self.through_httpx:
            if proxy_for(origin) is None:
                return None
            log.info("upstream_proxy origin=%s: this profile's requests go through httpx",
                     origin.url)
        if self._httpx is None:
            self._httpx = HttpxPool(self.max_connections, self.ssl_context or default_ssl_context(),
                                    self.keepalive_s)
        return self._httpx

    async def aclose(self) -> None:
        self.closed = True
        if self._expiry is not None:
            self._expiry.cancel()
        for stack in self.idle.values():
            while stack:
                await self._close(stack.pop())
        if self._httpx is not None:
            await self._httpx.aclose()
        self._through.clear()


class _PooledExchange:
    """One exchange on one of a pool's connections (`ProfilePool.exchange`). A class, not an
    @asynccontextmanager: the generator cost each request an async generator (trio's hooks
    keep every live one in a weak set) and its frame, and each stream kept them for its whole
    life (bench/proxy_floor.py --instructions)."""

    __slots__ = ("pool", "request", "clock", "inner", "connection", "response")

    def __init__(self, pool: ProfilePool, request: UpstreamRequest,
                 clock: AttemptClockLike | None) -> None:
        self.pool = pool
        self.request: UpstreamRequest | None = request
        self.clock = clock
        # the httpx pool's exchange, for an origin that goes through httpx
        self.inner: AbstractAsyncContextManager[HttpxResponse] | None = None
        self.connection: Connection | None = None
        self.response: Response | None = None

    async def __aenter__(self) -> Response | HttpxResponse:
        pool = self.pool
        # sent: the rendered request (the whole prompt again, beside the turn's own) is not kept
        # while the body is read, for the life of a stream
        request, self.request = self.request, None
        assert request is not None  # (an exchange is entered once)
        clock, self.clock = self.clock, None
        origin = split_url(request.url)[0]
        try:
            through = pool._through[origin]
        except KeyError:
            through = pool._through[origin] = pool._httpx_for(origin)
        if through is not None:
            self.inner = through.exchange(request, clock)
            return await self.inner.__aenter__()
        bound = pool.bound
        if bound is not None:
            await bound.acquire()
        try:
            connection = await pool._take(origin)
            if connection is None:
                connection = await Connection.connect(origin, pool.ssl_context)
                pool.opened += 1
            try:
                response = await connection.exchange(request, clock)
            except BaseException:
                await pool._close(connection)
                raise
        except BaseException:
            if bound is not None:
                bound.release()
            raise
        self.connection, self.response = connection, response
        return response

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        if self.inner is not None:
            inner, self.inner = self.inner, None
            return await inner.__aexit__(kind, exc, tb)
        pool, connection, response = self.pool, self.connection, self.response
        self.connection = self.response = None
        assert connection is not None and response is not None  # (the exchange was entered)
        try:
            if response.complete and not pool.closed and connection.reusable():
                pool._keep(connection)
            else:
                await pool._close(connection)
        finally:
            if pool.bound is not None:
                pool.bound.release()
        return None


class Pools:
    """Every profile's pool, opened on first use; one TLS context shared by all of them."""

    def __init__(self, max_connections: int | None = None) -> None:
        self.max_connections = max_connections or None
        self.through_httpx = upstream_client() == "httpx"
        self.profiles: dict[str, ProfilePool] = {}

    @functools.cached_property
    def ssl_context(self) -> ssl.SSLContext:
        # on first use: a relay whose families all answer in process never reads the CA bundle
        return default_ssl_context()

    def profile(self, name: str) -> ProfilePool:
        pool = self.profiles.get(name)
        if pool is None:
            pool = self.profiles[name] = ProfilePool(self.max_connections, self.ssl_context,
                                                     through_httpx=self.through_httpx)
        return pool

    async def aclose(self) -> None:
        for pool in self.profiles.values():
            await pool.aclose()
        self.profiles.clear()

"""Running the gateway: the HTTP/1.1 server (http11/), the client limits, and the drain.

`serve` binds first (so a port in use is an OSError before anything starts), then serves until
`stop` is set; from then on new connections are refused, chat requests on open ones are shed
(503), and turns in flight get `[gateway] drain_s` to finish before they are cancelled
(Gateway.drain). The server's own graceful timeout is a little longer, so that the cancelled
turns can still write their error events and ledger rows. `run_until_signalled` is the process
around it: SIGTERM or SIGINT starts the drain, a second one cuts it short. A reload or a pool
of workers goes beside these two, with the same `stop` event.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import socket
from collections.abc import Callable

import trio

from ..codecs.dialects import OPENAI
from ..logs import event
from .app import Gateway
from .http11 import Server, listening_sockets
from .reload import EarlyReloads

log = logging.getLogger("relayline.gateway")

CANCEL_GRACE_S = 5.0  # after the drain cancels the last turns: time to write their endings
# Python's collector starts a young pass every 700 net allocations of container objects, and an
# older one every 10 young ones; each walks every object of its generations that is alive. A
# request's objects are freed by reference counting, so the passes find next to no garbage, but
# what they walk is the state of every turn in flight, and with many clients that walk became a
# large share of the gateway's CPU (docs/performance.md, "Figures behind the code's choices").
# Cyclic garbage still counts towards the young threshold, so what it can hold back stays bounded.
GC_THRESHOLDS = (50_000, 20, 10)
# The young threshold also grows with the open connections: each holds its turn's objects (a few
# hundred), so with many clients a fixed threshold still started young passes that walked every
# in-flight turn to find little garbage. What cyclic garbage can hold back stays bounded: 200
# objects an open connection, less than the connection's own state.
GC_YOUNG_PER_CONNECTION = 200
# ...up to a bound: a young pass stops every stream for as long as it walks, which grows with the
# objects it walks, and idle keep-alive connections, nearly free to hold, would otherwise raise
# it without limit. The bound leaves a thousand clients with no pass in bench/load.py's window.
GC_YOUNG_MOST = 250_000
_collector_tuned = False


def tune_collector() -> None:
    """For a gateway process, once its startup objects exist: those (modules, the config, the
    routing tables) are moved out of the collector's sight, and passes are rarer (GC_THRESHOLDS,
    the young one raised with the open connections: `follow_connections`). Not for the library:
    its host process owns its collector."""
    global _collector_tuned
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    _collector_tuned = True


def follow_connections(count: int) -> None:
    """The young threshold for `count` open connections (the server calls it as they open and
    close), in a process whose collector was tuned."""
    if _collector_tuned:
        young = min(max(GC_THRESHOLDS[0], GC_YOUNG_PER_CONNECTION * count), GC_YOUNG_MOST)
        gc.set_threshold(young, *GC_THRESHOLDS[1:])


def bind(gateway: Gateway, host: str, port: int, fd: int | None = None) -> list[socket.socket]:
    """The listening sockets, made before anything runs: a port in use is a plain OSError."""
    return listening_sockets(host, port, fd)


def _error_body(status: int, message: str) -> bytes:
    # a request the server refused before any route saw it: the default (OpenAI) dialect
    code = {400: "malformed_request", 431: "headers_too_large"}.get(status)
    return OPENAI.http_error(status, message, code)


async def serve(gateway: Gateway, *, host: str = "127.0.0.1", port: int = 8080,
                stop: trio.Event | None = None,
                bound: list[socket.socket] | None = None,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until `stop` is set (or forever), then drain. Reports the bound URLs."""
    sockets = bound if bound is not None else bind(gateway, host, port)
    stop = stop if stop is not None else trio.Event()
    settings = gateway.settings
    server = Server(gateway, keep_alive_s=settings.keep_alive_s,
                    max_header_bytes=settings.max_header_bytes,
                    graceful_s=settings.drain_s + CANCEL_GRACE_S, error_body=_error_body,
                    on_connections=follow_connections)

    async def drain_on_stop() -> None:
        await stop.wait()
        await gateway.drain(gateway.settings.drain_s)

    # a shared health store (stores/health.py) keeps its connection for as long as the server runs
    connected = getattr(gateway.relay.health, "connected", None)
    async with (
        connected() if connected is not None else contextlib.nullcontext(),
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(drain_on_stop)
        binds = await nursery.start(server.run, sockets, stop)
        task_status.started(binds)


async def run_until_signalled(gateway: Gateway, *, host: str, port: int, fd: int | None = None,
                              on_listening: Callable[[list[str]], None] = lambda binds: None,
                              early: EarlyReloads | None = None) -> None:
    """The `relayline serve` process: serve, drain on SIGTERM/SIGINT, cut the drain short on a
    second signal, return when every connection is done. SIGHUP reloads the config file
    (gateway/reload.py), and so does one that came while the process started (`early`)."""
    bound = bind(gateway, host, port, fd)
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:

            def reload() -> None:
                if gateway.reloader is not None:
                    nursery.start_soon(gateway.reloader.reload)
                else:
                    event(log, logging.WARNING, "reload_ignored", reason="no_config_file")

            if early is not None and early.take():  # (from here on SIGHUP comes to `signals`)
                reload()

            async def watch() -> None:
                async for signum in signals:
                    if signum == signal.SIGHUP:
                        reload()
                    elif not stop.is_set():
                        event(log, logging.WARNING, "draining", signal=signal.Signals(signum).name,
                              in_flight=gateway.in_flight, drain_s=gateway.settings.drain_s)
                        gateway.draining = True  # (a SIGHUP read next is refused, as in the drain)
                        stop.set()
                    else:
                        event(log, logging.WARNING, "drain_cut_short",
                              signal=signal.Signals(signum).name,
                              in_flight=gateway.in_flight)
                        gateway.cancel_turns()

            async def server(
                    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
                await serve(gateway, stop=stop, bound=bound, task_status=task_status)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            on_listening(await nursery.start(server))
    event(log, logging.INFO, "stopped")

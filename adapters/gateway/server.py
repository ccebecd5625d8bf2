"""Running the gateway: hypercorn's trio worker, the client limits, and the drain.

`serve` binds first (so a port in use is an OSError before anything starts), then runs
hypercorn until `stop` is set; from then on new connections are refused, chat requests on open
ones are shed (503), and turns in flight get `[gateway] drain_s` to finish before they are
cancelled (Gateway.drain). Hypercorn's own graceful timeout is a little longer, so that the
cancelled turns can still write their error events and ledger rows. `run_until_signalled` is
the process around it: SIGTERM or SIGINT starts the drain, a second one cuts it short.
A reload or a pool of workers goes beside these two, with the same `stop` event.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from .app import Gateway

log = logging.getLogger("relayline.gateway")

CANCEL_GRACE_S = 5.0  # after the drain cancels the last turns: time to write their endings


def hypercorn_config(gateway: Gateway, host: str, port: int, fd: int | None = None) -> HypercornConfig:
    settings = gateway.settings
    config = HypercornConfig()
    if fd is not None:
        config.bind = [f"fd://{fd}"]  # a worker of `serve --workers`: the supervisor's listening socket
    else:
        config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None  # the gateway writes its own access line (relayline.access)
    config.errorlog = logging.getLogger("hypercorn.error")
    # hypercorn's one idle timer: an idle keep-alive connection, or a request head still arriving
    config.keep_alive_timeout = settings.keep_alive_s
    config.h11_max_incomplete_size = settings.max_header_bytes  # beyond it: 431, connection closed
    config.graceful_timeout = settings.drain_s + CANCEL_GRACE_S
    config.backlog = 2048  # bursts of new connections must queue, not be refused
    return config


def bind(gateway: Gateway, host: str, port: int, fd: int | None = None) -> tuple[HypercornConfig, Sockets]:
    """The listening sockets, made before anything runs: a port in use is a plain OSError."""
    config = hypercorn_config(gateway, host, port, fd)
    sockets = config.create_sockets()
    for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
        sock.listen(config.backlog)
    return config, sockets


async def serve(gateway: Gateway, *, host: str = "127.0.0.1", port: int = 8080, stop: trio.Event | None = None,
                bound: tuple[HypercornConfig, Sockets] | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve until `stop` is set (or forever), then drain. Reports the bound URLs."""
    config, sockets = bound if bound is not None else bind(gateway, host, port)
    stop = stop if stop is not None else trio.Event()

    async def drain_on_stop() -> None:
        await stop.wait()
        await gateway.drain(gateway.settings.drain_s)

    # a shared health store (stores/health.py) keeps its connection for as long as the server runs
    connected = getattr(gateway.relay.health, "connected", None)
    async with connected() if connected is not None else contextlib.nullcontext(), trio.open_nursery() as nursery:
        nursery.start_soon(drain_on_stop)
        binds = await nursery.start(lambda task_status: worker_serve(
            wrap_app(gateway, config.wsgi_max_body_size, "asgi"), config, sockets=sockets,
            shutdown_trigger=stop.wait, task_status=task_status))
        task_status.started(binds)


async def run_until_signalled(gateway: Gateway, *, host: str, port: int, fd: int | None = None,
                              on_listening: Callable[[list[str]], None] = lambda binds: None) -> None:
    """The `relayline serve` process: serve, drain on SIGTERM/SIGINT, cut the drain short on a
    second signal, return when every connection is done. SIGHUP reloads the config file
    (gateway/reload.py)."""
    bound = bind(gateway, host, port, fd)
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for signum in signals:
                    if signum == signal.SIGHUP:
                        if gateway.reloader is not None:
                            nursery.start_soon(gateway.reloader.reload)
                        else:
                            log.warning("reload_ignored reason=no_config_file")
                    elif not stop.is_set():
                        log.warning("draining signal=%s in_flight=%d drain_s=%g", signal.Signals(signum).name,
                                    gateway.in_flight, gateway.settings.drain_s)
                        stop.set()
                    else:
                        log.warning("drain_cut_short signal=%s in_flight=%d", signal.Signals(signum).name,
                                    gateway.in_flight)
                        gateway.cancel_turns()

            async def server(task_status=trio.TASK_STATUS_IGNORED) -> None:
                await serve(gateway, stop=stop, bound=bound, task_status=task_status)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            on_listening(await nursery.start(server))
    log.info("stopped")

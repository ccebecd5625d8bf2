"""The server: connections accepted (a listener that makes room when out of file descriptors),
one task each, the head and send watchdogs over all of them, and the drain."""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable

import trio

from ..listen import BatchListener
from .answer import SEND_CHECKS
from .connection import App, Connection
from .hangups import Hangups

log = logging.getLogger("relayline.gateway")

BACKLOG = 2048  # bursts of new connections must queue, not be refused
# connections waiting for a head closed when accept() runs out of descriptors (as nginx)
SHED_ON_EMFILE = 32
HEAD_CHECK_S = 1.0  # the head watchdog looks at least this often (and 4 times per keep_alive_s)...
HEAD_CHECK_LEAST_S = 0.01  # ...but never more often than this (a tiny keep_alive_s is no busy loop)
SEND_TIMEOUT_S = 60.0  # nginx's send_timeout: how long a write may make no progress

ErrorBody = Callable[[int, str], bytes]


def _plain_error(status: int, message: str) -> bytes:
    return message.encode()


def listening_sockets(host: str, port: int, fd: int | None = None) -> list[socket.socket]:
    """The listening socket, made before anything runs: a port in use is a plain OSError. `fd` is
    a socket the supervisor of `serve --workers` already listens on."""
    if fd is not None:
        sock = socket.socket(fileno=fd)
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
    sock.listen(BACKLOG)
    return [sock]


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Listener(trio.abc.Listener[trio.SocketStream]):
    """accept() that, out of file descriptors, makes room: the connections that have waited
    longest for a request head (idle keep-alive ones, slow heads) are closed, so a new client is
    served rather than queued behind them until `keep_alive_s` (nginx reuses idle connections
    so). trio.serve_listeners logs the error and retries 0.1 s later: never a busy loop."""

    def __init__(self, sock: socket.socket, server: Server) -> None:
        self.inner = BatchListener(sock)
        self.server = server

    async def accept(self) -> trio.SocketStream:
        try:
            return await self.inner.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self.server.shed_waiting()
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()


class Server:
    def __init__(self, app: App, *, keep_alive_s: float, max_header_bytes: int, graceful_s: float,
                 error_body: ErrorBody = _plain_error, send_timeout_s: float = SEND_TIMEOUT_S,
                 on_connections: Callable[[int], None] | None = None) -> None:
        self.app = app
        # told the number of open connections whenever it changes
        self.on_connections = on_connections
        self.keep_alive_s = keep_alive_s
        self.send_timeout_s = send_timeout_s
        self.max_header_bytes = max_header_bytes
        self.graceful_s = graceful_s
        self.error_body = error_body
        self.draining = False
        self.connections: set[Connection] = set()
        self._none_left = trio.Event()
        self.hangups: Hangups | None = None

    async def run(self, sockets: list[socket.socket], stop: trio.Event, *,
                  task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until `stop`, then drain (see the module's docstring)."""
        # a burst is taken in one pass, not one a pass
        listeners = [_Listener(sock, self) for sock in sockets]
        async with trio.open_nursery() as nursery:
            accepting = trio.CancelScope()

            async def accept() -> None:
                with accepting:
                    await trio.serve_listeners(self._connection, listeners, handler_nursery=nursery)

            if Hangups.AVAILABLE:
                self.hangups = Hangups()
                nursery.start_soon(self.hangups.run)
            nursery.start_soon(accept)
            nursery.start_soon(self._watch_heads)
            nursery.start_soon(self._watch_sends)
            task_status.started([url_of(sock) for sock in sockets])
            await stop.wait()
            self.draining = True
            accepting.cancel()
            for listener in listeners:
                await listener.aclose()
            for connection in list(self.connections):
                connection.drain()
            with trio.move_on_after(self.graceful_s):
                if self.connections:
                    await self._none_left.wait()
            nursery.cancel_scope.cancel()

    async def _watch_heads(self) -> None:
        """Close the connections that have waited `keep_alive_s` for a request head (idle, or a
        head still arriving), within a further min(HEAD_CHECK_S, keep_alive_s / 4). One task
        for all of them: a timer (a cancel scope with a deadline) around each request's wait
        for its head cost more than the server's whole read of that head
        (bench/probes/glue_counts.py); a connection only notes when its wait began."""
        every = max(min(HEAD_CHECK_S, self.keep_alive_s / 4), HEAD_CHECK_LEAST_S)
        while True:
            await trio.sleep(every)
            too_old = trio.current_time() - self.keep_alive_s
            for connection in [
                c
                for c in self.connections
                if c.waiting_since is not None and c.waiting_since <= too_old
            ]:
                connection.drain()

    async def _watch_sends(self) -> None:
        """Close the connections whose write has made no progress for `send_timeout_s` (cut
        within a further send_timeout_s / SEND_CHECKS). One task for all of them: a timeout
        around each write would cost a good part of the write itself, and a stream writes once a
        frame."""
        while True:
            await trio.sleep(self.send_timeout_s / SEND_CHECKS)
            for connection in [c for c in self.connections if c.stalled()]:
                log.warning("http_send_timeout client_read_nothing_for_s=%g", self.send_timeout_s)
                # an app watching for a hang-up hears it now: once the socket is closed its number
                # may be taken by a new connection before the write that fails says it
                connection.hung_up()
                # its write raises ClosedResourceError
                await trio.aclose_forcefully(connection.stream)

    def shed_waiting(self) -> None:
        """Close the SHED_ON_EMFILE connections that have waited longest for a request head."""
        waiting = [(since, connection) for connection in self.connections
                   if (since := connection.waiting_since) is not None]
        waiting.sort(key=lambda pair: pair[0])
        for _, connection in waiting[:SHED_ON_EMFILE]:
            connection.drain()
        log.warning("http_out_of_file_descriptors connections=%d closed_waiting=%d",
                    len(self.connections),
                    min(len(waiting), SHED_ON_EMFILE))

    async def _connection(self, stream: trio.SocketStream) -> None:
        connection = Connection(self, stream)
        self.connections.add(connection)
        if self.on_connections is not None:
            self.on_connections(len(self.connections))
        try:
            await connection.run()
            await connection.linger()
        except Exception:
            log.exception("http_connection_error")
        finally:
            self.connections.discard(connection)
            if self.on_connections is not None:
                self.on_connections(len(self.connections))
            if self.draining and not self.connections:
                self._none_left.set()
            connection.forget_hangups()

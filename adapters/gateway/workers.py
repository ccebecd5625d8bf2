"""`relayline serve --workers N`: N gateway processes on one port.

The supervisor binds one listening socket per worker on the same port (SO_REUSEPORT) and starts
N workers (`relayline serve --listen-fd`), each running the whole gateway on its own inherited
socket; the kernel spreads new connections over the sockets by their addresses. One socket
shared by all workers went to whichever worker woke first, and it accepts a whole backlog at
once (listen.py): 16 clients connecting together all landed on one worker while the other idled
(bench/workers.py). Where SO_REUSEPORT does not spread connections (not Linux), the workers
share one socket as before. The supervisor keeps every socket open, so a worker started again
takes over its predecessor's socket and the connections waiting in its backlog (they wait for
it: at most about a second).

A worker is a separate process with its own health unless the config names a shared store
([health] store = "redis://..."): the supervisor says which at start. It forwards SIGHUP
(reload the config) to every worker, and SIGTERM/SIGINT (stop), then waits for them; a worker
that dies is started again (at most once a second).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

from relayline.machines.config import Config

RESTART_PAUSE_S = 1.0
STOP_WAIT_S = 60.0


def listening_socket(host: str, port: int, backlog: int = 2048, *, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def listening_sockets(host: str, port: int, workers: int) -> list[socket.socket]:
    """One socket per worker on one port where the kernel balances among them (Linux's
    SO_REUSEPORT), else one socket for all. The first bind picks the port when it is 0."""
    if workers < 2 or not sys.platform.startswith("linux") or not hasattr(socket, "SO_REUSEPORT"):
        return [listening_socket(host, port)]
    first = listening_socket(host, port, reuse_port=True)
    sockets = [first]
    try:
        for _ in range(workers - 1):
            sockets.append(listening_socket(host, first.getsockname()[1], reuse_port=True))
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def health_note(config: Config, workers: int) -> str:
    store = config.health.store
    if store == "memory":
        return (f"health: in memory, so each of the {workers} workers keeps its own breakers and cooldowns "
                '(set [health] store = "redis://..." to share them)')
    where = store.rsplit("@", 1)[-1].split("://", 1)[-1]  # never a password
    return f"health: shared by the {workers} workers in Redis at {where}"


def supervise(config_path: str, config: Config, *, host: str, port: int, workers: int,
              worker_args: tuple[str, ...] = ()) -> int:
    sockets = listening_sockets(host, port, workers)
    bound_host, bound_port = sockets[0].getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"{health_note(config, workers)}\nrelayline gateway listening on http://{shown}:{bound_port} "
          f"({workers} workers)", file=sys.stderr, flush=True)

    def start(i: int) -> subprocess.Popen:
        fd = sockets[i % len(sockets)].fileno()
        return subprocess.Popen([sys.executable, "-m", "relayline.adapters.cli", "serve", "--config", config_path,
                                 "--listen-fd", str(fd), *worker_args], pass_fds=(fd,))

    procs = [start(i) for i in range(workers)]
    stopping: list[int] = []

    def forward(signum, _frame) -> None:
        if signum != signal.SIGHUP:
            stopping.append(signum)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM if signum != signal.SIGHUP else signal.SIGHUP)

    for signum in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    last_restart = 0.0
    try:
        while not stopping:
            for i, proc in enumerate(procs):
                if proc.poll() is not None and not stopping and time.monotonic() - last_restart >= RESTART_PAUSE_S:
                    print(f"relayline worker {proc.pid} exited with {proc.returncode}: starting another",
                          file=sys.stderr, flush=True)
                    last_restart = time.monotonic()
                    procs[i] = start(i)
            time.sleep(0.1)
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        for sock in sockets:
            sock.close()
    return 0

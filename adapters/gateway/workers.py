"""`relayline serve --workers N`: N gateway processes on one port.

The supervisor binds the listening socket once and starts N workers (`relayline serve
--listen-fd`), each running the whole gateway on that inherited socket; the kernel hands each
new connection to one of them. A worker is a separate process with its own health unless the
config names a shared store ([health] store = "redis://..."): the supervisor says which at
start. It forwards SIGHUP (reload the config) to every worker, and SIGTERM/SIGINT (stop), then
waits for them; a worker that dies is started again (at most once a second).
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


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def health_note(config: Config, workers: int) -> str:
    store = config.health.store
    if store == "memory":
        return (f"health: in memory, so each of the {workers} workers keeps its own breakers and cooldowns "
                '(set [health] store = "redis://..." to share them)')
    where = store.rsplit("@", 1)[-1].split("://", 1)[-1]  # never a password
    return f"health: shared by the {workers} workers in Redis at {where}"


def supervise(config_path: str, config: Config, *, host: str, port: int, workers: int,
              worker_args: tuple[str, ...] = ()) -> int:
    sock = listening_socket(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"{health_note(config, workers)}\nrelayline gateway listening on http://{shown}:{bound_port} "
          f"({workers} workers)", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "relayline.adapters.cli", "serve", "--config", config_path,
               "--listen-fd", str(sock.fileno()), *worker_args]

    def start() -> subprocess.Popen:
        return subprocess.Popen(command, pass_fds=(sock.fileno(),))

    procs = [start() for _ in range(workers)]
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
                    procs[i] = start()
            time.sleep(0.1)
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        sock.close()
    return 0

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

A worker started again starts on the config the fleet last took (`LastGood`), not on whatever
the file holds by then: a file the workers refused on SIGHUP made every restart exit 2 at once,
and the fleet served a worker short for good. The supervisor judges the file at each SIGHUP as
a worker's reload does (reload.py) and keeps a copy of the last good one for its restarts.

A worker is a separate process with its own health unless the config names a shared store
([health] store = "redis://..."): the supervisor says which at start. It forwards SIGHUP
(reload the config; a worker's POST /admin/reload asks for one too) to every worker, and
SIGTERM/SIGINT (stop), then waits for them (their drain_s and a grace); a worker that dies is
started again (at most once a second), and on Linux a supervisor that dies (SIGKILL) stops its
workers the usual way (a parent-death SIGTERM).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from functools import partial
from types import FrameType

from relayline.machines.config import Config, structure_config
from relayline.machines.errors import ConfigError
from relayline.machines.plan import build_router

from ..configfile import config_document, load_config_file, read_config_bytes
from .auth import load_access
from .reload import EarlyReloads, accept_reload

RESTART_PAUSE_S = 1.0
# beyond drain_s, what a worker still does before it exits: the cancelled turns' ledger rows (a
# PostgreSQL write may wait 10 s) and its close; after it, a worker is killed
STOP_GRACE_S = 30.0


def _libc_prctl() -> ctypes._NamedFuncPointer | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return None


_PRCTL = _libc_prctl()
_PR_SET_PDEATHSIG = 1


def _before_worker(supervisor: int) -> None:
    """In a worker, before it runs: SIGHUP is blocked until the worker can note it (a SIGHUP
    forwarded to a worker still starting ended it, by the default action: a reload during a
    restart took the fleet a worker short; ignored, the worker missed the reload and served the
    file's previous version), and the supervisor's death (SIGKILL, the OOM killer: nothing
    forwards a stop then) is a SIGTERM to the worker, its usual drain. Without that the workers
    served on as orphans holding the port, beside the next supervisor's on the old config."""
    # (the mask is kept across exec, and a blocked SIGHUP waits there: reload.EarlyReloads)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != supervisor:  # it died before the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def listening_socket(host: str, port: int, backlog: int = 2048, *,
                     reuse_port: bool = False) -> socket.socket:
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
        return (f"health: in memory, so each of the {workers} workers keeps its own breakers and "
                "cooldowns "
                '(set [health] store = "redis://..." to share them)')
    where = store.rsplit("@", 1)[-1].split("://", 1)[-1]  # never a password
    return f"health: shared by the {workers} workers in Redis at {where}"


def stop_wait_s(config_path: str, config: Config) -> float:
    """How long the workers get to stop: their drain_s (the longest of the one they started with
    and the file's now: a reload may have raised it), then STOP_GRACE_S. A fixed wait shorter
    than drain_s killed workers mid-drain, and their turns' ledger rows with them."""
    drain = config.gateway.drain_s
    try:
        # (read as a reload reads it)
        drain = max(drain, load_config_file(config_path).gateway.drain_s)
    except ConfigError:
        pass  # (a file the workers would refuse to reload: they drain as they started)
    return drain + STOP_GRACE_S


class LastGood:
    """The config file as the fleet last took it, kept in a private copy that workers started
    again load (the file itself stays the one their reloads read)."""

    def __init__(self, path: str, env: Mapping[str, str], host: str | None = None) -> None:
        """ConfigError when the file is no config the workers could start on."""
        self.path = path
        self.env = env
        self.host = host  # where the fleet listens (a reload never makes it keyless there)
        data = read_config_bytes(path)
        self.config = structure_config(config_document(data, path))
        build_router(self.config, env)  # a config that cannot serve fails here, not in N workers
        self.access = load_access(self.config, env)
        self._folder = tempfile.TemporaryDirectory(prefix="relayline-config-")
        self.copy = os.path.join(self._folder.name, "last-good.toml")
        self._keep(data)

    def _keep(self, data: bytes) -> None:
        fresh = self.copy + ".new"
        with open(fresh, "wb") as out:
            out.write(data)
        os.replace(fresh, self.copy)

    def judge(self) -> bool:
        """The file read again, as a worker's reload reads it: kept when the workers take it."""
        try:
            data = read_config_bytes(self.path)
            config = structure_config(config_document(data, self.path))
            build_router(config, self.env)
            access = accept_reload(self.config, self.access, config, self.env, self.host)
        except ConfigError:
            return False  # the workers refuse it too: the last good one stays
        self._keep(data)
        self.config, self.access = config, access
        return True

    def close(self) -> None:
        self._folder.cleanup()


def supervise(last_good: LastGood, *, host: str, port: int, workers: int,
              worker_args: tuple[str, ...] = (),
              early: EarlyReloads | None = None) -> int:
    """Run `workers` workers of the config `last_good` holds until SIGTERM or SIGINT. A worker
    asks for a reload of the fleet (its admin reload) as a SIGHUP to the supervisor; one that
    came before this runs (`early`) is done once the workers started."""
    config_path, config = last_good.path, last_good.config
    sockets = listening_sockets(host, port, workers)
    bound_host, bound_port = sockets[0].getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"{health_note(config, workers)}\nrelayline gateway listening on "
          f"http://{shown}:{bound_port} "
          f"({workers} workers)", file=sys.stderr, flush=True)

    supervisor = os.getpid()

    def start(i: int) -> subprocess.Popen[bytes]:
        fd = sockets[i % len(sockets)].fileno()
        return subprocess.Popen([sys.executable, "-m", "relayline.adapters.cli", "serve",
                                 "--config", config_path,
                                 "--start-config", last_good.copy, "--listen-fd", str(fd), "--host",
                                 host,
                                 "--supervisor", str(supervisor), *worker_args],
                                pass_fds=(fd,), preexec_fn=partial(_before_worker, supervisor))

    procs: list[subprocess.Popen[bytes]] = []
    stopping: list[int] = []
    stopped: set[int] = set()  # the workers told to stop (a second SIGTERM would cut their drain)
    reloads: list[int] = []  # SIGHUPs not yet passed on

    def forward(signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGHUP and stopping:
            # the workers drain on their config; written raw: a handler may interrupt a print
            os.write(2, b"relayline: reload refused: the fleet is stopping (draining)\n")
            return
        if signum == signal.SIGHUP:
            reloads.append(signum)  # passed on once the file is judged (below)
            return
        stopping.append(signum)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                stopped.add(proc.pid)

    # (before any worker starts: a stop that arrives meanwhile is forwarded, not the
    # supervisor's own death by the default action with its workers left running)
    for signum in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    if early is not None and early.take():
        reloads.append(signal.SIGHUP)
    last_restart = 0.0
    try:
        for i in range(workers):
            procs.append(start(i))
        while not stopping:
            if reloads:
                # judged first, then passed on, so that the workers read the version judged
                # here (passed on at once, the workers read a good file that was rewritten bad
                # before the supervisor read it: its last good was then older than theirs); a
                # burst of SIGHUPs is one reload
                reloads.clear()
                last_good.judge()
                for proc in procs:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGHUP)
            for i, proc in enumerate(procs):
                if (
                    proc.poll() is not None
                    and not stopping
                    and time.monotonic() - last_restart >= RESTART_PAUSE_S
                ):
                    print(f"relayline worker {proc.pid} exited with {proc.returncode}: starting "
                          "another",
                          file=sys.stderr, flush=True)
                    last_restart = time.monotonic()
                    procs[i] = start(i)
            time.sleep(0.1)
        for proc in procs:  # one started as the stop arrived
            if proc.pid not in stopped and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + stop_wait_s(config_path, last_good.config)
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        for sock in sockets:
            sock.close()
        last_good.close()
    return 0

"""Real redis-server and PostgreSQL servers on loopback ports, for the fleet tests.

`.ci/services` installs the Debian packages when they are missing (as root); these classes start
a private server in a temporary directory, hand out its URL, and stop it after. Where a server
cannot run here, `unavailable()` says why and the tests skip with that reason.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen | None, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {seconds} s")


class RedisServer:
    """One redis-server without persistence: a restart starts empty, as after a crash."""

    def __init__(self) -> None:
        self.binary = shutil.which("redis-server")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="relayline-redis-")
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def unavailable() -> str | None:
        if shutil.which("redis-server") is None:
            return "redis-server is not installed (.ci/services installs it as root with apt-get)"
        return None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_port(self.port, self.proc, 10)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def _children(parent: int) -> list[int]:
    """The processes whose parent is `parent` (from /proc: no procps needed)."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # (it ended meanwhile)
            continue
        if int(fields[1]) == parent:
            found.append(int(stat.split("/")[2]))
    return found


def _wait_stopped(pid: int, seconds: float = 10.0) -> None:
    """Until `pid` is stopped by a signal (state T in /proc), or gone."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # (it ended meanwhile)
            return
        if state in ("T", "t", "Z", "X"):
            return
        time.sleep(0.001)
    raise RuntimeError(f"process {pid} did not stop within {seconds} s")


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # (a backend that was ending as it was listed)
        pass


def _postgres_bin() -> str | None:
    found = shutil.which("initdb")
    if found:
        return os.path.dirname(os.path.realpath(found))
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return os.path.dirname(dirs[-1]) if dirs else None


class PostgresServer:
    """A private PostgreSQL cluster (initdb into a temporary directory). PostgreSQL refuses to
    run as root: as root, the cluster belongs to the unprivileged `postgres` user."""

    def __init__(self) -> None:
        self.bin = _postgres_bin()
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="relayline-pg-")
        self.data = os.path.join(self.dir, "data")
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    @staticmethod
    def unavailable() -> str | None:
        if _postgres_bin() is None:
            return "PostgreSQL is not installed (.ci/services installs it as root with apt-get)"
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                return "running as root and there is no unprivileged postgres user to own the cluster"
            if shutil.which("runuser") is None:
                return "running as root without runuser to drop privileges for PostgreSQL"
        return None

    @property
    def url(self) -> str:
        return f"postgresql://relayline@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        subprocess.run([*self._as, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       timeout=120, cwd=self.dir)

    def start(self) -> None:
        self._run(os.path.join(self.bin, "initdb"), "-D", self.data, "-A", "trust", "-U", "relayline",
                  "-E", "UTF8", "--no-sync")
        self._start()

    def _start(self) -> None:
        self._run(os.path.join(self.bin, "pg_ctl"), "-D", self.data, "-l", os.path.join(self.dir, "log"), "-w",
                  "-t", "60", "-o", f"-p {self.port} -h 127.0.0.1 -k {self.dir} -F -c max_connections=60",
                  "start")
        _wait_for_port(self.port, None, 30)

    def restart(self) -> None:
        """Killed (as a crash: every connection cut) and started again on the same port."""
        self._run(os.path.join(self.bin, "pg_ctl"), "-D", self.data, "-m", "immediate", "-w", "stop")
        self._start()

    @contextmanager
    def frozen(self):
        """Every process of the cluster stopped (SIGSTOP) for the block, then resumed: a server
        that hangs with its connections open, as one swapping or stalled on its disk does. The
        kernel still accepts connections and data for it; nothing answers."""
        with open(os.path.join(self.data, "postmaster.pid")) as f:
            postmaster = int(f.readline())
        # the postmaster first, and seen stopped before its children are listed: a kill() only
        # queues the signal, and a postmaster still running for a moment could fork a backend
        # the list misses, which would go on answering its connection through the freeze
        os.kill(postmaster, signal.SIGSTOP)
        _wait_stopped(postmaster)
        pids = [postmaster, *_children(postmaster)]
        for pid in pids[1:]:
            _signal(pid, signal.SIGSTOP)
        for pid in pids[1:]:
            _wait_stopped(pid)
        try:
            yield
        finally:
            for pid in pids:
                _signal(pid, signal.SIGCONT)

    def stop(self) -> None:
        if os.path.exists(os.path.join(self.data, "postmaster.pid")):
            subprocess.run([*self._as, os.path.join(self.bin, "pg_ctl"), "-D", self.data, "-m", "immediate", "-w",
                            "stop"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60,
                           cwd=self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)

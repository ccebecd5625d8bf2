"""The processes a bench starts: a gateway is ready once it logs where it listens, and every
process is stopped at the end, killed if it does not go within ten seconds (a bench never leaves
a server behind)."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterable


def listening(proc: subprocess.Popen, name: str = "the gateway", timeout_s: float = 30.0) -> str:
    """The base URL `relayline serve` logged it listens on (its stderr, a text pipe)."""
    deadline = time.monotonic() + timeout_s
    line = ""
    while time.monotonic() < deadline and "listening on" not in line:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
    found = re.search(r"http://[\d.]+:\d+", line)
    if found is None:
        raise RuntimeError(f"{name} did not say where it listens within {timeout_s:.0f} s")
    return found.group(0)


def stop(procs: Iterable[subprocess.Popen]) -> None:
    procs = list(procs)
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

"""A fleet (`relayline serve --workers N`) reloads as one: POST /admin/reload, which lands on
one worker, reloads every worker as a SIGHUP to the supervisor does; a SIGHUP that comes while a
worker is still starting is kept for when it listens, not lost. Real processes, raw sockets
over loopback, a real loopback upstream."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

import httpx
import pytest
from fleet import ServeProcess, Upstream, fleet_config
from test_workers_reload import _children, _connections_on

from helpers import sim_toml

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="one socket per worker (SO_REUSEPORT) shows which worker answers")

KEYS = {"FLEET_RELOAD_KEYS": "fleet-reload-key"}
AUTH = {"authorization": "Bearer fleet-reload-key"}
GATEWAY = '[gateway]\napi_keys_env = "FLEET_RELOAD_KEYS"'
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def upstream():
    with Upstream() as up:
        yield up


def _workers(gateway: ServeProcess, count: int) -> list[int]:
    deadline = time.monotonic() + 20
    workers = _children(gateway.proc.pid)
    while len(workers) < count and time.monotonic() < deadline:
        time.sleep(0.05)
        workers = _children(gateway.proc.pid)
    assert len(workers) == count, workers
    return workers


def _served_by_every_worker(gateway: ServeProcess, workers: int, connections: int = 32) -> dict[int, set[str]]:
    """What each worker's answers name as served: `connections` keep-alive clients connect
    together (the kernel spreads them over the workers' sockets), each asks once, and each
    connection is traced to the worker holding it."""
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": "model-a", "messages": HI}).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: {AUTH['authorization']}\r\n"
               f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
    clients = [socket.create_connection((host, int(port)), timeout=20) for _ in range(connections)]
    try:
        served: dict[int, str] = {}
        for client in clients:
            client.sendall(request)
        for client in clients:
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = client.recv(65536)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
            served[client.getsockname()[1]] = json.loads(answer.split(b"\r\n\r\n", 1)[1])["relayline"]["served"]
        by_worker: dict[int, set[str]] = {}
        for pid in _children(gateway.proc.pid):
            for peer, name in served.items():
                if _connections_on(pid, int(port), {peer}):
                    by_worker.setdefault(pid, set()).add(name)
    finally:
        for client in clients:
            client.close()
    assert len(by_worker) == workers, by_worker  # every worker answered some (32 clients: all but certain)
    return by_worker


def test_an_admin_reload_on_one_worker_reloads_every_worker_and_a_bad_file_changes_none(tmp_path, upstream):
    """POST /admin/reload reached the one worker its connection landed on: the others served
    the old file until a SIGHUP to the supervisor. Now the worker answers and asks its
    supervisor, which reloads the whole fleet."""
    config = tmp_path / "fleet.toml"
    config.write_text(fleet_config(upstream, chain=("a", "b"), extra=GATEWAY))
    upstream.set("a", status=503)  # every turn falls back: the chain names who serves
    with ServeProcess(config, "--workers", "3", env=KEYS) as gateway:
        _workers(gateway, 3)
        assert set().union(*_served_by_every_worker(gateway, 3).values()) == {"b/model-b"}
        config.write_text(fleet_config(upstream, chain=("a", "c"), extra=GATEWAY))
        r = httpx.post(f"{gateway.url}/admin/reload", headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json()["reloaded"] is True
        deadline = time.monotonic() + 15
        while gateway.stderr.count("config_reloaded") < 4 and time.monotonic() < deadline:
            time.sleep(0.05)  # the answering worker, then all three on the supervisor's SIGHUP
        assert gateway.stderr.count("config_reloaded") == 4, gateway.stderr
        by_worker = _served_by_every_worker(gateway, 3)
        assert all(names == {"c/model-c"} for names in by_worker.values()), by_worker

        config.write_text(fleet_config(upstream, chain=("a", "b"), extra=GATEWAY).replace(
            "[gateway]", '[gateway]\nmax_body_bytes = "big"'))
        refused = httpx.post(f"{gateway.url}/admin/reload", headers=AUTH, timeout=30)
        assert refused.status_code == 422 and "gateway.max_body_bytes" in refused.json()["problems"][0]
        time.sleep(1.0)  # (a reload asked of the supervisor would be under way by now)
        assert gateway.stderr.count("config_reload_rejected") == 1, "the fleet was not asked"
        by_worker = _served_by_every_worker(gateway, 3)
        assert all(names == {"c/model-c"} for names in by_worker.values()), by_worker
        assert "Traceback" not in gateway.stderr and "fleet-reload-key" not in gateway.stderr


def test_a_sighup_while_a_worker_starts_is_reloaded_once_it_listens(tmp_path, upstream):
    """A worker started again (its predecessor died) while the fleet reloads: the SIGHUP came
    while it was still starting and was ignored, and the worker served the file's previous
    version, beside workers on the new one, until the next reload. Here the SIGHUP goes to the
    new worker itself, as the supervisor forwards it, as soon as it runs relayline."""
    config = tmp_path / "fleet.toml"
    config.write_text(fleet_config(upstream, chain=("a", "b"), extra=GATEWAY))
    upstream.set("a", status=503)  # every turn falls back: the chain names who serves
    with ServeProcess(config, "--workers", "2", env=KEYS) as gateway:
        first = _workers(gateway, 2)
        # the file changes and the supervisor is not told: a worker started again starts on the
        # last good copy (chain a -> b), and only a reload reads the file (a -> c)
        config.write_text(fleet_config(upstream, chain=("a", "c"), extra=GATEWAY))
        os.kill(first[0], signal.SIGKILL)
        deadline = time.monotonic() + 15
        fresh = None
        while fresh is None and time.monotonic() < deadline:
            fresh = next((pid for pid in _children(gateway.proc.pid) if pid not in first and _runs_serve(pid)), None)
            time.sleep(0.002)
        assert fresh is not None, "no worker started again"
        os.kill(fresh, signal.SIGHUP)  # it is still importing: nothing listens for SIGHUP yet
        deadline = time.monotonic() + 20
        while gateway.stderr.count("listening on") < 4 and time.monotonic() < deadline:
            time.sleep(0.05)  # the supervisor's line, two workers', the new one's
        assert "config_reloaded" in _wait_for(gateway, "config_reloaded", 15)
        by_worker = _served_by_every_worker(gateway, 2)
        assert by_worker[fresh] == {"c/model-c"}, by_worker
        assert by_worker[first[1]] == {"b/model-b"}, by_worker  # (it was sent nothing)


def _runs_serve(pid: int) -> bool:
    """Whether `pid` runs relayline's worker already (exec done, so SIGHUP is as the worker
    starts with it)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"--listen-fd" in f.read()
    except FileNotFoundError:
        return False


def _wait_for(gateway: ServeProcess, text: str, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while text not in gateway.stderr and time.monotonic() < deadline:
        time.sleep(0.05)
    return gateway.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sighups_beside_a_stop_leave_the_exit_status_zero(tmp_path, workers):
    """A reload sent beside a stop (a config manager's SIGHUP as the service stops): Python gives
    every signal it handled its default action back as it exits, and a SIGHUP then ended the
    gateway, or the fleet's supervisor, as hung up (-1), not with its status 0."""
    config = tmp_path / "stop.toml"
    config.write_text(sim_toml("m", ledger={"path": str(tmp_path / "l.sqlite3")}))
    for _ in range(2):
        gateway = ServeProcess(config, "--workers", workers)
        try:
            if workers == "2":
                _workers(gateway, 2)
            gateway.signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while gateway.proc.poll() is None and time.monotonic() < deadline:
                try:
                    gateway.signal(signal.SIGHUP)
                except ProcessLookupError:
                    break
                time.sleep(0.002)
            assert gateway.proc.wait(30) == 0, gateway.stderr
        finally:
            gateway.stop()

"""`relayline serve --workers N` and live reload (SIGHUP, POST /admin/reload), end to end over real
loopback sockets, with the PostgreSQL ledger and the Redis health store where a fleet needs them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import trio
from fleet import ServeProcess, Upstream, fleet_config

from helpers import raw_post, sim_toml
from relayline.adapters import Relay
from relayline.adapters.gateway import Gateway
from relayline.adapters.gateway.reload import Reloader

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def upstream():
    with Upstream() as up:
        yield up


@pytest.fixture
def pg_url(postgres_server):
    import psycopg

    name = f"w{time.monotonic_ns()}"
    with psycopg.connect(postgres_server.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres_server.url.rsplit("/", 1)[0] + "/" + name


def test_workers_with_the_memory_store_say_each_keeps_its_own_health(tmp_path, upstream):
    config = tmp_path / "memory.toml"
    config.write_text(fleet_config(upstream, extra=f'[ledger]\npath = "{tmp_path / "l.sqlite3"}"'))
    with ServeProcess(config, "--workers", "2") as gateway:
        assert "2 workers" in gateway.stderr
        assert "health: in memory, so each of the 2 workers keeps its own" in gateway.stderr
        with httpx.Client(timeout=20) as client:
            for _ in range(6):
                r = client.post(f"{gateway.url}/v1/chat/completions",
                                json={"model": "model-a", "messages": HI}, headers={"connection": "close"})
                assert r.status_code == 200 and r.json()["relayline"]["served"] == "a/model-a"


def test_a_thousand_concurrent_turns_through_two_workers_are_each_one_postgres_row(
        tmp_path, upstream, pg_url, redis_server):
    config = tmp_path / "pg.toml"
    config.write_text(fleet_config(upstream, extra=f"""
[ledger]
url = "{pg_url}"
[health]
store = "{redis_server.url}"
key_prefix = "pg1000:"
"""))
    statuses: list[int] = []
    with ServeProcess(config, "--workers", "2") as gateway:
        assert "health: shared by the 2 workers in Redis" in gateway.stderr

        async def drive():
            limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                async def one():
                    r = await client.post(f"{gateway.url}/v1/chat/completions",
                                          json={"model": "model-a", "messages": HI})
                    statuses.append(r.status_code)

                async with trio.open_nursery() as nursery:
                    for _ in range(1000):
                        nursery.start_soon(one)

        trio.run(drive)
    assert statuses == [200] * 1000
    sent = upstream.count("a") + upstream.count("b")
    assert sent == 1000  # the upstream's own log: every billable attempt it answered
    out = subprocess.run([sys.executable, "-m", "relayline.adapters.cli", "ledger", "--json", "--config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert sum(r["accepted"] + r["rejected"] for r in rows) == sent
    assert sum(r["input_tokens"] for r in rows) == 10 * sent and sum(r["output_tokens"] for r in rows) == 5 * sent
    assert sum(r["accepted_cost_usd"] for r in rows) == pytest.approx(sent * (10 * 1.0 + 5 * 2.0) / 1e6)


def test_reload_under_load_keeps_streams_in_flight_and_refuses_a_broken_file(tmp_path, upstream):
    chain_b = fleet_config(upstream, chain=("a", "b"), extra='[gateway]\napi_keys_env = "FLEET_TEST_KEYS"')
    chain_c = fleet_config(upstream, chain=("a", "c"), extra='[gateway]\napi_keys_env = "FLEET_TEST_KEYS"')
    config = tmp_path / "reload.toml"
    config.write_text(chain_b)
    upstream.set("a", frames=8, pause=0.15)  # each stream is in flight for over a second
    key = {"authorization": "Bearer fleet-key"}
    with ServeProcess(config, env={"FLEET_TEST_KEYS": "fleet-key"}) as gateway:
        texts: list[str] = []

        async def stream_one(client):
            async with client.stream("POST", f"{gateway.url}/v1/chat/completions", headers=key,
                                     json={"model": "model-a", "messages": HI, "stream": True}) as r:
                assert r.status_code == 200
                body = (await r.aread()).decode()
            assert "data: [DONE]" in body and '"error"' not in body
            texts.append("".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                                 for line in body.splitlines()
                                 if line.startswith("data: {") and json.loads(line[6:])["choices"]))

        async def drive():
            limits = httpx.Limits(max_connections=250)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client, trio.open_nursery() as nursery:
                for _ in range(200):
                    nursery.start_soon(stream_one, client)
                await trio.sleep(0.5)
                config.write_text(chain_c)
                gateway.signal(signal.SIGHUP)  # the fallback chain changes while 200 streams run

        trio.run(drive)
        assert len(texts) == 200 and set(texts) == {"".join(f"from a {i}. " for i in range(8))}
        assert "config_reloaded" in gateway.stderr
        with httpx.Client(timeout=20, headers=key) as client:
            upstream.set("a", status=503)
            r = client.post(f"{gateway.url}/v1/chat/completions", json={"model": "model-a", "messages": HI})
            assert r.status_code == 200 and r.json()["relayline"]["served"] == "c/model-c"  # the new chain

            config.write_text(chain_b.replace("[gateway]", "[gateway]\nmax_body_bytes = \"big\""))
            gateway.signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while "config_reload_rejected" not in gateway.stderr and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "gateway.max_body_bytes: expected an integer" in gateway.stderr
            refused = client.post(f"{gateway.url}/admin/reload")
            assert refused.status_code == 422 and refused.json()["reloaded"] is False
            assert "gateway.max_body_bytes: expected an integer" in refused.json()["problems"][0]
            r = client.post(f"{gateway.url}/v1/chat/completions", json={"model": "model-a", "messages": HI})
            assert r.json()["relayline"]["served"] == "c/model-c", "a refused file changes nothing"
            assert httpx.post(f"{gateway.url}/admin/reload").status_code == 401  # admin only


BREAKER = {"failure_threshold": 1, "open_s": 600}
TWO = sim_toml("m1", "m2", breaker=BREAKER)


async def test_a_reload_keeps_the_health_of_profiles_that_remain_and_forgets_the_others(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text(TWO)
    relay = Relay.from_file(path, env={})
    gateway = Gateway(relay)
    reloader = Reloader(gateway, path, env={})
    now = trio.current_time()
    relay.health.breaker("sim.a").failure(now)
    relay.health.set_cooldown("sim.b", now + 100)
    assert relay.health.breaker("sim.a").state == "open"
    path.write_text(sim_toml("m1", breaker={**BREAKER, "open_s": 900}))
    report = await reloader.reload()
    assert report.ok and report.profiles == ("sim.a",)
    assert gateway.relay is not relay and gateway.relay.health is relay.health
    assert gateway.relay.health.breaker("sim.a").state == "open"  # kept
    assert gateway.relay.health.breaker("sim.a").config.open_s == 900  # under the new settings
    assert gateway.relay.health.cooldown_until("sim.b") == float("-inf")  # sim.b is gone: forgotten
    path.write_text(sim_toml("m1", "m2", breaker=BREAKER, health={"store": "redis://127.0.0.1:1/0"}))
    refused = await reloader.reload()
    assert not refused.ok and refused.problems[0].startswith("health: changed")
    current = gateway.relay
    path.write_text(sim_toml("m1", "m2", breaker=BREAKER, gateway={"api_keys_env": "RELAYLINE_TEST_UNSET_KEYS"}))
    refused = await reloader.reload()
    assert not refused.ok and "RELAYLINE_TEST_UNSET_KEYS" in " ".join(refused.problems)
    assert gateway.relay is current, "a refused file changes nothing"
    assert gateway.relay.health.breaker("sim.a").config.open_s == 900


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT spreads connections on Linux")
def test_workers_share_the_connections_of_clients_that_connect_together(tmp_path, upstream):
    """Each worker listens on its own socket of the port (SO_REUSEPORT): 32 keep-alive clients
    connecting at once land on both workers. On one shared socket the first worker to wake
    accepted the whole burst and the other idled."""

    config = tmp_path / "spread.toml"
    config.write_text(fleet_config(upstream, extra=f'[ledger]\npath = "{tmp_path / "l.sqlite3"}"'))
    with ServeProcess(config, "--workers", "2") as gateway:
        host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
        workers = _children(gateway.proc.pid)
        deadline = time.monotonic() + 20
        while len(workers) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            workers = _children(gateway.proc.pid)
        body = json.dumps({"model": "model-a", "messages": HI}).encode()
        request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                   f"content-length: {len(body)}\r\n\r\n").encode() + body
        clients = [socket.create_connection((host, int(port)), timeout=20) for _ in range(32)]
        peers = {client.getsockname()[1] for client in clients}
        try:
            for client in clients:
                client.sendall(request)
            for client in clients:
                assert client.recv(65536).startswith(b"HTTP/1.1 200")
            held = {}
            for pid in _children(gateway.proc.pid):  # read again: a child seen earlier may be gone
                try:
                    connections = _connections_on(pid, int(port), peers)
                except FileNotFoundError:  # a short-lived child of the supervisor, not a worker
                    continue
                if connections:
                    held[pid] = connections
        finally:
            for client in clients:
                client.close()
    assert len(held) == 2 and sum(held.values()) == 32, held
    assert min(held.values()) >= 4, held  # a fair coin gives fewer than 4 of 32 once in a million


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(child) for child in out]


def _connections_on(pid: int, port: int, peers: set[int]) -> int:
    """Established TCP connections on local `port` from one of the local ports `peers`, whose
    socket `pid` holds (from /proc). The peers matter: other processes on the machine (another
    suite running beside this one) may connect to a port a gateway of theirs had before ours."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                peer_port = int(fields[2].rsplit(":", 1)[1], 16)
                if (local_port == port and peer_port in peers and fields[3] == "01"  # 01: ESTABLISHED
                        and fields[9] in inodes):
                    count += 1
    return count


def test_workers_on_one_sqlite_ledger_commit_each_turns_row_before_its_answer_ends_while_the_lock_is_taken(
        tmp_path, upstream):
    """Three workers, one SQLite file, and another process's connection taking its write lock
    again and again: the moment a client has an answer's last byte, streamed or not, in either
    dialect, its turn's accepted row is in the file (the guarantee the speed work must keep)."""
    import re
    import sqlite3
    import threading

    path = tmp_path / "l.sqlite3"
    config = tmp_path / "locked.toml"
    config.write_text(fleet_config(upstream, extra=f'[ledger]\npath = "{path}"'))
    with ServeProcess(config, "--workers", "3") as gateway:

        def turn(stream: bool, dialect: str) -> bytes:
            body = json.dumps({"model": "model-a", "stream": stream, "max_tokens": 16, "messages": HI}).encode()
            return raw_post(gateway.url, dialect, body)

        assert turn(False, "/v1/chat/completions").startswith(b"HTTP/1.1 200")  # (the file is made)
        stop, held = threading.Event(), []

        def hold_the_lock() -> None:
            holder = sqlite3.connect(path, timeout=20, isolation_level=None)
            while not stop.is_set():
                holder.execute("BEGIN IMMEDIATE")
                time.sleep(0.02)
                holder.execute("COMMIT")
                held.append(1)
                time.sleep(0.02)
            holder.close()

        missing, answered = [], []

        def client(n: int) -> None:
            reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=20)
            for i in range(8):
                stream, dialect = (n + i) % 2 == 0, ("/v1/chat/completions", "/v1/messages")[(n // 2 + i) % 2]
                answer = turn(stream, dialect)
                assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
                turn_id = re.search(rb'"id": ?"((?:chatcmpl-|msg_)[0-9a-f]+)"', answer).group(1).decode()
                rows = reader.execute("SELECT accepted FROM attempts WHERE turn = ?", (turn_id,)).fetchall()
                (answered if rows == [(1,)] else missing).append((turn_id, stream, dialect, rows))
            reader.close()

        holder = threading.Thread(target=hold_the_lock)
        holder.start()
        clients = [threading.Thread(target=client, args=(n,)) for n in range(16)]
        try:
            for thread in clients:
                thread.start()
            for thread in clients:
                thread.join(60)
        finally:
            stop.set()
            holder.join(20)
    assert missing == [] and len(answered) == 16 * 8, missing[:5]
    assert len(held) >= 5  # (the lock was taken while the turns ran)


def test_the_supervisor_gives_workers_their_drain_s_and_more_before_it_kills_them(tmp_path):
    """A long drain (streams of reasoning models run for minutes) is the workers' to finish: the
    supervisor's wait is drain_s and a grace for the ledger rows, as the config file says at the
    stop (a reload may have raised it), never a fixed minute that SIGKILLs a worker mid-drain
    and loses its rows."""
    from relayline.adapters.gateway.workers import STOP_GRACE_S, stop_wait_s
    from relayline.machines.config import parse_config

    path = tmp_path / "c.toml"
    path.write_text(sim_toml("m", gateway={"drain_s": 300}))
    started = parse_config(path.read_text())
    assert stop_wait_s(str(path), started) == 300 + STOP_GRACE_S
    path.write_text(sim_toml("m", gateway={"drain_s": 900}))  # raised, then SIGHUP'd
    assert stop_wait_s(str(path), started) == 900 + STOP_GRACE_S
    path.write_text("not toml [")  # a broken file: the drain it started with
    assert stop_wait_s(str(path), started) == 300 + STOP_GRACE_S


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal is Linux's (prctl)")
def test_workers_whose_supervisor_was_killed_drain_and_exit_instead_of_serving_on(tmp_path, upstream):
    """A supervisor killed outright (SIGKILL, the OOM killer) cannot forward the stop: its
    workers used to serve on, orphans holding the port (with SO_REUSEPORT, beside the next
    supervisor's workers, on the old config). Each worker hears its parent's death as a SIGTERM:
    the usual drain, then exit."""
    config = tmp_path / "orphans.toml"
    config.write_text(fleet_config(upstream, extra=f'[ledger]\npath = "{tmp_path / "l.sqlite3"}"'))
    with ServeProcess(config, "--workers", "2") as gateway:
        deadline = time.monotonic() + 20
        workers = _children(gateway.proc.pid)
        while len(workers) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            workers = _children(gateway.proc.pid)
        assert httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": "model-a", "messages": HI},
                          timeout=20).status_code == 200
        gateway.proc.kill()
        gateway.proc.wait(10)
        deadline = time.monotonic() + 15
        alive = workers
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [pid for pid in workers if _running(pid)]
        for pid in alive:  # (the test's own cleanup when it fails)
            os.kill(pid, signal.SIGKILL)
    assert not alive, "workers outlived their supervisor"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_reload_events_carry_their_fields_in_json_logs(tmp_path):
    import io
    import json
    import logging

    from relayline.adapters.logs import configure

    path = tmp_path / "r.toml"
    path.write_text(TWO)
    reloader = Reloader(Gateway(Relay.from_file(path, env={})), path, env={})
    out, root = io.StringIO(), logging.getLogger()
    saved = root.handlers[:], root.level
    configure("info", "json", stream=out)
    try:
        assert (await reloader.reload()).ok
        path.write_text(sim_toml("m1", "m2", breaker=BREAKER, gateway={"max_body_bytes": "big"}))
        assert not (await reloader.reload()).ok
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    done = next(r for r in records if r["msg"] == "config_reloaded")
    refused = next(r for r in records if r["msg"] == "config_reload_rejected")
    assert done["path"] == str(path) and done["profiles"] == 2
    assert refused["path"] == str(path) and "gateway.max_body_bytes" in refused["problems"]


POOLED = """
active = "pool"
[providers.pool]
family = "openai"
base_url = "http://127.0.0.1:9/v1"
model = "m"
api_keys = [{keys}]
"""


async def test_a_reload_that_changes_a_key_pool_forgets_which_of_its_keys_sit_out(tmp_path):
    # the health names a pool's keys by place: key 0 drew a 401 and sits out, the cursor is on
    # key 1. Reordered, place 0 is the good key and place 1 the revoked one: kept, that state
    # would send the revoked key and bench the good one. An unchanged pool keeps its state.
    path = tmp_path / "pool.toml"
    path.write_text(POOLED.format(keys='"k-revoked", "k-good"'))
    relay = Relay.from_file(path, env={})
    reloader = Reloader(Gateway(relay), path, env={})
    health = relay.health
    health.set_key_cooldown("pool", 0, trio.current_time() + 60)
    health.set_key_cursor("pool", 1)
    path.write_text(POOLED.format(keys='"k-revoked", "k-good"') + "\n[reliability]\nprovider_retries = 1\n")
    assert (await reloader.reload()).ok
    assert health.key_cursor("pool") == 1 and health.key_cooldown_until("pool", 0) > trio.current_time()
    path.write_text(POOLED.format(keys='"k-good", "k-revoked"'))
    assert (await reloader.reload()).ok
    assert health.key_cursor("pool") == 0 and health.key_cooldown_until("pool", 0) < trio.current_time()


@pytest.mark.parametrize(("args", "refusal"), [((), "reason=draining"),
                                               (("--workers", "2"), "reload refused: the fleet is stopping")])
def test_a_sighup_during_the_drain_is_refused_and_the_turns_finishing_keep_their_config(tmp_path, upstream, args,
                                                                                       refusal):
    """SIGTERM starts the drain; a SIGHUP then (the file rewritten, its fallback chain changed)
    is refused with a log line: swapping the config under the finishing turns would change only
    what they run on. A fleet's supervisor says so and keeps it from its workers. (An admin
    reload cannot arrive then: the drain closes every connection without a request in flight.)"""
    extra = f'[ledger]\npath = "{tmp_path / "l.sqlite3"}"\n[gateway]\napi_keys_env = "FLEET_TEST_KEYS"\ndrain_s = 30'
    config = tmp_path / "drain.toml"
    config.write_text(fleet_config(upstream, chain=("a", "b"), extra=extra))
    upstream.set("a", frames=6, pause=0.3)  # the stream is in flight for about two seconds
    with ServeProcess(config, *args, env={"FLEET_TEST_KEYS": "fleet-key"}) as gateway:
        answers: list[tuple[int, str]] = []

        async def drive():
            async with httpx.AsyncClient(timeout=30, headers={"authorization": "Bearer fleet-key"}) as client:

                async def stream():
                    async with client.stream("POST", f"{gateway.url}/v1/chat/completions",
                                             json={"model": "model-a", "messages": HI, "stream": True}) as r:
                        answers.append((r.status_code, (await r.aread()).decode()))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(stream)
                    while upstream.count("a") == 0:
                        await trio.sleep(0.02)
                    gateway.signal(signal.SIGTERM)
                    # (a SIGHUP pending beside the SIGTERM is handled first: Python runs pending
                    # handlers by signal number, so the SIGHUP waits until the drain has begun)
                    with trio.fail_after(10):
                        while "draining" not in gateway.stderr:
                            await trio.sleep(0.02)
                    config.write_text(fleet_config(upstream, chain=("a", "c"), extra=extra))
                    gateway.signal(signal.SIGHUP)

        trio.run(drive)
        [(status, body)] = answers
        assert status == 200 and "data: [DONE]" in body and '"error"' not in body
        assert gateway.proc.wait(20) == 0
        log = gateway.stderr
        assert refusal in log and "config_reloaded" not in log, log


async def test_an_admin_reload_that_meets_the_drain_is_a_503_and_changes_nothing(tmp_path):
    from helpers import asgi_post

    env = {"DRAIN_TEST_ADMIN": "admin-key"}
    gateway_table = '[gateway]\nadmin_keys_env = "DRAIN_TEST_ADMIN"\n'
    path = tmp_path / "r.toml"
    path.write_text(TWO + gateway_table)
    relay = Relay.from_file(path, env=env)
    gateway = Gateway.from_relay_config(relay, env=env)
    gateway.reloader = Reloader(gateway, path, env=env)
    await gateway.drain(0)
    path.write_text(TWO.replace("open_s = 600", "open_s = 900") + gateway_table)
    status, _, body = await asgi_post(gateway, "/admin/reload", b"", headers=[(b"authorization", b"Bearer admin-key")])
    assert status == 503 and json.loads(body)["reloaded"] is False, body
    assert "draining" in json.loads(body)["problems"][0]
    assert gateway.relay is relay

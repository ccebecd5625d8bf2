"""A fleet, end to end: `relayline serve` processes sharing one real redis-server, in front of a
loopback upstream that keeps its own request log."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fleet import ServeProcess, Upstream, fleet_config

HI = {"model": "model-a", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def upstream():
    with Upstream() as up:
        yield up


def shared_config(tmp_path, upstream, redis_server, name, open_s=1.0):
    extra = f"""
[reliability]
provider_retries = 0
backoff_ms = 50
[breaker]
failure_threshold = 2
window_s = 60
open_s = {open_s}
[health]
store = "{redis_server.url}"
key_prefix = "e2e:{name}:"
[ledger]
path = "{tmp_path / 'ledger.sqlite3'}"
"""
    path = tmp_path / "fleet.toml"
    path.write_text(fleet_config(upstream, extra=extra))
    return path


def chat(gateway, client=None):
    client = client or httpx.Client(timeout=20)
    response = client.post(f"{gateway.url}/v1/chat/completions", json=HI)
    return response.status_code, response.json()


def test_two_gateway_processes_share_breaker_probe_and_cooldown(tmp_path, upstream, redis_server):
    config = shared_config(tmp_path, upstream, redis_server, "share")
    upstream.set("a", status=503)
    with ServeProcess(config) as one, ServeProcess(config) as two:
        # failures through one open the breaker...
        for _ in range(2):
            status, body = chat(one)
            assert status == 200 and body["relayline"]["served"] == "b/model-b"
        assert upstream.count("a") == 2
        # ...that the other honours: a skip recorded, nothing sent
        status, body = chat(two)
        assert status == 200 and body["relayline"]["skipped"] == ["a/model-a breaker"]
        assert upstream.count("a") == 2

        # half-open: twenty turns at once across both processes, exactly one probe reaches a
        time.sleep(1.1)
        upstream.set("a", delay=2.0)  # the probe is in flight while every other turn arrives
        client = httpx.Client(timeout=20, limits=httpx.Limits(max_connections=40))
        with ThreadPoolExecutor(20) as pool:
            results = list(pool.map(lambda i: chat(one if i % 2 else two, client), range(20)))
        assert all(status == 200 for status, _ in results)
        assert upstream.count("a") == 3, "exactly one probe in the fleet"
        assert sum(body["relayline"]["served"] == "a/model-a" for _, body in results) == 1
        # the probe succeeded: closed for both
        assert chat(two)[1]["relayline"]["served"] == "a/model-a"

        # a 429 cooldown set through one is seen by the other
        upstream.set("a", status=429, retry_after=30)
        before = upstream.count("a")
        assert chat(one)[1]["relayline"]["served"] == "b/model-b"
        status, body = chat(two)
        assert status == 200 and body["relayline"]["skipped"] == ["a/model-a cooldown"]
        assert upstream.count("a") == before + 1


def test_redis_killed_mid_run_fails_no_request_and_shared_state_resumes(tmp_path, upstream, redis_server):
    config = shared_config(tmp_path, upstream, redis_server, "outage")
    statuses: list[int] = []
    with ServeProcess(config) as one, ServeProcess(config) as two:
        client = httpx.Client(timeout=20)

        def burst(n):
            for i in range(n):
                statuses.append(chat(one if i % 2 else two, client)[0])

        burst(20)
        redis_server.kill()
        try:
            burst(40)  # the store is down: local health, no failed request
            # and every worker stays ready (a load balancer keeps the fleet), saying why it is degraded
            for gateway in (one, two):
                ready = client.get(f"{gateway.url}/readyz")
                assert ready.status_code == 200 and ready.json()["status"] == "degraded"
                assert "does not answer" in ready.json()["checks"]["shared_store"]
        finally:
            redis_server.start()
        time.sleep(1.2)  # the store is retried once a second
        burst(20)
        assert statuses == [200] * 80
        assert client.get(f"{one.url}/readyz").json()["status"] == "ready"
        for gateway in (one, two):
            assert gateway.stderr.count("health_store_unreachable") == 1, gateway.stderr
            assert "health_store_reachable" in gateway.stderr
            assert "Traceback" not in gateway.stderr, "an outage is one warning, not a trace per retry"
        # shared state resumes: failures through one open the breaker for the other
        upstream.set("a", status=503)
        chat(one, client)
        chat(one, client)
        before = upstream.count("a")
        status, body = chat(two, client)
        assert status == 200 and body["relayline"]["skipped"] == ["a/model-a breaker"]
        assert upstream.count("a") == before

"""Limits that hold for the fleet: `relayline serve --workers 2` on one real redis-server, in
front of a loopback upstream that logs every request it gets, and clients hammering one named
key from many connections (the kernel spreads them over both workers). The fleet admits exactly
the key's rpm; with Redis killed, each `limits_on_store_error` mode does what it says."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fleet import ServeProcess, Upstream, fleet_config

KEY = "sk-fleet-search-key"
BODY = {"model": "model-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}


@pytest.fixture
def upstream():
    with Upstream() as up:
        yield up


def limited_config(tmp_path, upstream, redis_url, name, *, mode="local", **limits):
    key = "\n".join(f"{k} = {v}" for k, v in limits.items())
    extra = f"""
[health]
store = "{redis_url}"
key_prefix = "limits:{name}:"
[ledger]
path = "{tmp_path / 'ledger.sqlite3'}"
[gateway]
limits_on_store_error = "{mode}"
[[gateway.keys]]
name = "search-bot"
key_env = "FLEET_SEARCH_KEY"
{key}
"""
    path = tmp_path / "fleet.toml"
    path.write_text(fleet_config(upstream, chain=("a",), extra=extra))
    return path


def hammer(url: str, n: int) -> list[int]:
    """`n` requests at once, each on a connection of its own (new connections spread over the
    workers' sockets)."""
    def one(_):
        with httpx.Client(timeout=30) as client:
            return client.post(f"{url}/v1/chat/completions", json=BODY,
                               headers={"authorization": f"Bearer {KEY}"}).status_code
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, range(n)))


def test_two_workers_admit_exactly_the_keys_rpm_between_them(tmp_path, upstream, redis_server):
    config = limited_config(tmp_path, upstream, redis_server.url, "rpm", rpm=12)
    with ServeProcess(config, "--workers", "2", env={"FLEET_SEARCH_KEY": KEY}) as fleet:
        statuses = hammer(fleet.url, 40)
        log = fleet.stderr
    assert statuses.count(200) == 12 and statuses.count(429) == 28, (statuses, log)
    assert upstream.count("a") == 12  # the refused 28 were never sent


def test_two_workers_keep_tokens_within_one_estimate_per_worker_of_the_tpm(tmp_path, upstream, redis_server):
    # each request is estimated at 12 tokens ("hi", one message, max_tokens 10) and billed 15
    config = limited_config(tmp_path, upstream, redis_server.url, "tpm", tpm=150)
    with ServeProcess(config, "--workers", "2", env={"FLEET_SEARCH_KEY": KEY}) as fleet:
        statuses = hammer(fleet.url, 40)
    admitted = statuses.count(200)
    assert admitted == upstream.count("a")
    assert 150 // 15 <= admitted and admitted * 15 <= 150 + 2 * 15  # at most one request per worker past it


@pytest.mark.parametrize(("mode", "admitted"), [("closed", 0), ("open", 20), ("local", 4)])
def test_with_redis_gone_each_mode_does_what_it_says_and_says_so_once(tmp_path, upstream, redis_server, mode,
                                                                      admitted):
    config = limited_config(tmp_path, upstream, redis_server.url, f"down-{mode}", mode=mode, rpm=8)
    try:
        with ServeProcess(config, "--workers", "2", env={"FLEET_SEARCH_KEY": KEY}) as fleet:
            assert hammer(fleet.url, 2) == [200, 200]  # counted in Redis
            redis_server.kill()
            statuses = hammer(fleet.url, 20)
            time.sleep(0.2)
            log = fleet.stderr
    finally:
        redis_server.start()
    if mode == "local":  # each worker alone, against its share: 8 / 2 = 4 a worker, at most 8 in all
        assert 1 <= statuses.count(200) <= 8
    else:
        assert statuses.count(200) == admitted
    assert statuses.count(200) + statuses.count(429) == 20
    assert upstream.count("a") == 2 + statuses.count(200)
    outages = log.count("limits_store_unreachable")
    assert 1 <= outages <= 2, log  # once per worker that noticed it


def test_a_reload_changes_keys_and_limits_and_keeps_what_the_window_counted(tmp_path, upstream):
    import signal

    def write(rpm: int, second_key: bool) -> None:
        extra = f"""
[[gateway.keys]]
name = "search-bot"
key_env = "FLEET_SEARCH_KEY"
rpm = {rpm}
""" + ("""
[[gateway.keys]]
name = "ads-bot"
key_env = "FLEET_ADS_KEY"
""" if second_key else "")
        path.write_text(fleet_config(upstream, chain=("a",), extra=extra))

    def ask(url, key):
        return httpx.post(f"{url}/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer {key}"},
                          timeout=30).status_code

    path = tmp_path / "reloaded.toml"
    write(rpm=2, second_key=False)
    env = {"FLEET_SEARCH_KEY": KEY, "FLEET_ADS_KEY": "sk-fleet-ads-key"}
    with ServeProcess(path, env=env) as gw:
        assert [ask(gw.url, KEY) for _ in range(3)] == [200, 200, 429]
        assert ask(gw.url, "sk-fleet-ads-key") == 401
        write(rpm=3, second_key=True)
        gw.signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "config_reloaded" not in gw.stderr and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ask(gw.url, "sk-fleet-ads-key") == 200
        assert [ask(gw.url, KEY) for _ in range(2)] == [200, 429]  # 2 counted before the reload, 3 now allowed

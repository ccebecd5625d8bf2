"""[health] store = "redis://...": two workers (two Relays, each with its own mirror) sharing one
real redis-server. The breaker one opens is the other's, exactly one probe goes out when
half-open, a cooldown and a key cursor cross workers, and a store that goes away costs nothing
but a warning. Real clock: the store keeps time on Redis' clock."""

from __future__ import annotations

import logging

import pytest
import trio

from helpers import sim_toml
from relayline.adapters import Relay
from relayline.adapters.providers.sim import SimUpstream
from relayline.adapters.relay import turns_of
from relayline.adapters.stores.health import RedisHealth

HI = [{"role": "user", "content": "hi"}]


def fleet_toml(url, prefix, *, pooled=False, **breaker):
    """sim.a falling back to sim.b, their health in the redis-server at `url` under `prefix`;
    `pooled`: sim.a has two keys."""
    keys = {"api_keys": ["k0", "k1"]} if pooled else {}
    return sim_toml({"model": "m1", **keys}, "m2",
                    reliability={"provider_retries": 0, "backoff_ms": 50, "rate_limit_cooldown_default_s": 30},
                    breaker={"failure_threshold": 2, "window_s": 30, "open_s": 0.6, **breaker},
                    health={"store": url, "key_prefix": prefix})


@pytest.fixture
def prefix(request):
    return f"t:{request.node.name}:"


def worker(url, prefix, a_replies, **breaker):
    """One gateway worker: its own Relay, its own mirror, its own sim upstream (calls logged)."""
    sim = SimUpstream.from_replies([{"provider": "sim.a", "script": a_replies},
                                    {"provider": "sim.b", "script": [{"text": "from b"}]}])
    return Relay.from_toml(fleet_toml(url, prefix, **breaker), env={}, clients=sim.clients())


def sent_to(relay, profile):
    return sum(1 for c in relay.clients["sim"].upstream.calls if c.provider == profile)


async def test_a_breaker_opened_through_one_worker_is_honoured_by_the_other(redis_server, prefix):
    one = worker(redis_server.url, prefix, [{"status": 503}])
    two = worker(redis_server.url, prefix, [{"text": "a is fine here"}])
    assert isinstance(one.health, RedisHealth)
    async with one, two:
        for _ in range(2):  # failure_threshold = 2, one counted failure per turn
            result = await turns_of(one).run(HI)
            assert result.served.profile == "sim.b"
        result = await turns_of(two).run(HI)
        assert one.health.reachable and two.health.reachable
    assert sent_to(two, "sim.a") == 0, "nothing is sent to a profile the fleet opened"
    assert [str(s) for s in result.skipped] == ["sim.a/m1 breaker"]
    assert result.served.profile == "sim.b" and two.health.breaker("sim.a").state == "open"


async def test_failures_of_two_workers_add_up_to_the_fleet_threshold(redis_server, prefix):
    one = worker(redis_server.url, prefix, [{"status": 503}])
    two = worker(redis_server.url, prefix, [{"status": 503}])
    async with one, two:
        await turns_of(one).run(HI)
        assert one.health.breaker("sim.a").state == "closed"
        await turns_of(two).run(HI)  # the second failure in the window is the fleet's second
        assert two.health.breaker("sim.a").state == "open"
        result = await turns_of(one).run(HI)
    assert [str(s) for s in result.skipped] == ["sim.a/m1 breaker"] and sent_to(one, "sim.a") == 1


async def test_exactly_one_probe_in_the_fleet_when_half_open(redis_server, prefix):
    # the probe is slow, so every other turn of both workers arrives while it is in flight
    replies = [{"status": 503}, {"status": 503}, {"text": "recovered", "delay": 0.5}]
    one = worker(redis_server.url, prefix, replies)
    two = worker(redis_server.url, prefix, [{"text": "recovered", "delay": 0.5}])
    async with one, two:
        await turns_of(one).run(HI)
        await turns_of(one).run(HI)
        assert one.health.breaker("sim.a").state == "open"
        await trio.sleep(0.7)  # open_s = 0.6: half-open now
        results = []

        async def turn(relay):
            results.append(await turns_of(relay).run(HI))

        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(turn, one)
                nursery.start_soon(turn, two)
        probes = (sent_to(one, "sim.a") - 2) + sent_to(two, "sim.a")
        assert probes == 1, "exactly one turn in the fleet probes a half-open profile"
        assert sum(r.served.profile == "sim.a" for r in results) == 1
        assert sum(any(s.reason == "breaker" for s in r.skipped) for r in results) == 19
        # the probe succeeded: the breaker is closed for the whole fleet
        after = await turns_of(two).run(HI)
    assert after.served.profile == "sim.a" and not after.skipped


async def test_a_429_cooldown_set_by_one_worker_is_seen_by_the_other(redis_server, prefix):
    one = worker(redis_server.url, prefix, [{"status": 429, "retry_after": 20}])
    two = worker(redis_server.url, prefix, [{"text": "a would answer"}])
    async with one, two:
        first = await turns_of(one).run(HI)
        assert first.served.profile == "sim.b"
        result = await turns_of(two).run(HI)
        cooling = two.health.cooldown_until("sim.a") - trio.current_time()
    assert [str(s) for s in result.skipped] == ["sim.a/m1 cooldown"] and sent_to(two, "sim.a") == 0
    assert 15 < cooling <= 20.1  # shared as wall-clock time: reading it back on trio's clock adds a little noise


async def test_every_key_has_an_expiry(redis_server, prefix):
    import coredis

    one = worker(redis_server.url, prefix, [{"status": 503}, {"status": 429}])
    async with one:
        for _ in range(3):
            await turns_of(one).run(HI)
    client = coredis.Redis.from_url(redis_server.url, decode_responses=True)
    async with client:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
        assert keys, "the turns wrote shared state"
        for key in keys:
            assert await client.pttl(key) > 0, key


async def test_a_store_that_goes_away_costs_a_warning_once_and_the_fleet_resumes_after(redis_server, prefix, caplog):
    caplog.set_level(logging.WARNING, logger="relayline.health")
    one = worker(redis_server.url, prefix, [{"text": "ok"}])
    async with one:
        assert (await turns_of(one).run(HI)).outcome == "ok" and one.health.reachable
        redis_server.kill()
        try:
            for _ in range(5):
                assert (await turns_of(one).run(HI)).outcome == "ok"
            assert not one.health.reachable
        finally:
            redis_server.start()
        warnings = [r.getMessage() for r in caplog.records if "health_store_unreachable" in r.getMessage()]
        assert len(warnings) == 1 and str(redis_server.port) in warnings[0]
        with trio.fail_after(10):
            while not one.health.reachable:
                await trio.sleep(0.2)
                await turns_of(one).run(HI)
    assert any("health_store_reachable" in r.getMessage() for r in caplog.records)


async def test_a_key_pool_cursor_moved_by_one_worker_is_where_the_other_starts(redis_server, prefix):
    pooled = fleet_toml(redis_server.url, prefix, pooled=True)

    def pool_worker(replies):
        sim = SimUpstream.from_replies([{"provider": "sim.a", "script": replies}])
        return Relay.from_toml(pooled, env={}, clients=sim.clients())

    one = pool_worker([{"status": 429}, {"text": "the second key works"}])
    two = pool_worker([{"text": "ok"}])
    async with one, two:
        assert (await turns_of(one).run(HI)).served.profile == "sim.a"
        await turns_of(two).run(HI)
    assert [c.key_index for c in one.clients["sim"].upstream.calls] == [0, 1]
    assert [c.key_index for c in two.clients["sim"].upstream.calls] == [1], "the fleet's cursor: the key that last worked"


async def test_a_store_that_stalls_mid_run_costs_a_turn_at_most_the_sync_timeout_and_the_fleet_resumes(
        redis_server, prefix, caplog):
    """Redis that hangs (CLIENT PAUSE: connections open, nothing answered; as a store swapping
    or blocked by a slow script does) rather than going away: a turn waits at most TIMEOUT_S
    for it, then serves on local health; once Redis answers again the worker is back on the
    fleet's state, and what it reads is this round's, not the round it gave up on (a reply
    left unread on a pooled connection would shift every later one by a round)."""
    import coredis

    from relayline.adapters.stores.health import TIMEOUT_S

    caplog.set_level(logging.WARNING, logger="relayline.health")
    one = worker(redis_server.url, prefix, [{"text": "ok"}])
    two = worker(redis_server.url, prefix, [{"status": 503}])
    admin = coredis.Redis.from_url(redis_server.url, decode_responses=True)
    async with one, two, admin:
        assert (await turns_of(one).run(HI)).outcome == "ok" and one.health.reachable
        await admin.client_pause(1500)
        started = trio.current_time()
        assert (await turns_of(one).run(HI)).outcome == "ok"
        assert trio.current_time() - started < TIMEOUT_S + 0.4
        assert not one.health.reachable
        with trio.fail_after(10):
            while not one.health.reachable:
                await trio.sleep(0.2)
                assert (await turns_of(one).run(HI)).outcome == "ok"
        for _ in range(2):  # two opens sim.a for the fleet...
            await turns_of(two).run(HI)
        result = await turns_of(one).run(HI)  # ...which one's next round reads
    assert [str(s) for s in result.skipped] == ["sim.a/m1 breaker"]
    warnings = [r.getMessage() for r in caplog.records if "health_store_unreachable" in r.getMessage()]
    assert len(warnings) == 1 and "TooSlowError" in warnings[0]


async def test_a_pool_key_that_drew_a_401_sits_out_across_the_fleet(redis_server, prefix):
    # one worker's key 0 draws a 401 and key 1 answers; the other worker's turn then finds key 1
    # rate limited: key 0 sits out fleet-wide, so no key is left and the walk advances to sim.b
    # (before, the second worker knew nothing of key 0 and sent it)
    def pooled(a_replies):
        sim = SimUpstream.from_replies([{"provider": "sim.a", "script": a_replies},
                                        {"provider": "sim.b", "script": [{"text": "from b"}]}])
        toml = fleet_toml(redis_server.url, prefix, pooled=True)
        return Relay.from_toml(toml, env={}, clients=sim.clients())

    one = pooled([{"status": 401, "error": "invalid_api_key"}, {"text": "key 1 answers"}])
    two = pooled([{"status": 429}, {"text": "key 0 would answer"}])
    async with one, two:
        first = await turns_of(one).run(HI)
        assert first.served.profile == "sim.a" and [a.key for a in first.attempts] == [0, 1]
        second = await turns_of(two).run(HI)
        sitting = two.health.key_cooldown_until("sim.a", 0) - trio.current_time()
    assert [a.key for a in second.attempts] == [1, None] and second.served.profile == "sim.b"
    assert sent_to(two, "sim.a") == 1
    assert 25 < sitting <= 30.1


async def test_a_changed_key_pool_forgets_its_sitting_out_keys_for_the_whole_fleet(redis_server, prefix):
    # a reload that changed sim.a's pool forgets its key state in the store, not only in the
    # worker's mirror: otherwise the next round would read the old places back
    def pooled():
        sim = SimUpstream.from_replies([{"provider": "sim.a", "script": [{"text": "a"}]},
                                        {"provider": "sim.b", "script": [{"text": "b"}]}])
        toml = fleet_toml(redis_server.url, prefix, pooled=True)
        return Relay.from_toml(toml, env={}, clients=sim.clients())

    one, two = pooled(), pooled()
    async with one, two:
        one.health.set_key_cooldown("sim.a", 0, trio.current_time() + 30)
        one.health.set_key_cursor("sim.a", 1)
        await one.health.sync(["sim.a"])
        await two.health.sync(["sim.a"])
        assert two.health.key_cursor("sim.a") == 1 and two.health.key_cooldown_until("sim.a", 0) > trio.current_time()
        one.health.forget_keys("sim.a")
        await one.health.sync(["sim.a"])
        await two.health.sync(["sim.a"])
        assert two.health.key_cursor("sim.a") == 0
        assert two.health.key_cooldown_until("sim.a", 0) < trio.current_time()

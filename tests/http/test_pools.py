"""Upstream connection pools, counted on a real loopback upstream's accepted connections: each
profile has its own pool, a connection is reused by the turns that follow instead of re-opened,
`[gateway] max_in_flight` bounds a profile's connections, and the connections a burst opened are
closed once no request took them for a keep-alive period, even when the pool is not used again."""

from __future__ import annotations

import json
import logging
from collections import defaultdict

import trio

from helpers import finalized_async_generators
from relayline.adapters import Relay
from relayline.adapters.providers.pool import ProfilePool
from relayline.adapters.providers.upstream import UpstreamRequest
from relayline.adapters.relay import turns_of
from relayline.adapters.sim.loopback import LoopbackServer, Reply
from relayline.machines.config import structure_config

HI = [{"role": "user", "content": "hi"}]
ANSWER = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                  "finish_reason": "stop"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})


def slow_answer(seen) -> Reply:
    # long enough that the turns of one round overlap and each needs its own connection
    return Reply(headers=(("content-type", "application/json"),), pieces=(ANSWER.encode(),), delay=0.05)


def config(url: str, **gateway) -> dict:
    profile = {"family": "openai", "base_url": f"{url}/v1"}
    return {"active": "a", "gateway": gateway,
            "providers": {"a": {**profile, "api_key": "key-a", "model": "m-a"},
                          "b": {**profile, "api_key": "key-b", "model": "m-b"}},
            "routes": [{"hint": "b", "provider": "b", "model": "m-b"}],
            "reliability": {"provider_retries": 0}}


async def rounds(relay: Relay, rounds: int, per_profile: dict[str | None, int]) -> list:
    results = []

    async def one(model):
        results.append(await turns_of(relay).run(HI, model=model))

    for _ in range(rounds):
        async with trio.open_nursery() as nursery:
            for model, count in per_profile.items():
                for _ in range(count):
                    nursery.start_soon(one, model)
    return results


async def test_each_profile_has_its_own_pool_and_reuses_its_connections():
    wide = 19  # turns at once on one profile
    async with trio.open_nursery() as nursery:
        upstream = LoopbackServer(slow_answer)
        await upstream.start(nursery)
        async with Relay(structure_config(config(upstream.url)), env={}) as relay:
            with trio.fail_after(10):
                results = await rounds(relay, 3, {None: wide, "hint:b": 4})
        nursery.cancel_scope.cancel()
    assert [r.outcome for r in results] == ["ok"] * (3 * (wide + 4))
    assert sorted({r.served.profile for r in results}) == ["a", "b"]
    keys_by_connection = defaultdict(set)
    for seen in upstream.seen:
        keys_by_connection[seen.connection].add(seen.headers["authorization"])
    # a connection carries one profile's requests only: the pools are per profile
    assert all(len(keys) == 1 for keys in keys_by_connection.values()), keys_by_connection
    per_profile = defaultdict(int)
    for keys in keys_by_connection.values():
        per_profile[keys.pop()] += 1
    # the later rounds ride the first round's connections (without reuse: 3 times as many)
    assert per_profile == {"Bearer key-a": wide, "Bearer key-b": 4}
    assert upstream.accepted == wide + 4 and len(upstream.seen) == 3 * (wide + 4)


async def test_max_in_flight_bounds_each_profiles_connections():
    async with trio.open_nursery() as nursery:
        upstream = LoopbackServer(slow_answer)
        await upstream.start(nursery)
        async with Relay(structure_config(config(upstream.url, max_in_flight=3)), env={}) as relay:
            with trio.fail_after(10):
                results = await rounds(relay, 1, {None: 10, "hint:b": 10})
        nursery.cancel_scope.cancel()
    assert [r.outcome for r in results] == ["ok"] * 20  # the rest waited for a connection
    assert upstream.accepted == 6  # three per profile


def streamed_answer(seen) -> Reply:
    def chunk(delta: dict, finish=None) -> bytes:
        body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(body)}\n\n".encode()

    # the chunked terminator goes out as its own write after [DONE], as servers do
    return Reply(pieces=(chunk({"role": "assistant", "content": ""}), chunk({"content": "ok"}), chunk({}, "stop"),
                         b"data: [DONE]\n\n"))


async def test_a_stream_that_ended_leaves_its_connection_to_the_next_turn():
    async def discard(event) -> None:
        pass

    async with trio.open_nursery() as nursery:
        upstream = LoopbackServer(streamed_answer)
        await upstream.start(nursery)
        async with Relay(structure_config(config(upstream.url)), env={}) as relay:
            with trio.fail_after(10):
                results = [await turns_of(relay).run(HI, stream=True, sink=discard) for _ in range(5)]
        nursery.cancel_scope.cancel()
    assert [r.outcome for r in results] == ["ok"] * 5 and [r.text for r in results] == ["ok"] * 5
    assert upstream.accepted == 1  # closed mid-body at [DONE], each turn would open its own


async def test_a_stream_that_ended_leaves_no_frames_for_trios_finalizer():
    """The driver stops reading a stream at its completion signal: the frames' generator, left
    at its last yield, is closed as the stream exits, not handed to trio's finalizer (a wake-up
    of the run loop and a system task a stream)."""
    async def discard(event) -> None:
        pass

    with finalized_async_generators() as finalized:
        async with trio.open_nursery() as nursery:
            upstream = LoopbackServer(streamed_answer)
            await upstream.start(nursery)
            async with Relay(structure_config(config(upstream.url)), env={}) as relay:
                with trio.fail_after(10):
                    results = [await turns_of(relay).run(HI, stream=True, sink=discard) for _ in range(3)]
            nursery.cancel_scope.cancel()
    assert [r.text for r in results] == ["ok"] * 3
    assert "HttpProvider._frames" not in finalized


async def test_connections_no_request_took_for_a_keepalive_period_are_closed_unasked():
    wide = 19
    async with trio.open_nursery() as nursery:
        upstream = LoopbackServer(slow_answer)
        await upstream.start(nursery)
        pool = ProfilePool(keepalive_s=0.3)
        request = UpstreamRequest(f"{upstream.url}/v1/chat/completions", {"content-type": "application/json"}, b"{}")

        async def post() -> None:
            async with pool.exchange(request) as response:
                assert response.status == 200
                assert b"".join([piece async for piece in response]) == ANSWER.encode()

        with trio.fail_after(10):
            async with trio.open_nursery() as burst:
                for _ in range(wide):
                    burst.start_soon(post)
            assert upstream.accepted == wide and pool.opened == wide
            await post()  # the warmest connection carries it
            assert upstream.accepted == wide
            # nothing uses the pool again: its expiry closes them all after the keep-alive period
            while upstream.closed < wide:
                await trio.sleep(0.01)
        assert pool.opened == 0 and not any(pool.idle.values())
        await post()  # and the pool still serves, on a new connection
        assert upstream.accepted == wide + 1
        await pool.aclose()
        nursery.cancel_scope.cancel()


async def test_an_origin_first_used_while_the_expiry_closes_connections_does_not_end_the_expiry(monkeypatch, caplog):
    # a close yields to the scheduler (once, for real; longer here, so that the race is sure): a
    # request to an origin new to the pool that ends meanwhile adds a stack to what the expiry
    # iterates, which ended the expiry task ("dictionary changed size") and left idle
    # connections open past the keep-alive period
    from relayline.adapters.providers.upstream import Connection

    close = Connection.aclose

    async def slow_close(self) -> None:
        await close(self)
        await trio.sleep(0.05)

    async with trio.open_nursery() as nursery:
        upstreams = [LoopbackServer(lambda seen: Reply(pieces=(ANSWER.encode(),))) for _ in range(3)]
        for upstream in upstreams:
            await upstream.start(nursery)
        pool = ProfilePool(keepalive_s=0.2)

        async def post(upstream) -> None:
            request = UpstreamRequest(f"{upstream.url}/v1/chat/completions", {}, b"{}")
            async with pool.exchange(request) as response:
                assert b"".join([piece async for piece in response]) == ANSWER.encode()

        with trio.fail_after(3):
            await post(upstreams[0])
            await post(upstreams[1])
            monkeypatch.setattr(Connection, "aclose", slow_close)
            await trio.sleep(0.22)  # the expiry is closing the first connection now
            await post(upstreams[2])
            while pool.opened:  # each of the three is closed after its keep-alive period
                await trio.sleep(0.02)
        await pool.aclose()
        nursery.cancel_scope.cancel()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_the_request_id_goes_upstream_on_the_lean_client():
    from relayline.adapters.providers.http import REQUEST_ID

    async with trio.open_nursery() as nursery:
        upstream = LoopbackServer(slow_answer)
        await upstream.start(nursery)
        async with Relay(structure_config(config(upstream.url)), env={}) as relay:
            token = REQUEST_ID.set("req-7")
            try:
                result = await turns_of(relay).run(HI)
            finally:
                REQUEST_ID.reset(token)
        nursery.cancel_scope.cancel()
    assert result.outcome == "ok"
    seen = upstream.seen[0].headers
    assert seen["x-request-id"] == "req-7" and seen["authorization"] == "Bearer key-a"
    assert seen["content-type"] == "application/json" and seen["user-agent"].startswith("relayline")

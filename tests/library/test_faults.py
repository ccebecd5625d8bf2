"""Fault injection over real loopback HTTP: upstreams that hang, trickle, reset, send junk or
oversized bodies, a turn that raises while it holds a half-open probe, and short timeouts.

For each: the caller's answer comes within a bound, the failure is classified, the fallback
answers where one exists, the ledger rows are right, and the breaker moves only for what the
provider did.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import trio
import trio_parallel
from raw_server import RawServer

from helpers import asgi_post
from helpers import loopback_config as config
from relayline.adapters import Relay
from relayline.adapters.providers import http
from relayline.adapters.providers.http import PROCESS_PARSE_BYTES
from relayline.adapters.relay import turns_of
from relayline.adapters.sim.loopback import LoopbackServer, Reply
from relayline.machines.config import structure_config

HI = [{"role": "user", "content": "hi"}]
JSON_HEADERS = (("content-type", "application/json"),)
SSE_HEADERS = (("content-type", "text/event-stream"),)
LARGE_TEXT = "naïve 😀 <b>bold</b> \\ \" line\n" * 60_000  # ~2 MiB of JSON, escapes and non-ASCII
PADDING = "p" * (PROCESS_PARSE_BYTES + 1024)


def answer(text: str = "from the backup", usage=(7, 3)) -> bytes:
    return json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1]}}).encode()


def ok(text: str = "from the backup") -> Reply:
    return Reply(headers=JSON_HEADERS, pieces=(answer(text),))


def chunk(delta: dict, finish: str | None = None) -> bytes:
    obj = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(obj)}\n\n".encode()


async def turn(handler, *, backup=ok, stream=False, bound=6.0, **sections):
    """One turn against a primary served by `handler` and a healthy backup (None: no backup).
    Returns the result, the relay (for its health) and what each upstream saw."""
    async with trio.open_nursery() as nursery:
        primary = LoopbackServer(handler)
        await primary.start(nursery)
        second = None
        if backup is not None:
            second = LoopbackServer(lambda seen: backup())
            await second.start(nursery)
        cfg = structure_config(config(primary.url, second.url if second else None, **sections))
        async with Relay(cfg, env={}) as relay:
            with trio.fail_after(bound):
                result = await turns_of(relay).run(HI, stream=stream)
        nursery.cancel_scope.cancel()
    return result, relay, primary.seen, (second.seen if second else [])


def outcomes(result) -> list[tuple[str, str, str]]:
    return [(a.provider, a.outcome, a.detail) for a in result.attempts]


# -- the upstream kinds of fault ------------------------------------------------------------


async def test_a_hanging_upstream_is_a_headers_timeout_and_the_backup_answers():
    result, relay, seen, _ = await turn(lambda s: Reply(delay=math.inf))
    assert result.outcome == "ok" and result.served.profile == "backup"
    assert outcomes(result)[0] == ("primary", "timeout", "no response headers within 0.5s")
    assert len(seen) == 1  # a silent route is not retried while another can answer
    assert relay.health.breaker("primary").state == "open"  # the provider's own silence counts
    assert [(r.provider, r.accepted) for r in result.ledger] == [("backup", True)]


async def test_a_trickling_body_is_a_stalled_body_not_missing_headers():
    body = answer("never finished")
    trickle = Reply(headers=JSON_HEADERS, pieces=(body[:10], 2.0, body[10:]))
    result, relay, seen, _ = await turn(lambda s: trickle)
    assert result.outcome == "ok" and result.served.profile == "backup"
    kind, detail = result.attempts[0].outcome, result.attempts[0].detail
    assert kind == "timeout" and "stalled body" in detail and "headers" not in detail


async def test_a_reset_mid_body_is_retried_then_fails_over():
    result, relay, seen, _ = await turn(lambda s: Reply(headers=JSON_HEADERS, pieces=(b'{"choi',), end=False),
                                        breaker={"failure_threshold": 2})
    assert result.outcome == "ok" and result.served.profile == "backup"
    assert [a.outcome for a in result.attempts] == ["retryable", "retryable", "ok"]
    assert "connection lost" in result.attempts[0].detail and len(seen) == 2
    assert len(relay.health.breaker("primary").failures) == 1  # one observation per turn


async def test_junk_with_status_200_fails_over():
    result, relay, seen, _ = await turn(lambda s: Reply(headers=JSON_HEADERS, pieces=(b"<html>oops</html>",)))
    assert result.outcome == "ok" and result.served.profile == "backup"
    assert result.attempts[0].outcome == "retryable" and "not JSON" in result.attempts[0].detail


async def test_an_oversized_body_is_too_large_and_not_retried_on_the_same_entry():
    big = Reply(headers=JSON_HEADERS, pieces=tuple([b" " * 65536] * 40))  # 2.5 MiB, chunked
    result, relay, seen, _ = await turn(lambda s: big, limits={"max_response_bytes": 1 << 20})
    assert result.outcome == "ok" and result.served.profile == "backup"
    assert outcomes(result)[0] == ("primary", "too_large",
                                   "response larger than limits.max_response_bytes (1048576 bytes)")
    assert len(seen) == 1
    assert relay.health.breaker("primary").state == "closed"  # size is not ill health


async def test_a_body_at_the_limit_is_accepted():
    body = answer("x" * 1000)
    result, *_ = await turn(lambda s: Reply(headers=JSON_HEADERS, pieces=(body,)), backup=None,
                            limits={"max_response_bytes": len(body)})
    assert result.outcome == "ok" and result.text == "x" * 1000


# -- a large answer is decoded in a worker process (the event loop is not held by the parse) ------


@pytest.fixture
def worker_decoding(monkeypatch):
    """As `relayline serve` has it (a library host decodes in a thread)."""
    monkeypatch.setattr(http._Decoding, "in_processes", True)


def test_the_large_bodies_below_are_large_enough_to_be_decoded_in_a_worker():
    assert len(answer(LARGE_TEXT)) > PROCESS_PARSE_BYTES and len(PADDING) > PROCESS_PARSE_BYTES


async def test_a_large_answer_arrives_whole_from_the_worker_process(worker_decoding):
    result, *_ = await turn(lambda s: Reply(headers=JSON_HEADERS, pieces=(answer(LARGE_TEXT, usage=(11, 700_000)),)),
                            backup=None)
    assert result.outcome == "ok", result.attempts
    assert result.text == LARGE_TEXT
    assert [(r.input_tokens, r.output_tokens) for r in result.ledger] == [(11, 700_000)]
    assert trio_parallel.default_context_statistics().idle_workers >= 1  # it was decoded in a worker


async def test_a_large_reply_of_the_wrong_shape_is_malformed_from_the_worker(worker_decoding):
    wrong = json.dumps({"id": PADDING, "choices": [{"index": 0, "message": 5}]}).encode()
    result, relay, seen, _ = await turn(lambda s: Reply(headers=JSON_HEADERS, pieces=(wrong,)))
    assert result.outcome == "ok" and result.served.profile == "backup"
    assert outcomes(result)[0] == ("primary", "malformed",
                                   "malformed response: choices[0].message: expected an object, got a number")


async def test_a_large_reply_that_is_not_json_is_classified_from_the_worker(worker_decoding):
    junk = b'{"choices": "' + PADDING.encode()  # cut short: never a whole document
    result, relay, seen, _ = await turn(lambda s: Reply(headers=JSON_HEADERS, pieces=(junk,)))
    assert result.outcome == "ok" and result.served.profile == "backup"
    assert result.attempts[0].outcome == "retryable" and "not JSON" in result.attempts[0].detail


async def test_a_turn_cancelled_mid_decode_kills_its_worker(worker_decoding):
    """A client that hangs up cancels the turn: a decode in progress is not left running."""
    body = answer("c" * (24 << 20))  # large enough that its decode is caught in progress
    statistics = trio_parallel.default_context_statistics
    async with trio.open_nursery() as nursery:
        upstream = LoopbackServer(lambda s: Reply(headers=JSON_HEADERS, pieces=(body,)))
        await upstream.start(nursery)
        cfg = structure_config(config(upstream.url, limits={"max_response_bytes": 32 << 20},
                                      timeouts={"total_s": 30}))
        async with Relay(cfg, env={}) as relay:
            turn_scope = trio.CancelScope()
            done = trio.Event()

            async def run_turn() -> None:
                with turn_scope:
                    await turns_of(relay).run(HI)
                done.set()

            nursery.start_soon(run_turn)
            with trio.fail_after(20):
                while statistics().running_workers == 0 and not done.is_set():
                    await trio.sleep(0.002)
            assert not done.is_set(), "the turn ended before its decode was seen running"
            turn_scope.cancel()
            await done.wait()
            assert turn_scope.cancelled_caught and statistics().running_workers == 0
        nursery.cancel_scope.cancel()


async def test_a_stream_whose_text_outgrows_the_limit_fails_before_commit_and_recovers():
    # the text arrives in one frame above the limit, before anything was forwarded
    frames = (chunk({"role": "assistant", "content": ""}), chunk({"content": "y" * 5000}))
    result, relay, seen, _ = await turn(lambda s: Reply(headers=SSE_HEADERS, pieces=frames), stream=True,
                                        limits={"max_response_bytes": 4096})
    assert result.outcome == "ok" and result.served.profile == "backup"
    assert result.attempts[0].outcome == "stream_failed" and result.attempts[0].reason == "too_large"


async def test_a_stream_of_empty_frames_forever_ends_at_total_s():
    forever = (chunk({"role": "assistant", "content": ""}),) + (0.05, chunk({"content": ""})) * 400
    result, relay, seen, _ = await turn(lambda s: Reply(headers=SSE_HEADERS, pieces=forever), backup=None,
                                        stream=True, timeouts={"total_s": 1.0})
    assert result.outcome == "error" and result.error == "deadline"
    assert result.attempts[-1].outcome == "timeout" and "total_s" in result.attempts[-1].detail
    assert relay.health.breaker("primary").state == "closed"  # the turn's budget, not ill health


async def test_text_forever_after_commit_is_interrupted_at_total_s():
    forever = (chunk({"role": "assistant", "content": ""}),) + (0.05, chunk({"content": "la "})) * 400
    result, relay, *_ = await turn(lambda s: Reply(headers=SSE_HEADERS, pieces=forever), backup=None,
                                   stream=True, timeouts={"total_s": 1.0})
    assert result.outcome == "interrupted" and result.partial_text.startswith("la la ")
    assert result.ledger and not result.ledger[0].accepted


async def test_a_hang_past_the_budget_is_the_turns_deadline_not_the_attempts_timeout():
    """The attempt's headers clock and the turn's budget share one scope (attempt_clock.AttemptClock):
    when the budget ends first, the turn expires (`deadline`, no breaker failure), and when the
    attempt's clock ends first, the same turn goes on to the backup in a scope of its own."""
    result, relay, *_ = await turn(lambda s: Reply(delay=math.inf), backup=None,
                                   timeouts={"headers_s": 5, "total_s": 1.0})
    assert result.outcome == "error" and result.error == "deadline"
    assert result.attempts[-1].outcome == "timeout" and "total_s" in result.attempts[-1].detail
    assert relay.health.breaker("primary").state == "closed"
    result, relay, *_ = await turn(lambda s: Reply(delay=math.inf), timeouts={"headers_s": 0.3, "total_s": 1.0})
    assert [(a.provider, a.outcome) for a in result.attempts] == [("primary", "timeout"), ("backup", "ok")]
    assert "headers within 0.3s" in result.attempts[0].detail and result.outcome == "ok"


def _raw(status: int, body: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


@pytest.mark.parametrize("first", [_raw(503, b'{"error": {"message": "busy"}}'), _raw(200, b"not json")])
async def test_an_answer_that_arrives_in_the_tick_its_deadline_passes_stands_and_the_turn_goes_on(first, autojump_clock):
    """The attempt's deadline is moved on the turn's own scope (attempt_clock.AttemptClock). When the
    answer wakes the read in the very loop tick that expires that deadline, the answer is read
    and stands, but the scope is already cancelled: the retry must not inherit it (it ended
    the turn as `deadline` with 595 s of its budget left, the retry never sent)."""
    async def first_answer(stream):
        await trio.sleep(1)  # the client waits for the head, its deadline 5 s after the write
        # the answer in the client's socket and, in the same step, the deadline past: the
        # client's read wakes in the tick that expires it (a loaded loop's long tick, made exact)
        os.write(stream.socket.fileno(), first)
        autojump_clock.jump(10)

    server = RawServer(lambda number, index: first_answer if index == 0 else _raw(200, answer("second")))
    async with trio.open_nursery() as nursery:
        await server.start(nursery)
        cfg = structure_config(config(server.url.removesuffix("/v1/chat/completions"),
                                      timeouts={"headers_s": 5, "total_s": 600}, breaker={"failure_threshold": 5},
                                      reliability={"provider_retries": 2, "backoff_ms": 0}))
        async with Relay(cfg, env={}) as relay:
            result = await turns_of(relay).run(HI, stream=False)
        nursery.cancel_scope.cancel()
    assert result.outcome == "ok" and result.text == "second", (result.outcome, result.error)
    assert [(a.outcome, a.detail) for a in result.attempts][1] == ("ok", "") and len(server.requests) == 2


async def test_total_s_bounds_retries_and_waits():
    result, *_ = await turn(lambda s: Reply(status=503, headers=JSON_HEADERS, pieces=(b"{}",)), backup=None,
                            reliability={"provider_retries": 20, "backoff_ms": 400}, timeouts={"total_s": 1.0},
                            breaker={"enabled": False})
    assert result.outcome == "error" and result.error == "deadline"
    assert 2 <= len(result.attempts) <= 4


async def test_headers_s_runs_from_the_write_not_from_the_pool_queue():
    """Three turns share a pool of one connection (max_in_flight = 1 sizes each profile's pool;
    the relay itself does not shed load) to a provider that answers each call after
    0.4 s: queued behind the others, the third waits 0.8 s in all, past headers_s = 0.5, but
    the provider never took longer than 0.4 s after a request was written."""
    async with trio.open_nursery() as nursery:
        upstream = LoopbackServer(lambda s: Reply(headers=JSON_HEADERS, pieces=(answer("slow but fine"),), delay=0.4))
        await upstream.start(nursery)
        cfg = structure_config(config(upstream.url, reliability={"provider_retries": 0}, gateway={"max_in_flight": 1}))
        async with Relay(cfg, env={}) as relay:
            results = []

            async def one():
                results.append(await turns_of(relay).run(HI))

            with trio.fail_after(5):
                async with trio.open_nursery() as turns:
                    for _ in range(3):
                        turns.start_soon(one)
        nursery.cancel_scope.cancel()
    assert [r.outcome for r in results] == ["ok", "ok", "ok"], [outcomes(r) for r in results]
    assert relay.health.breaker("primary").state == "closed"


# -- the wedge -----------------------------------------------------------------------------------


class Boom(Exception):
    pass


class CrashingProbe:
    """An adapter that raises (relayline's own bug, seen from the driver) on the first call it
    gets, and then behaves."""

    reports_sent = False

    def __init__(self, real) -> None:
        self.real = real
        self.calls = 0

    async def complete(self, request):
        self.calls += 1
        if self.calls == 1:
            raise Boom("adapter bug")
        return await self.real.complete(request)

    def stream(self, request):
        return self.real.stream(request)


@pytest.mark.parametrize("fault", ["adapter raises", "lone surrogate"])
async def test_a_turn_that_raises_while_probing_never_wedges_the_breaker(fault, autojump_clock):
    """A wedge: a half-open profile, a turn holding its probe raises, and a healthy
    turn after it probes and closes the breaker."""
    replies = iter([Reply(status=503, headers=JSON_HEADERS, pieces=(b"{}",))])
    async with trio.open_nursery() as nursery:
        upstream = LoopbackServer(lambda s: next(replies, None) or ok("healthy again"))
        await upstream.start(nursery)
        cfg = structure_config(config(upstream.url, reliability={"provider_retries": 0}, breaker={"open_s": 10}))
        async with Relay(cfg, env={}) as relay:
            crashing = CrashingProbe(relay.clients["openai"])
            first = await turns_of(relay).run(HI)
            assert first.error == "exhausted" and relay.health.breaker("primary").state == "open"
            await trio.sleep(10)
            assert relay.health.breaker("primary").refresh(trio.current_time()) == "half_open"
            if fault == "adapter raises":
                relay.clients["openai"] = crashing
                raised = await turns_of(relay).run(HI)
            else:
                raised = await turns_of(relay).run([{"role": "user", "content": "bad \ud800 text"}])
            relay.clients["openai"] = crashing.real
            assert relay.health.breaker("primary").state != "probing"
            if fault == "adapter raises":
                assert raised.outcome == "error" and raised.error == "internal"
                assert raised.attempts[0].outcome == "internal" and raised.attempts[0].detail == "internal error (Boom)"
            healthy = await turns_of(relay).run(HI)
        nursery.cancel_scope.cancel()
    assert healthy.outcome == "ok" and healthy.text == "healthy again"
    assert relay.health.breaker("primary").state == "closed"


async def test_a_probe_lease_expires_after_total_s(autojump_clock):
    """A probe held by a turn that never ends (a task stuck outside relayline's control) is
    taken back after the lease (total_s), so the profile can be probed again."""
    from relayline.machines.config import Breaker as BreakerConfig
    from relayline.machines.health import InMemoryHealth

    health = InMemoryHealth(BreakerConfig(failure_threshold=1, open_s=5), probe_lease_s=20)
    breaker = health.breaker("p")
    breaker.failure(0.0)
    assert breaker.claim(6.0)
    assert breaker.blocks(25.9)
    assert not breaker.blocks(26.0) and breaker.state == "half_open"
    assert breaker.claim(26.1) and breaker.state == "probing"
    breaker.success(27.0)
    assert breaker.state == "closed"


async def test_the_gateway_answers_a_json_500_when_relayline_fails(autojump_clock):
    """Every candidate failed inside relayline: a 500 with an error body in the dialect's shape."""
    from relayline.adapters.gateway import Gateway

    async with trio.open_nursery() as nursery:
        upstream = LoopbackServer(lambda s: ok())
        await upstream.start(nursery)
        relay = Relay(structure_config(config(upstream.url)), env={})
        relay.clients["openai"] = CrashingProbe(relay.clients["openai"])
        gateway = Gateway(relay)
        status, headers, body = await asgi(gateway, "/v1/chat/completions", {"model": "m-primary", "messages": HI})
        await relay.aclose()
        nursery.cancel_scope.cancel()
    assert status == 500 and body["error"]["code"] == "internal_error"
    assert relay.health.breaker("primary").state == "closed"
    assert dict(headers)[b"x-relayline-attempts"] == b"1"


async def test_a_lone_surrogate_from_a_client_is_a_400_naming_it():
    from relayline.adapters.gateway import Gateway

    relay = Relay(structure_config(config("http://127.0.0.1:9")), env={})
    status, _, body = await asgi(Gateway(relay), "/v1/chat/completions", raw=b'{"model": "m-primary", "messages": '
                                 b'[{"role": "user", "content": "bad \\ud800 text"}]}')
    assert status == 400 and "surrogate" in body["error"]["message"]
    await relay.aclose()


async def asgi(app, path: str, obj=None, raw: bytes | None = None):
    """One request through the ASGI app, in process; the answer's JSON."""
    status, headers, payload = await asgi_post(app, path, raw if raw is not None else json.dumps(obj).encode())
    return status, headers, json.loads(payload)


async def test_a_cancellation_that_arrives_while_connecting_is_recorded_as_the_turns(monkeypatch):
    """Found by tests/library/test_fault_injection.py: trio's connect (happy eyeballs) runs a nursery,
    which hands an outer cancellation on as a BaseExceptionGroup of Cancelled. It is still the
    owner's cancellation: recorded on the turn (never retried), not a turn without a result. The
    upstream is named (localhost): an IP literal is one connect() with no nursery (upstream.py's
    open_tcp), where the cancellation lands at the exchange's first checkpoint instead."""
    from relayline.adapters.providers.upstream import Connection

    connect = Connection.connect
    async with trio.open_nursery() as nursery:
        upstream = LoopbackServer(lambda s: ok())
        await upstream.start(nursery)
        named = upstream.url.replace("127.0.0.1", "localhost")
        async with Relay(structure_config(config(named)), env={}) as relay:
            runs: list = []
            with trio.CancelScope() as scope:
                async def cancelled_mid_connect(*args, **kwargs):
                    async def cancel() -> None:
                        scope.cancel()  # from another task, while the connect's nursery runs

                    trio.lowlevel.spawn_system_task(cancel)
                    return await connect(*args, **kwargs)

                monkeypatch.setattr(Connection, "connect", cancelled_mid_connect)
                await turns_of(relay).run(HI, run_hook=runs.append)
            monkeypatch.setattr(Connection, "connect", connect)
            assert scope.cancelled_caught
            healthy = await turns_of(relay).run(HI)
        nursery.cancel_scope.cancel()
    result = runs[0].result
    assert result is not None and result.outcome == "cancelled" and result.error == "cancelled"
    assert outcomes(result) == [("primary", "cancelled", "cancelled by the consumer")]
    assert upstream.seen[:-1] == []  # never sent, never retried
    assert healthy.outcome == "ok" and relay.health.breaker("primary").state == "closed"


async def test_a_ledger_that_cannot_write_loses_no_answer(caplog):
    """The providers bill an answer whatever the ledger's disk does: the client gets it, and the
    rows the ledger could not take are logged for the operator (readiness says the rest)."""
    import sqlite3

    from relayline.adapters.gateway import Gateway
    from relayline.adapters.stores.ledger import LedgerStore

    class FullDisk(LedgerStore):
        async def record(self, turn_id, result, *, client="", key="", team=""):
            raise sqlite3.OperationalError("database or disk is full")

    async with trio.open_nursery() as nursery:
        upstream = LoopbackServer(lambda s: ok("billed anyway"))
        await upstream.start(nursery)
        relay = Relay(structure_config(config(upstream.url)), env={})
        gateway = Gateway(relay, ledger=FullDisk(":memory:"))
        status, headers, body = await asgi(gateway, "/v1/chat/completions", {"model": "m-primary", "messages": HI})
        await relay.aclose()
        nursery.cancel_scope.cancel()
    assert status == 200 and body["choices"][0]["message"]["content"] == "billed anyway"
    lost = [r for r in caplog.records if r.getMessage().startswith("ledger_write_error")]
    assert len(lost) == 1 and "rows=1" in lost[0].getMessage() and "cost_usd=0.00001300" in lost[0].getMessage()


async def test_a_large_answer_hands_the_heap_back(monkeypatch):
    """After an answer of TRIM_AFTER_BYTES or more the gateway calls malloc_trim (in a worker
    thread): bench/memory.py measures what it gives back (a 32 MiB stream's +66 MiB of RSS)."""
    from relayline.adapters.gateway import Gateway, app

    trims: list[int] = []
    monkeypatch.setattr(app, "_malloc_trim", lambda: trims.append)
    big = "y" * app.TRIM_AFTER_BYTES
    async with trio.open_nursery() as nursery:
        upstream = LoopbackServer(lambda s: ok(big if s.body["messages"][0]["content"] == "big" else "small"))
        await upstream.start(nursery)
        relay = Relay(structure_config(config(upstream.url, timeouts={"total_s": 60})), env={})
        gateway = Gateway(relay)
        small = await asgi(gateway, "/v1/chat/completions", {"model": "m-primary", "messages": HI})
        assert small[0] == 200 and trims == []
        large = await asgi(gateway, "/v1/chat/completions", {"model": "m-primary", "messages": [
            {"role": "user", "content": "big"}]})
        await relay.aclose()
        nursery.cancel_scope.cancel()
    assert large[0] == 200 and len(large[2]["choices"][0]["message"]["content"]) == len(big)
    assert trims == [0]


async def test_a_body_refused_as_too_large_hands_the_heap_back(monkeypatch):
    """The refused body was read up to the limit: its heap is handed back as a large answer's."""
    from relayline.adapters.gateway import Gateway, app

    trims: list[int] = []
    monkeypatch.setattr(app, "_malloc_trim", lambda: trims.append)
    async with trio.open_nursery() as nursery:
        upstream = LoopbackServer(lambda s: ok("z" * 100_000))
        await upstream.start(nursery)
        relay = Relay(structure_config(config(upstream.url, limits={"max_response_bytes": 65536})), env={})
        gateway = Gateway(relay)
        refused = await asgi(gateway, "/v1/chat/completions", {"model": "m-primary", "messages": HI})
        await relay.aclose()
        nursery.cancel_scope.cancel()
    assert refused[0] == 502 and trims == [0]


# -- what the client did is never the provider's failure -------------------------------------------


async def raw_request(url: str, body: bytes, *, read_until: bytes | None = None, declared: int | None = None,
                      wait: float = 0.0) -> bytes:
    """A raw HTTP/1.1 POST to the gateway; with `read_until`, hang up once those bytes arrived
    (or after `wait` seconds when they never do); else read the whole answer."""
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    length = declared if declared is not None else len(body)
    await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                          b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (length, body))
    received = b""
    with trio.move_on_after(wait if read_until is not None else 10):
        while read_until is None or read_until not in received:
            data = await stream.receive_some(65536)
            if not data:
                break
            received += data
    await stream.aclose()
    return received


async def test_what_the_client_did_never_moves_the_providers_breaker():
    """Through the real gateway over loopback: a client that hangs up mid-stream, one that hangs
    up while the answer is still coming, a body that is not JSON, a body that stalls (408), and a
    request the provider rejects (400). With failure_threshold = 1, not one of them touches the
    primary's breaker, a hang-up is never sent on to the fallback, and a healthy request then
    goes to the primary."""
    from relayline.adapters.gateway import Gateway, serve

    def primary_reply(seen) -> Reply:
        text = seen.body["messages"][0]["content"]
        if text == "reject me":
            return Reply(status=400, headers=JSON_HEADERS,
                         pieces=(b'{"error": {"type": "invalid_request_error", "message": "bad max_tokens"}}',))
        if text == "slow":
            return Reply(headers=JSON_HEADERS, pieces=(answer("late"),), delay=1.0)
        if seen.body.get("stream"):
            return Reply(headers=SSE_HEADERS, pieces=(chunk({"role": "assistant", "content": ""}),
                                                      chunk({"content": "first"}), 1.0, chunk({"content": " never"})))
        return ok("from the primary")

    def request(text: str, stream: bool = False) -> bytes:
        return json.dumps({"model": "m-primary", "stream": stream, "messages": [{"role": "user", "content": text}]}).encode()

    async with trio.open_nursery() as nursery:
        primary = LoopbackServer(primary_reply)
        await primary.start(nursery)
        backup = LoopbackServer(lambda s: ok())
        await backup.start(nursery)
        relay = Relay(structure_config(config(primary.url, backup.url, gateway={"body_timeout_s": 0.3},
                                              timeouts={"headers_s": 5, "idle_s": 5, "total_s": 10})), env={})
        results = []
        relay.observers.append(results.append)
        gateway = Gateway(relay)
        url = (await nursery.start(lambda task_status: serve(gateway, port=0, task_status=task_status)))[0]
        with trio.fail_after(20):
            await raw_request(url, request("hi", stream=True), read_until=b"first", wait=5)
            await raw_request(url, request("slow"), read_until=b"never arrives", wait=0.3)
            garbage = await raw_request(url, b"{not json")
            stalled = await raw_request(url, b'{"model":', declared=100)
            rejected = await raw_request(url, request("reject me"))
            while len(results) < 3:  # the hang-ups are recorded once the gateway saw them go
                await trio.sleep(0.05)
            healthy = await raw_request(url, request("hi"))
        breaker = relay.health.breaker("primary")
        await relay.aclose()
        nursery.cancel_scope.cancel()
    assert garbage.startswith(b"HTTP/1.1 400") and stalled.startswith(b"HTTP/1.1 408")
    # (client_errors = "advance", the default: another provider may take what one refused)
    assert rejected.startswith(b"HTTP/1.1 200") and b"x-relayline-served: backup/m-backup" in rejected
    assert sorted([(a.provider, a.outcome) for a in r.attempts] for r in results[:3]) == [
        [("primary", "cancelled")], [("primary", "cancelled")], [("primary", "rejected"), ("backup", "ok")]]
    assert healthy.startswith(b"HTTP/1.1 200") and b"from the primary" in healthy
    assert [s.body["messages"][0]["content"] for s in primary.seen] == ["hi", "slow", "reject me", "hi"]
    assert [s.body["messages"][0]["content"] for s in backup.seen] == ["reject me"]  # hang-ups never fail over
    assert breaker.state == "closed" and not breaker.failures and breaker.transitions == 0

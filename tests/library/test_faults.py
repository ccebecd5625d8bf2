"""Faults over real loopback HTTP, and what a turn promises under each.

The kinds of upstream fault: upstreams that hang, trickle, reset, send junk or oversized bodies,
a turn that raises while it holds a half-open probe, and short timeouts. For each: the caller's
answer comes within a bound, the failure is classified, the fallback answers where one exists,
the ledger rows are right, and the breaker moves only for what the provider did.

An exception at every await point of a turn: Hypothesis picks the point and the
exception, a real turn runs through the real driver against loopback upstreams, and then:

- no breaker is left `probing`, and the exception is accounted for: the attempt it hit is that
  attempt's failure (`internal`, or the classified failure a transport error means), or, raised
  outside an attempt (the consumer's sink, a backoff sleep, the shared health store), it settles
  the turn (`internal`) and reaches the caller as it was;
- the ledger is whole: one attempt record per request that started, the rows' sum is the turn's
  cost, exactly one accepted row when and only when the turn answered;
- the next turn on the same Relay answers from the primary, and, when the fault hit a probe of a
  half-open breaker, that turn probes it again and closes it.

The await points are counted at the turn's seams, in the turn's own tasks only: every network
operation of the upstream client (providers/upstream.py: connect, write, read, close), `trio.sleep` (backoff, the gateway's
commit timer), the shared health store's sync, and the consumer's sink; through the gateway also
its ledger write and its client's `send`. A dry run of each scenario shape counts them, then the
fault is drawn among them. `make fuzz` runs both properties at length (1,500 examples each).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable
from contextvars import ContextVar

import h11
import httpx
import pytest
import trio
import trio.testing
import trio_parallel
from hypothesis import event, given, settings
from hypothesis import strategies as st
from raw_server import RawServer

from helpers import asgi_post, loopback_config, serve_in_process
from relayline.adapters import Relay
from relayline.adapters.gateway import Gateway
from relayline.adapters.providers import http
from relayline.adapters.providers.http import PROCESS_PARSE_BYTES
from relayline.adapters.providers.pool import ProfilePool
from relayline.adapters.providers.upstream import Connection
from relayline.adapters.relay import turns_of
from relayline.adapters.sim.loopback import LoopbackServer, Reply
from relayline.adapters.stores.ledger import LedgerStore
from relayline.machines.config import structure_config
from relayline.machines.health import InMemoryHealth

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
        cfg = structure_config(loopback_config(primary.url, second.url if second else None, **sections))
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
        cfg = structure_config(loopback_config(upstream.url, limits={"max_response_bytes": 32 << 20},
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
        cfg = structure_config(loopback_config(server.url.removesuffix("/v1/chat/completions"),
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
        cfg = structure_config(loopback_config(upstream.url, reliability={"provider_retries": 0}, gateway={"max_in_flight": 1}))
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
        cfg = structure_config(loopback_config(upstream.url, reliability={"provider_retries": 0}, breaker={"open_s": 10}))
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
        relay = Relay(structure_config(loopback_config(upstream.url)), env={})
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

    relay = Relay(structure_config(loopback_config("http://127.0.0.1:9")), env={})
    status, _, body = await asgi(Gateway(relay), "/v1/chat/completions", raw=b'{"model": "m-primary", "messages": '
                                 b'[{"role": "user", "content": "bad \\ud800 text"}]}')
    assert status == 400 and "surrogate" in body["error"]["message"]
    await relay.aclose()


async def asgi(app, path: str, obj=None, raw: bytes | None = None):
    """One request through the ASGI app, in process; the answer's JSON."""
    status, headers, payload = await asgi_post(app, path, raw if raw is not None else json.dumps(obj).encode())
    return status, headers, json.loads(payload)


async def test_a_cancellation_that_arrives_while_connecting_is_recorded_as_the_turns(monkeypatch):
    """Found by the await-point property below: trio's connect (happy eyeballs) runs a nursery,
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
        async with Relay(structure_config(loopback_config(named)), env={}) as relay:
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
        relay = Relay(structure_config(loopback_config(upstream.url)), env={})
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
        relay = Relay(structure_config(loopback_config(upstream.url, timeouts={"total_s": 60})), env={})
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
        relay = Relay(structure_config(loopback_config(upstream.url, limits={"max_response_bytes": 65536})), env={})
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
    from relayline.adapters.gateway import Gateway

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
        relay = Relay(structure_config(loopback_config(primary.url, backup.url, gateway={"body_timeout_s": 0.3},
                                              timeouts={"headers_s": 5, "idle_s": 5, "total_s": 10})), env={})
        results = []
        relay.observers.append(results.append)
        gateway = Gateway(relay)
        url = await serve_in_process(nursery, gateway)
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


# -- an exception at every await point of a turn --------------------------------------------------

OPEN_S = 10.0
PROFILES = ("primary", "backup")

ERRORS: dict[str, Callable[[], Exception]] = {
    "ValueError": lambda: ValueError("injected"),
    "OSError": lambda: OSError(104, "injected reset"),
    "BrokenResourceError": lambda: trio.BrokenResourceError("injected"),
    "ClosedResourceError": lambda: trio.ClosedResourceError("injected"),
    "h11.RemoteProtocolError": lambda: h11.RemoteProtocolError("injected"),
    "TooSlowError": lambda: trio.TooSlowError("injected"),
    "h11.LocalProtocolError": lambda: h11.LocalProtocolError("injected"),
    "UnicodeEncodeError": lambda: UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"),
    "KeyError": lambda: KeyError("injected"),
    "RuntimeError": lambda: RuntimeError("injected"),
}
OUTSIDE_AN_ATTEMPT = {"sink", "sleep", "health.sync"}  # a raise there settles the turn


class Faults:
    """A turn's await points, counted at its seams by name; the `at` one (a name and its
    occurrence: the second read, the first sleep) raises. Naming the point, not its global
    index, keeps a drawn fault where it was when a socket delivers a reply in fewer reads."""

    def __init__(self, at: tuple[str, int] | None = None, error: str = "ValueError",
                 settled: Callable[[], bool] = lambda: False) -> None:
        self.at = at
        self.error_name = error
        self.settled = settled  # whether the turn already had its result
        self.points: list[tuple[str, int]] = []
        self._seen: dict[str, int] = {}
        self.fired: str | None = None
        self.after_result = False
        self.raised: Exception | None = None
        self.requests = 0  # HTTP requests the turn started: one per attempt

    def point(self, name: str) -> None:
        occurrence = self._seen.get(name, 0)
        self._seen[name] = occurrence + 1
        self.points.append((name, occurrence))
        if (name, occurrence) == self.at:
            self.fired = name
            self.after_result = self.settled()
            self.raised = ERRORS[self.error_name]()
            raise self.raised


FAULTS: ContextVar[Faults | None] = ContextVar("relayline_test_faults", default=None)


def _at(name: str) -> None:
    faults = FAULTS.get()
    if faults is not None:
        faults.point(name)


_ssl_context: list = []


@contextlib.contextmanager
def seams():
    """Wrap the turn's await points. Inert outside a task where FAULTS is set (the loopback
    upstreams' tasks never see it)."""
    connect, read, write, aclose = Connection.connect, Connection.read, Connection.write, Connection.aclose
    exchange, sleep = ProfilePool.exchange, trio.sleep
    create_ssl_context = httpx.create_ssl_context

    async def connect_(*args, **kwargs):
        _at("connect")
        return await connect(*args, **kwargs)

    async def read_(self, *args, **kwargs):
        _at("read")
        data = await read(self, *args, **kwargs)
        _at("read:after")  # the bytes were taken from the socket, then the raise
        return data

    async def write_(self, *args, **kwargs):
        _at("write")
        return await write(self, *args, **kwargs)

    async def aclose_(self):
        try:
            _at("close")
        finally:
            await aclose(self)

    def exchange_(self, *args, **kwargs):
        faults = FAULTS.get()
        if faults is not None:
            faults.requests += 1
        return exchange(self, *args, **kwargs)

    async def sleep_(seconds):
        _at("sleep")
        await sleep(seconds)

    def shared_ssl_context(*args, **kwargs):
        # building one reads the CA bundle (60 ms of every Relay's start): these relays talk
        # plain HTTP on loopback, so they share one
        if args or kwargs:
            return create_ssl_context(*args, **kwargs)
        if not _ssl_context:
            _ssl_context.append(create_ssl_context())
        return _ssl_context[0]

    patches = [(httpx, "create_ssl_context", shared_ssl_context), (Connection, "connect", connect_),
               (Connection, "read", read_), (Connection, "write", write_), (Connection, "aclose", aclose_),
               (ProfilePool, "exchange", exchange_), (trio, "sleep", sleep_)]
    with contextlib.ExitStack() as stack:
        for owner, name, value in patches:
            stack.enter_context(_patched(owner, name, value))
        yield


@contextlib.contextmanager
def _patched(owner, name: str, value):
    before = vars(owner)[name]  # a classmethod as it was defined, not bound
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


class FleetMirror(InMemoryHealth):
    """A health store shaped like a fleet's (stores/health.py): the driver awaits its `sync`
    before each decision of a turn and after it; here that await is one more seam."""

    pending = True

    async def sync(self, profiles) -> None:
        _at("health.sync")
        await trio.lowlevel.checkpoint()


# -- upstreams -------------------------------------------------------------------------------------


def stream(text: str) -> Reply:
    def chunk(obj) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    frames = (chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}),
              chunk({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}),
              chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
              chunk({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}),
              b"data: [DONE]\n\n")
    return Reply(headers=SSE_HEADERS, pieces=frames)


def overloaded() -> Reply:
    return Reply(status=503, headers=JSON_HEADERS, pieces=(b'{"error": {"message": "overloaded"}}',))


class Upstream:
    """A provider that answers from a script, then healthily."""

    def __init__(self, name: str, script: list[str]) -> None:
        self.name = name
        self.script = list(script)
        self.server = LoopbackServer(self.reply)

    def reply(self, seen) -> Reply:
        kind = self.script.pop(0) if self.script else "ok"
        if kind == "503":
            return overloaded()
        return stream(f"from {self.name}") if seen.body.get("stream") else ok(f"from {self.name}")


# -- one scenario ------------------------------------------------------------------------------------


@st.composite
def scenarios(draw):
    return {
        "stream": draw(st.booleans()),
        "half_open": draw(st.booleans()),  # the faulted turn holds the primary's probe
        "primary": draw(st.sampled_from([[], ["503"]])),  # its first reply in the faulted turn
        "retries": draw(st.integers(0, 1)),
        "backup": draw(st.booleans()),
        "fleet": draw(st.booleans()),
    }


def relay_config(primary: str, backup: str | None, retries: int) -> dict:
    return loopback_config(primary, backup, reliability={"provider_retries": retries, "backoff_ms": 100},
                           breaker={"open_s": OPEN_S}, timeouts={"headers_s": 20, "idle_s": 20, "total_s": 120})


@contextlib.asynccontextmanager
async def setting(shape: dict):
    """The scenario's upstreams (a primary that follows its script, a healthy backup), its
    config and health store, with the primary half-open when the shape says so."""
    async with trio.open_nursery() as nursery:
        primary = Upstream("primary", shape["primary"])
        await primary.server.start(nursery)
        backup = None
        if shape["backup"]:
            backup = Upstream("backup", [])
            await backup.server.start(nursery)
        cfg = structure_config(relay_config(primary.server.url, backup.server.url if backup else None,
                                            shape["retries"]))
        health = (FleetMirror if shape["fleet"] else InMemoryHealth)(cfg.breaker, cfg.timeouts.total_s)
        if shape["half_open"]:
            health.breaker("primary").failure(trio.current_time())
            await trio.sleep(OPEN_S)
            assert health.breaker("primary").refresh(trio.current_time()) == "half_open"
        yield primary, cfg, health
        nursery.cancel_scope.cancel()


async def after_the_fault(primary: Upstream, health) -> dict:
    """The breakers as the fault left them; then open ones cool off (a provider failure the
    fault meant) and the primary turns healthy, whatever the fault left of its script."""
    now = trio.current_time()
    breakers = {p: health.breaker(p).refresh(now) for p in PROFILES}
    if "open" in breakers.values():
        await trio.sleep(OPEN_S)
    primary.script.clear()
    return breakers


async def run_scenario(shape: dict, faults: Faults) -> dict:
    """The faulted turn under `faults`, then the next turn; returns what the checks need."""
    async with setting(shape) as (primary, cfg, health), Relay(cfg, env={}, health=health) as relay:
        async def sink(event) -> None:
            _at("sink")
            await trio.lowlevel.checkpoint()

        runs: list = []
        raised = None
        faults.settled = lambda: bool(runs) and runs[0].result is not None
        token = FAULTS.set(faults)
        try:
            with trio.fail_after(100):
                await turns_of(relay).run(HI, stream=shape["stream"], sink=sink, run_hook=runs.append)
        except Exception as exc:  # the turn's settle: checked against what was injected
            raised = exc
        finally:
            FAULTS.reset(token)
        after = await after_the_fault(primary, health)
        with trio.fail_after(100):
            following = await turns_of(relay).run(HI, stream=shape["stream"], sink=sink)
        closed = health.breaker("primary").state
    return {"result": runs[0].result, "raised": raised, "after": after, "next": following, "closed": closed}


def run(shape: dict, faults: Faults) -> dict:
    with seams():
        # virtual time (backoff, open_s) jumps only when the run sat idle for a real 5 ms:
        # loopback I/O is never that slow, so no deadline fires for it
        return trio.run(run_scenario, shape, faults, clock=trio.testing.MockClock(autojump_threshold=0.005))


_points: dict[tuple, list[tuple[str, int]]] = {}


def await_points(shape: dict, runner=None) -> list[tuple[str, int]]:
    """The await points a scenario's faulted turn passes (a dry run per shape and runner)."""
    runner = runner or run
    key = (runner.__name__, *sorted((k, str(v)) for k, v in shape.items()))
    if key not in _points:
        faults = Faults()
        runner(shape, faults)
        _points[key] = faults.points
    return _points[key]


def check(shape: dict, faults: Faults, seen: dict) -> None:
    result, raised = seen["result"], seen["raised"]
    context = (faults.fired, faults.error_name, faults.points, result and [str(a) for a in result.attempts])
    assert result is not None, context

    # the breaker: never left probing
    assert "probing" not in seen["after"].values(), (seen["after"], context)

    # the exception: an attempt's failure, or the turn's settle (then it reaches the caller as it was)
    if faults.fired in OUTSIDE_AN_ATTEMPT:
        assert raised is faults.raised, (repr(raised), context)
        if not faults.after_result:  # (a raise after it, in the final sync or delivery, keeps it)
            assert result.outcome == "error" and result.error == "internal", context
    else:
        assert raised is None, (repr(raised), context)

    # the ledger: one attempt per request that started; the rows add up; accepted iff answered
    assert len(result.attempts) == faults.requests, context
    assert math.isclose(result.cost_usd, sum(r.cost_usd for r in result.ledger)), context
    accepted = [r for r in result.ledger if r.accepted]
    if result.outcome == "ok":
        assert len(accepted) == 1 and accepted[0].provider == result.served.profile, (result.ledger, context)
        assert accepted[0].input_tokens == 7 and accepted[0].output_tokens == 3, context
    else:
        assert not accepted, (result.ledger, context)
    attempted = {a.provider for a in result.attempts}
    assert all(r.provider in attempted for r in result.ledger), context

    # the next turn answers from the primary and leaves its breaker closed (probing it first when
    # it was half-open)
    following = seen["next"]
    assert following.outcome == "ok" and following.served.profile == "primary", \
        ([str(a) for a in following.attempts], context)
    assert seen["closed"] == "closed", context


@pytest.mark.property
@settings(deadline=None, max_examples=settings.default.max_examples // 2)  # ci: 40; fuzz: 1500
@given(shape=scenarios(), error=st.sampled_from(sorted(ERRORS)), data=st.data())
def test_an_exception_at_any_await_point_of_a_turn_never_wedges_it(shape, error, data):
    at = data.draw(st.sampled_from(await_points(shape)), label="at")
    faults = Faults(at, error)
    seen = run(shape, faults)
    event(f"fault at {faults.fired or 'none'}")
    check(shape, faults, seen)


# -- the same through the gateway: its ledger store and its client's socket are seams too ------------


class FaultyLedger(LedgerStore):
    """The gateway's SQLite ledger, whose write is one more await point."""

    async def record(self, turn_id, result, *, client: str = "", key: str = "", team: str = "") -> int:
        _at("ledger")
        return await super().record(turn_id, result, client=client)


async def gateway_request(gateway: Gateway, body: dict, *, faulty: bool) -> tuple[int | None, dict, bytes]:
    """One POST through the ASGI app in process; its client's `send` is a seam when `faulty`."""
    raw = json.dumps(body).encode()
    status, headers, payload = await asgi_post(
        gateway, "/v1/chat/completions", raw, [(b"content-type", b"application/json"),
                                               (b"content-length", str(len(raw)).encode())],
        on_send=(lambda message: _at("send")) if faulty else None, bound=100)
    return status, {k.decode(): v.decode() for k, v in headers}, payload


async def run_gateway_scenario(shape: dict, faults: Faults) -> dict:
    async with setting(shape) as (primary, cfg, health):
        relay = Relay(cfg, env={}, health=health)
        results: list = []
        relay.observers.append(results.append)
        ledger = FaultyLedger(":memory:")
        gateway = Gateway(relay, ledger=ledger)
        body = {"model": "m-primary", "messages": HI, "stream": shape["stream"]}
        faults.settled = lambda: bool(results)
        token = FAULTS.set(faults)
        try:
            answer = await gateway_request(gateway, body, faulty=True)
        finally:
            FAULTS.reset(token)
        rows = ledger.rows()
        result = results[0] if results else None
        after = await after_the_fault(primary, health)
        following = await gateway_request(gateway, body, faulty=False)
        closed = health.breaker("primary").state
        await relay.aclose()
        ledger.close()
    return {"answer": answer, "result": result, "rows": rows, "after": after,
            "next": following, "closed": closed}


def check_gateway(shape: dict, faults: Faults, seen: dict) -> None:
    status, headers, body = seen["answer"]
    result = seen["result"]
    context = (faults.fired, faults.error_name, faults.points, status, body[:300],
               result and [str(a) for a in result.attempts])
    assert result is not None, context
    assert "probing" not in seen["after"].values(), (seen["after"], context)

    # the client's answer: a JSON_HEADERS error or a 200 that tells its whole story, unless its own
    # socket failed (then there is nobody left to tell)
    if faults.fired != "send":
        assert status is not None, context
        if status != 200:
            assert "error" in json.loads(body), context  # never an empty 500
        elif not shape["stream"]:
            assert "choices" in json.loads(body), context
        else:  # [DONE], or the explicit error event last
            assert body.rstrip().endswith(b"data: [DONE]") or b'"error"' in body.rsplit(b"data: ", 1)[-1], context

    # the ledger store holds the turn's rows, unless its own write was the fault
    if faults.fired == "ledger":
        assert seen["rows"] == [], context
    else:
        assert len(seen["rows"]) == len(result.ledger), (seen["rows"], result.ledger, context)
        assert math.isclose(sum(r["cost_usd"] for r in seen["rows"]), result.cost_usd), context
    accepted = [r for r in result.ledger if r.accepted]
    assert len(accepted) == (1 if result.outcome == "ok" else 0), (result.ledger, context)

    status, headers, body = seen["next"]
    assert status == 200 and headers["x-relayline-served"] == "primary/m-primary", (status, body[:300], context)
    assert seen["closed"] == "closed", context


def run_gateway(shape: dict, faults: Faults) -> dict:
    with seams():
        return trio.run(run_gateway_scenario, shape, faults, clock=trio.testing.MockClock(autojump_threshold=0.005))


@pytest.mark.property
@settings(deadline=None, max_examples=settings.default.max_examples // 2)  # ci: 40; fuzz: 1500
@given(shape=scenarios(), error=st.sampled_from(sorted(ERRORS)), data=st.data())
def test_an_exception_at_any_await_point_of_a_gateway_turn_keeps_its_ledger_and_the_next_request(shape, error, data):
    at = data.draw(st.sampled_from(await_points(shape, run_gateway)), label="at")
    faults = Faults(at, error)
    seen = run_gateway(shape, faults)
    event(f"fault at {faults.fired or 'none'}")
    check_gateway(shape, faults, seen)

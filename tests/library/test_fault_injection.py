"""An exception at every await point of a turn: Hypothesis picks the point and the
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
from collections.abc import Callable
from contextvars import ContextVar

import h11
import httpx
import pytest
import trio
import trio.testing
from hypothesis import event, given, settings
from hypothesis import strategies as st

from helpers import asgi_post, loopback_config
from relayline.adapters import Relay
from relayline.adapters.gateway import Gateway
from relayline.adapters.providers.pool import ProfilePool
from relayline.adapters.providers.upstream import Connection
from relayline.adapters.relay import turns_of
from relayline.adapters.sim.loopback import LoopbackServer, Reply
from relayline.adapters.stores.ledger import LedgerStore
from relayline.machines.config import structure_config
from relayline.machines.health import InMemoryHealth

HI = [{"role": "user", "content": "hi"}]
JSON = (("content-type", "application/json"),)
SSE = (("content-type", "text/event-stream"),)
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


def completion(text: str) -> Reply:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
    return Reply(headers=JSON, pieces=(json.dumps(body).encode(),))


def stream(text: str) -> Reply:
    def chunk(obj) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    frames = (chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}),
              chunk({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}),
              chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
              chunk({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}),
              b"data: [DONE]\n\n")
    return Reply(headers=SSE, pieces=frames)


def overloaded() -> Reply:
    return Reply(status=503, headers=JSON, pieces=(b'{"error": {"message": "overloaded"}}',))


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
        return stream(f"from {self.name}") if seen.body.get("stream") else completion(f"from {self.name}")


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

    # the client's answer: a JSON error or a 200 that tells its whole story, unless its own
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

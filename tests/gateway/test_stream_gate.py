"""A streamed answer without a task of its own (stream_wire.py's StreamWire and GateTimer), on
virtual time against the scripted sim upstream unless it says otherwise.

- Held headers: they go out after `timeouts.gate_commit_s` when nothing decisive came (a slow
  model is not an error), whatever the turn waits on (an upstream read, a retry's backoff), from
  the gateway's one gate timer, which forgets a stream that committed first; frames then go out
  as they come, and the turn's end loses no byte.
- Writes: they happen in the turn's task, the frames of one upstream read in one write made
  before the adapter waits again; the answer's first words (and what the gate held before them)
  in a write of their own before the rest of their read, whoever committed the headers.
- A turn that already ended: the gate holds no more. What the response is (a real error status
  for a stream that showed nothing, or the stream's end) is the turn's result's to decide, even
  when accounting for the turn (the ledger's commit) takes past gate_commit_s.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import trio

from helpers import asgi_post, serve_in_process, sim_toml
from relayline.adapters import Relay
from relayline.adapters.gateway import Gateway
from relayline.adapters.gateway.stream_wire import GateTimer
from relayline.adapters.providers.sim import SimUpstream
from relayline.adapters.relay import turns_of
from relayline.adapters.sim.loopback import LoopbackServer, Reply
from relayline.machines.config import structure_config

BODY = json.dumps({"model": "m1", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
PRICE = {"input_per_mtok": 1.0, "output_per_mtok": 2.0}


def relay_for(script: list, gate: float, *, times: int = 1, retries: int = 1) -> Relay:
    """sim.a (model m1) answering `script`, `times` over, its streams held up to `gate` seconds;
    a failed attempt is retried `retries` times, each after a 5 s backoff."""
    sim = SimUpstream.from_replies([{"provider": "sim.a", "script": script}] * times)
    config = sim_toml({"model": "m1", "price": PRICE}, timeouts={"gate_commit_s": gate},
                      reliability={"provider_retries": retries, "backoff_ms": 5000})
    return Relay.from_toml(config, env={}, clients=sim.clients())


def gateway_for(script: list, gate: float, times: int = 1) -> Gateway:
    return Gateway(relay_for(script, gate, times=times))


async def streamed(gateway: Gateway) -> list[tuple[float, dict]]:
    started = trio.current_time()
    sent: list[tuple[float, dict]] = []
    await asgi_post(gateway, "/v1/chat/completions", BODY,
                    on_send=lambda message: sent.append((trio.current_time() - started, message)))
    return sent


def bodies(sent) -> list[tuple[float, bytes]]:
    return [(at, message["body"]) for at, message in sent if message.get("body")]


def content(message: dict) -> bytes:
    return message.get("body", b"")


# -- held headers and gate_commit_s -------------------------------------------------------------


async def test_a_slow_model_gets_its_headers_and_role_frame_at_gate_commit_s(autojump_clock):
    frames = [{"role": True}, {"wait": 5}, {"text": "late"}, {"done": True}]
    sent = await streamed(gateway_for([{"frames": frames}], gate=1))
    head_at = next(at for at, message in sent if message["type"] == "http.response.start")
    role_at = next(at for at, message in sent if b'"role":"assistant"' in content(message))
    text_at = next(at for at, message in sent if b'"late"' in content(message))
    assert 1 <= head_at < 1.1 and 1 <= role_at < 1.1 and text_at >= 5
    assert sent[0][1]["status"] == 200 and b"data: [DONE]" in content(sent[-1][1])


async def test_a_stream_that_commits_before_gate_commit_s_is_not_held_to_it(autojump_clock):
    frames = [{"role": True}, {"text": "soon"}, {"wait": 3}, {"text": " then"}, {"done": True}]
    sent = await streamed(gateway_for([{"frames": frames}], gate=30))
    text_at = next(at for at, message in sent if b'"soon"' in content(message))
    body = b"".join(content(message) for _, message in sent)
    assert text_at < 0.1 and body.count(b"data: ") == body.count(b"\n\n") and b'" then"' in body
    assert b"data: [DONE]" in content(sent[-1][1]) and not any(message.get("more_body") for _, message in sent[-1:])


async def test_without_a_gate_timer_the_headers_wait_for_the_first_decisive_frame(autojump_clock):
    frames = [{"role": True}, {"wait": 5}, {"text": "late"}, {"done": True}]
    sent = await streamed(gateway_for([{"frames": frames}], gate=0))
    head_at = next(at for at, message in sent if message["type"] == "http.response.start")
    assert head_at >= 5


# -- writes in the turn's task, and the one timer ----------------------------------------------


async def test_the_frames_of_one_read_leave_in_one_write_before_the_upstream_is_waited_on(autojump_clock):
    frames = [{"role": True}, {"text": "a"}, {"text": "b"}, {"text": "c"}, {"wait": 2}, {"text": "d"}, {"done": True}]
    writes = bodies(await streamed(gateway_for([{"frames": frames}], gate=30)))
    assert [b'"a"' in body for _, body in writes] == [True, False, False]  # the first token at once
    at, together = writes[1]
    assert b'"b"' in together and b'"c"' in together and at < 0.1  # before the 2 s wait, not after it
    assert writes[2][0] >= 2 and b'"d"' in writes[2][1] and b"data: [DONE]" in writes[2][1]


async def test_after_headers_the_gate_timer_sent_the_first_token_leaves_before_the_rest_of_its_read(autojump_clock):
    # the model is slower than gate_commit_s, then its first words come as a burst: they do not
    # wait for the rest of the burst to be rendered
    frames = [{"role": True}, {"wait": 2}, {"text": "a"}, {"text": "b"}, {"text": "c"}, {"wait": 2},
              {"text": "d"}, {"done": True}]
    writes = bodies(await streamed(gateway_for([{"frames": frames}], gate=1)))
    assert [at < 1.1 for at, _ in writes] == [True, False, False, False]  # the role frame at the gate
    assert b'"role":"assistant"' in writes[0][1] and b'"a"' not in writes[0][1]
    (first_at, first), (rest_at, rest) = writes[1:3]
    assert b'"a"' in first and b'"b"' not in first  # the first token alone, at once
    assert b'"b"' in rest and b'"c"' in rest and b'"d"' not in rest  # the rest of the burst together
    assert first_at < 2.1 and rest_at < 2.1  # both before the upstream is waited on again
    assert b'"d"' in writes[3][1] and b"data: [DONE]" in writes[3][1]
    body = b"".join(body for _, body in writes)
    assert body.count(b"data: ") == body.count(b"\n\n") and body.index(b'"a"') < body.index(b'"b"')


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def _redacted_first(seen) -> Reply:
    """An Anthropic stream whose thinking is redacted whole, then its words, the first two in the
    same piece as the redacted block (one read), the rest after a pause."""
    start = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m1", "content": [],
             "stop_reason": None, "usage": {"input_tokens": 3, "output_tokens": 1}}
    burst = b"".join((
        _event("message_start", {"type": "message_start", "message": start}),
        _event("content_block_start", {"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "redacted_thinking", "data": "EmwKAhgB"}}),
        _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _event("content_block_start", {"type": "content_block_start", "index": 1,
                                       "content_block": {"type": "text", "text": ""}}),
        *(_event("content_block_delta", {"type": "content_block_delta", "index": 1,
                                         "delta": {"type": "text_delta", "text": word}}) for word in ("w0", "w1"))))
    end = b"".join((
        _event("content_block_stop", {"type": "content_block_stop", "index": 1}),
        _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                 "usage": {"output_tokens": 2}}),
        _event("message_stop", {"type": "message_stop"})))
    return Reply(pieces=(burst, 0.2, end))


async def test_the_first_words_leave_at_once_after_what_the_gate_held_before_them():
    """The gate held a redacted thinking block (shown, but no words): the commit writes it with
    the first words, which do not wait for the rest of their read."""
    upstream = LoopbackServer(_redacted_first)
    async with trio.open_nursery() as nursery:
        await upstream.start(nursery)
        config = {"active": "p", "providers": {"p": {"family": "anthropic", "base_url": upstream.url,
                                                     "model": "m1", "api_key": "k-redacted"}}}
        sent: list[dict] = []
        status, _, body = await asgi_post(Gateway(Relay(structure_config(config), env={})),
                                          "/v1/chat/completions", BODY, on_send=sent.append)
        nursery.cancel_scope.cancel()
    writes = [message["body"] for message in sent if message.get("body")]
    first = next(write for write in writes if b'"w0"' in write)
    assert status == 200 and b"EmwKAhgB" in first and b'"w1"' not in first
    assert body.index(b"EmwKAhgB") < body.index(b'"w0"') < body.index(b'"w1"') and b"data: [DONE]" in body


async def test_the_gate_commits_held_headers_while_the_turn_sleeps_between_attempts(autojump_clock):
    script = [{"status": 503}, {"frames": [{"role": True}, {"text": "late"}, {"done": True}]}]
    sent = await streamed(gateway_for(script, gate=1))
    head_at = next(at for at, message in sent if message["type"] == "http.response.start")
    text_at = next(at for at, body in bodies(sent) if b'"late"' in body)
    assert 1 <= head_at < 1.1 and text_at >= 5  # the backoff is 5 s: the head did not wait for it
    assert sent[0][1]["status"] == 200 and b"data: [DONE]" in sent[-1][1]["body"]


async def test_many_held_streams_share_the_one_timer(autojump_clock):
    frames = [{"role": True}, {"wait": 5}, {"text": "late"}, {"done": True}]
    gateway = gateway_for([{"frames": frames}], gate=1, times=40)
    results: list = []

    async def one() -> None:
        results.append(await streamed(gateway))

    async with trio.open_nursery() as nursery:
        for _ in range(40):
            nursery.start_soon(one)
    for sent in results:
        head_at = next(at for at, message in sent if message["type"] == "http.response.start")
        assert 1 <= head_at < 1.1 and b"data: [DONE]" in sent[-1][1]["body"]
    assert len(results) == 40 and gateway.chat.gates.queued == 0


class _Held:
    """What the timer needs of a stream: its entry, the release, and the commit."""

    def __init__(self, timer: GateTimer) -> None:
        self.timer = timer
        self._gate = None
        self.committed_at: float | None = None

    def _disarm(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            self.timer.release(gate)

    async def at_gate(self) -> None:
        self.committed_at = trio.current_time()


async def test_the_timer_commits_the_streams_still_held_and_forgets_the_others(autojump_clock):
    timer = GateTimer()
    streams = [_Held(timer) for _ in range(1000)]
    start = trio.current_time()
    for i, stream in enumerate(streams):
        timer.hold(stream, start + 1 + i / 1000)
    for stream in streams[100:]:
        stream._disarm()  # committed (or ended) before its gate
    assert len(timer._heap) <= 2 * 100  # their entries went with them, not at their deadlines
    await trio.sleep(3)
    assert all(start + 1 <= s.committed_at < start + 1.2 for s in streams[:100])
    assert all(s.committed_at is None for s in streams[100:])
    assert timer._heap == [] and timer._runner is None  # its task ended: it starts again with the next gate
    later = _Held(timer)
    timer.hold(later, trio.current_time() + 1)
    await trio.sleep(2)
    assert later.committed_at is not None


def _chunk(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _held_reply(seen) -> Reply:
    """A role frame and a first token, then the provider waits (a held stream), then the end."""
    return Reply(pieces=(_chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
                         _chunk({"choices": [{"index": 0, "delta": {"content": "w0"}, "finish_reason": None}]}), 1.5,
                         _chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}), b"data: [DONE]\n\n"))


def _task_names() -> Counter:
    names, todo = Counter(), [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        names[task.name] += 1
        todo += [child for nursery in task.child_nurseries for child in nursery.child_tasks]
    return names


async def test_a_held_stream_is_its_connections_task_alone():
    """What a stream in flight costs is mostly its tasks and scopes (docs/performance-history.md): a
    held stream through the real server and upstream client adds the server's task for its
    connection and the upstream's own (this process serves both), nothing per stream besides."""
    upstream = LoopbackServer(_held_reply)
    held = 12
    async with trio.open_nursery() as nursery:
        await upstream.start(nursery)
        config = {"active": "p", "timeouts": {"gate_commit_s": 30},
                  "providers": {"p": {"family": "openai", "base_url": f"{upstream.url}/v1", "model": "m1",
                                      "api_key": "k-held"}}}
        gateway = Gateway(Relay(structure_config(config), env={}))
        url = await serve_in_process(nursery, gateway)
        host, port = url.removeprefix("http://").split(":")
        before = _task_names()
        streams = []
        with trio.fail_after(10):
            for _ in range(held):
                stream = await trio.open_tcp_stream(host, int(port))
                streams.append(stream)
                await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: %d\r\n\r\n%s"
                                      % (len(BODY), BODY))
                received = b""
                while b'"w0"' not in received:
                    received += await stream.receive_some(65536)
            during = _task_names() - before
            for stream in streams:
                received = b""
                while not received.endswith(b"0\r\n\r\n"):
                    received += await stream.receive_some(65536)
                await stream.aclose()
        nursery.cancel_scope.cancel()
    # per stream: the server's task for its connection, and the loopback upstream's for its
    # own (both trio's serve_tcp handlers); for them all, the gate timer (the streams committed:
    # it ends at its next wake-up)
    handlers = "trio._highlevel_serve_listeners._run_handler"
    assert during[handlers] == 2 * held and set(during) <= {handlers, "relayline gate timer"}, during


async def test_a_shorter_gate_held_while_the_timer_sleeps_is_served_at_its_own_deadline(autojump_clock):
    timer = GateTimer()
    start = trio.current_time()
    first, second = _Held(timer), _Held(timer)
    timer.hold(first, start + 30)
    await trio.sleep(0.1)  # the timer sleeps towards 30 s
    timer.hold(second, start + 1)  # (a reload shortened gate_commit_s)
    await trio.sleep(2)
    assert second.committed_at is not None and start + 1 <= second.committed_at < start + 1.1
    assert first.committed_at is None
    await trio.sleep(30)
    assert start + 30 <= first.committed_at < start + 30.1


class _SlowToCommit(_Held):
    async def at_gate(self) -> None:
        await trio.sleep(1)  # a client slow to take the held head
        await super().at_gate()


async def test_a_gate_held_while_the_last_task_waits_for_its_commits_is_served_by_the_next(autojump_clock):
    timer = GateTimer()
    start = trio.current_time()
    slow = _SlowToCommit(timer)
    timer.hold(slow, start + 1)
    await trio.sleep(1.5)  # its heap is empty: the task only waits for the slow commit
    later = [_Held(timer) for _ in range(100)]
    for i, stream in enumerate(later):
        timer.hold(stream, start + 3 + i / 100)
    await trio.sleep(1)  # the first task ended at 2 s: it must not take the new gates with it
    for stream in later[50:]:
        stream._disarm()  # committed before their gate, after that task ended
    await trio.sleep(2)
    assert start + 2 <= slow.committed_at < start + 2.1
    assert all(start + 3 <= s.committed_at < start + 4.1 for s in later[:50])
    assert all(s.committed_at is None for s in later[50:])
    assert timer._heap == [] and timer._runner is None and timer._live == 0


# -- a turn that already ended ------------------------------------------------------------------


class SlowLedger:
    """A ledger whose commit takes half a second (a busy disk, a remote database)."""

    def __init__(self) -> None:
        self.rows = 0

    async def record(self, turn_id: str, result, *, client: str = "", key: str = "", team: str = "") -> int:
        await trio.sleep(0.5)
        self.rows += len(result.ledger)
        return len(result.ledger)


async def test_a_stream_that_failed_before_gate_commit_s_keeps_its_error_status_while_its_ledger_commits(
        autojump_clock):
    # an empty answer (billed: it reported usage), and its non-streamed retry, end the turn at
    # 0.8 s, before the gate's 1 s;
    # its ledger row commits until 1.4 s
    script = [{"frames": [{"role": True}, {"wait": 0.4}, {"done": True}]}]
    ledger = SlowLedger()
    gateway = Gateway(relay_for(script, gate=1, retries=0), ledger=ledger)
    status, _, body = await asgi_post(gateway, "/v1/chat/completions", BODY)
    assert ledger.rows >= 1
    assert status != 200 and json.loads(body)["error"], (status, body[:300])


async def test_a_streams_ledger_rows_are_committed_before_its_last_bytes_are_sent(autojump_clock):
    # the gate committed the stream first (the model was slow), then a slow ledger commit: the
    # stream's end still waits for the rows
    script = [{"frames": [{"role": True}, {"wait": 1.5}, {"text": "late"}, {"done": True}]}]
    ledger = SlowLedger()
    rows_at_end = []

    def on_send(message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            rows_at_end.append(ledger.rows)

    gateway = Gateway(relay_for(script, gate=1, retries=0), ledger=ledger)
    status, _, body = await asgi_post(gateway, "/v1/chat/completions", BODY, on_send=on_send)
    assert status == 200 and b'"late"' in body and body.endswith(b"data: [DONE]\n\n")
    assert rows_at_end == [1]


@pytest.mark.parametrize("gate_s", [0.5, 30])
async def test_a_drain_answers_a_held_stream_503_and_one_the_gate_committed_with_its_error_event(gate_s, autojump_clock):
    # the model is silent after its role frame: at 2 s the drain (0.5 s) cuts the turn; with a
    # gate of 0.5 s the stream was committed by then (200, then the shutdown's error event), with
    # 30 s it is still held (a real 503, nothing shown)
    script = [{"frames": [{"role": True}, {"wait": 60}, {"text": "never"}, {"done": True}]}]
    gateway = Gateway(relay_for(script, gate=gate_s, retries=0))
    answers = []

    async def post() -> None:
        answers.append(await asgi_post(gateway, "/v1/chat/completions", BODY, bound=30))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post)
        await trio.sleep(2)
        await gateway.drain(0.5)
    ((status, _, body),) = answers
    if gate_s < 2:
        assert status == 200 and b'"role":"assistant"' in body
        assert b'"shutting_down"' in body.rsplit(b"data: ", 1)[1] and b"never" not in body
    else:
        assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down"
    assert not gateway.chat.gates.held and not gateway.turns.cancellers


@pytest.mark.parametrize("fails", ["planning", "admitting"])
async def test_a_stream_whose_run_could_not_be_made_or_started_leaves_no_gate_held(fails, monkeypatch, autojump_clock):
    # relayline's own bug where a turn's run is made (the plan) or where it is admitted: the
    # client gets a 500 and nothing after it; the gate timer holds no stream and never writes
    # a commit of its own (a held gate would write a 200 head after the 500, at gate_commit_s)
    script = [{"frames": [{"text": "x"}, {"done": True}]}]
    relay = relay_for(script, gate=1, retries=0)
    gateway = Gateway(relay)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(*((turns_of(relay), "new_run") if fails == "planning" else (gateway.turns, "admit")), broken)
    starts = []
    status, _, body = await asgi_post(gateway, "/v1/chat/completions", BODY,
                                      on_send=lambda m: starts.append(m.get("status")))
    await trio.sleep(3)  # past gate_commit_s
    assert status == 500 and json.loads(body)["error"]
    assert [s for s in starts if s is not None] == [500]
    assert not gateway.chat.gates.held and not gateway.chat.gates.queued and not gateway.turns.cancellers

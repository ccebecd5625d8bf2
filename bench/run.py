"""relayline benchmarks (`make bench`; never part of `make test`).

Each number is reported beside a baseline measured in the same run, so ratios survive a noisy
machine. This file measures the sans-I/O core:

- spec engine: one trigger on the compiled table vs the same trigger on a transitions.Machine;
- core turn: plan + walk + turn machine for a non-streaming success, vs a bare function call;
- catalog plan: a turn's plan for a 4-channel catalog model vs the default domain's plan;
- stream core: per-frame cost of the gate after commit for a 200-frame stream, vs a bare loop;
- whole driver turn on the in-process sim upstream (trio), vs a bare trio checkpoint loop;
- the wire: a chat completions body read into the canonical request and written for the other
  family (and for its own, as the client sent it), vs json.loads of the same bytes;
- the stream pipeline per frame (SSE decode, chunk parse, gate, render) with each fast path off
  in turn, and all of them off: each lever alone, same run;
- the gateway's own path with an in-process upstream, each lever off in turn (bench/gateway_cpu.py),
  and `--workers 2` against one worker with the CPU each process spends (bench/workers.py);
- the HTTP server floor (bench/floor.py) and the HTTP side by side (bench/peers.py): direct,
  gateway, library and LiteLLM, with the performance targets marked holds / does not hold;
- the library from asyncio, synchronous code and a trio guest run, beside trio (bench/hosts.py);
- a fleet's shared state (bench/fleet.py): Redis health vs the memory store, PostgreSQL vs SQLite.

Results: a table on stdout and bench/results/<date>.json.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fleet  # noqa: E402  (bench/fleet.py: the shared store and ledger beside one process)
import floor  # noqa: E402  (bench/floor.py: the HTTP server floor, hypercorn beside the gateway's own)
import gateway_cpu  # noqa: E402  (bench/gateway_cpu.py: the gateway's own path, each lever off in turn)
import ops  # noqa: E402  (bench/ops.py: what the access line and metrics cost per request)
import workers  # noqa: E402  (bench/workers.py: --workers 2 against one worker, and the ceiling)
from common import per_call_us  # noqa: E402
from hosts import bench_hosts, print_hosts  # noqa: E402  (bench/hosts.py: the library from each host)

from relayline.adapters import Relay
from relayline.machines.config import structure_config
from relayline.machines.engine import build_machine, load_spec
from relayline.machines.health import InMemoryHealth
from relayline.machines.plan import build_router, plan_turn
from relayline.machines.stream import TEXT, Frame
from relayline.machines.turn import Completion, Turn

CONFIG = structure_config({
    "active": "a",
    "providers": {
        "a": {"family": "sim", "model": "m1", "fallback_models": ["m2"], "fallbacks": ["b"]},
        "b": {"family": "sim", "model": "n1"},
    },
})


def bench_engine() -> dict:
    spec = load_spec("walk")

    class Model:
        blocked = False  # the walk's one guard: the retry goes to the same entry

    life = spec.start(history_limit=8)
    walk = Model()

    def table():
        life.state = "choosing"
        life.fire("call", walk)
        life.fire("backoff", walk)
        life.fire("timer", walk)
        life.fire("succeed", walk)

    def reference():
        model = Model()
        build_machine(spec, model)
        model.trigger("call")
        model.trigger("backoff")
        model.trigger("timer")
        model.trigger("succeed")

    model = Model()
    machine = build_machine(spec, model)

    def reference_triggers_only():
        machine.set_state("choosing")
        model.trigger("call")
        model.trigger("backoff")
        model.trigger("timer")
        model.trigger("succeed")

    t_table = per_call_us(table, 20000)
    t_ref = per_call_us(reference, 500)
    t_ref_triggers = per_call_us(reference_triggers_only, 5000)
    return {
        "table_4_triggers_us": t_table,
        "transitions_build_and_4_triggers_us": t_ref,
        "transitions_4_triggers_us": t_ref_triggers,
        "transitions_over_table": t_ref_triggers / t_table,
    }


def bench_core_turn() -> dict:
    router = build_router(CONFIG, {})
    health = InMemoryHealth(CONFIG.breaker)
    answer = Completion("hello", usage=None)

    def turn():
        plan = plan_turn(router, model=None, text="hi")
        t = Turn(plan, CONFIG, health, stream=False)
        t.start(0.0)
        t.on_completion(answer, 0.0)

    def bare():
        return None

    t_turn = per_call_us(turn, 5000)
    t_bare = per_call_us(bare, 200000)
    return {"core_turn_us": t_turn, "bare_call_us": t_bare}


def bench_catalog_plan() -> dict:
    """The chain is ordered once when the router is built; a turn only looks it up and prices it."""
    channels = {f"c{i}": {"family": "sim", "models": {"llama": f"id{i}"},
                          "prices": {"llama": {"input_per_mtok": 4.0 - i, "output_per_mtok": 1.0}}} for i in range(4)}
    config = structure_config({"active": "c0", "providers": channels,
                               "catalog": [{"model": "llama", "channels": list(channels), "max_hops": 3}]})
    router = build_router(config, {})
    t_catalog = per_call_us(lambda: plan_turn(router, model="llama"), 20000)
    t_default = per_call_us(lambda: plan_turn(router, model="other"), 20000)
    return {"catalog_plan_us": t_catalog, "default_plan_us": t_default}


def bench_stream_frames(frames: int = 200) -> dict:
    router = build_router(CONFIG, {})
    health = InMemoryHealth(CONFIG.breaker)
    tokens = [Frame(TEXT, f" w{i}") for i in range(frames)]

    def stream_turn():
        t = Turn(plan_turn(router, text="hi"), CONFIG, health, stream=True)
        t.start(0.0)
        t.stream_headers()
        for frame in tokens:
            t.stream_frame(frame)
        t.stream_done(0.0)

    def stream_turn_empty():
        t = Turn(plan_turn(router, text="hi"), CONFIG, health, stream=True)
        t.start(0.0)
        t.stream_headers()
        t.stream_frame(tokens[0])
        t.stream_done(0.0)

    def bare_loop():
        out = []
        for frame in tokens:
            out.append(frame.value)

    full = per_call_us(stream_turn, 1000)
    base = per_call_us(stream_turn_empty, 2000)
    loop = per_call_us(bare_loop, 5000)
    return {
        "stream_turn_200_frames_us": full,
        "per_frame_after_commit_us": (full - base) / (frames - 1),
        "bare_loop_per_frame_us": loop / frames,
    }


def bench_frame_levers(frames: int = 200) -> dict:
    """Each per-frame lever alone, on and off in the same run: the stream pipeline a gateway runs
    for every upstream frame (SSE decode, chunk parse, gate, render), per frame."""
    import contextlib

    from upstream import body_for

    from relayline.adapters import jsoncodec
    from relayline.adapters.codecs import openai_chat_answers, openai_chat_replies
    from relayline.adapters.sse import SSEDecoder

    raw = body_for("frames", frames, True)
    crlf = raw.replace(b"\n", b"\r\n")  # the same stream through the general line splitter
    router = build_router(CONFIG, {})
    health = InMemoryHealth(CONFIG.breaker)
    per = frames + 4  # the role frame, the finish, the usage chunk and [DONE]

    @contextlib.contextmanager
    def off(lever: str):
        saved = (jsoncodec.loads, openai_chat_replies._only_text, openai_chat_answers.OpenAIStream.event, jsoncodec.loads_shape)
        if lever in ("orjson", "all"):
            jsoncodec.loads = json.loads
        if lever in ("one read", "orjson", "all"):
            def checked(data):  # a text chunk read by loads, its checks and all
                try:
                    return jsoncodec.loads(data)
                except ValueError:
                    return None
            jsoncodec.loads_shape = checked
        if lever in ("text shortcut", "all"):
            openai_chat_replies._only_text = lambda obj: None
        if lever in ("slotted chunks", "all"):
            def whole(self, event, _event=saved[2]):
                field = self.DELTAS.get(event.kind)
                return self._chunk({field: event.value}) if field else _event(self, event)
            openai_chat_answers.OpenAIStream.event = whole
        try:
            yield
        finally:
            jsoncodec.loads, openai_chat_replies._only_text, openai_chat_answers.OpenAIStream.event, jsoncodec.loads_shape = saved

    def pipeline(data: bytes) -> None:
        turn = Turn(plan_turn(router, text="hi"), CONFIG, health, stream=True)
        turn.start(0.0)
        turn.stream_headers()
        parser = openai_chat_replies.OpenAIStreamParser()
        render = openai_chat_answers.OpenAIStream("chatcmpl-1", False)
        render.opening("m")
        for event in SSEDecoder().feed(data):
            for frame in parser.feed(event):
                for shown in turn.stream_frame(frame):
                    render.event(shown)

    out = {"frames": frames}
    for lever, data in (("none", raw), ("orjson", raw), ("one read", raw), ("text shortcut", raw), ("slotted chunks", raw),
                        ("sse lf split", crlf), ("all", crlf)):
        with off(lever):
            out[f"per_frame_us_without_{lever.replace(' ', '_')}"] = per_call_us(lambda d=data: pipeline(d), 100) / per
    out["per_frame_us"] = out.pop("per_frame_us_without_none")
    return out


def bench_trio_handoff(items: int = 20000) -> dict:
    """trio's floor for handing an event from one task to another (the library's stream hands
    each event to the consumer's task through an unbuffered channel, so that an event counts as
    forwarded only once the consumer took it): per item, and a bare checkpoint."""
    async def channel(size: int) -> float:
        send, receive = trio.open_memory_channel[int](size)

        async def produce() -> None:
            async with send:
                for i in range(items):
                    await send.send(i)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            async for _ in receive:
                pass
        return (time.perf_counter() - start) / items * 1e6

    async def batched(per_read: int = 100) -> float:
        """The library's hand-off since (relay.py's _Batches): the turn puts the events of one
        read without a checkpoint, the consumer takes them in one wake-up."""
        from relayline.adapters.relay import _Batches
        from relayline.machines.stream import Event
        from relayline.machines.vocab import EventKind

        batches = _Batches()
        batches.first = False  # (the first event's own hand-off needs a turn: one per stream)
        event = Event(EventKind.TEXT, "w")

        async def produce() -> None:
            for _ in range(items // per_read):
                for _ in range(per_read):
                    await batches(event)
                await trio.lowlevel.checkpoint()  # the next upstream read
            batches.close()

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            while await batches.take() is not None:
                pass
        return (time.perf_counter() - start) / items * 1e6

    async def checkpoints() -> float:
        start = time.perf_counter()
        for _ in range(items):
            await trio.lowlevel.checkpoint()
        return (time.perf_counter() - start) / items * 1e6

    out: dict = {}

    async def main() -> None:
        out["unbuffered_channel_item_us"] = await channel(0)
        out["buffered_channel_item_us"] = await channel(256)
        out["batched_handoff_item_us"] = await batched()
        out["checkpoint_us"] = await checkpoints()

    trio.run(main)
    return out


def bench_driver(turns: int = 300) -> dict:
    relay = Relay(CONFIG, env={})
    messages = [{"role": "user", "content": "hi"}]

    async def run_turns():
        for _ in range(turns):
            await relay.complete(messages)

    async def bare():
        for _ in range(turns):
            await trio.lowlevel.checkpoint()

    samples, base = [], []
    for _ in range(3):
        start = time.perf_counter()
        trio.run(run_turns)
        samples.append((time.perf_counter() - start) / turns * 1e6)
        start = time.perf_counter()
        trio.run(bare)
        base.append((time.perf_counter() - start) / turns * 1e6)
    return {"library_complete_turn_us": statistics.median(samples), "trio_checkpoint_us": statistics.median(base)}


def bench_wire() -> dict:
    """What reading and translating a request costs, beside what reading its JSON costs."""
    from relayline.adapters import jsoncodec
    from relayline.adapters.codecs import anthropic_messages_render, openai_chat, openai_chat_render

    body = {"model": "m", "temperature": 0.3, "max_tokens": 256, "stop": ["END"], "user": "u",
            "tools": [{"type": "function", "function": {"name": f"tool{i}", "description": "d",
                                                        "parameters": {"type": "object"}}} for i in range(4)],
            "messages": [{"role": "system", "content": "be brief"}]
            + [m for i in range(8) for m in (
                {"role": "user", "content": [{"type": "text", "text": "word " * 50},
                                             {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"c{i}", "type": "function", "function": {"name": "tool0", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "tool_call_id": f"c{i}", "content": "result"})]}
    raw = json.dumps(body).encode()

    def translate():
        request = openai_chat.parse_request(json.loads(raw))
        anthropic_messages_render.render_request(request, "claude", False)

    def passthrough():
        request = openai_chat.parse_request(json.loads(raw))
        openai_chat_render.render_request(request, "gpt", False)

    return {"translate_25_messages_us": per_call_us(translate, 2000),
            "passthrough_25_messages_us": per_call_us(passthrough, 2000),
            "json_loads_us": per_call_us(lambda: json.loads(raw), 2000),
            "orjson_loads_us": per_call_us(lambda: jsoncodec.loads(raw), 2000), "body_bytes": len(raw)}


def http_benchmarks(quick: bool) -> dict:
    from peers import Processes, raw_throughput, run_litellm, run_trio_side, summarise

    rounds, n = (1, 100) if quick else (3, 300)
    with Processes(hold_s=2.0) as procs:
        trio_side = run_trio_side(procs, rounds=rounds, n=n, throughput_rounds=1 if quick else 5)
        trio_side["throughput_raw"] = raw_throughput(procs, rounds=1 if quick else 3)
        lite = run_litellm(procs.upstream, rounds=rounds, n=n)
    if lite is None:
        print("LiteLLM is not installed (make bench installs the bench extra): its column is skipped")
    return summarise(trio_side, lite)


def print_http(h: dict) -> None:
    lat = h["latency_ms"]
    print("\nnon-streaming latency, concurrency 1 (ms; added = minus the direct call of the same loop)")
    print(f"{'method':<10} {'p50':>8} {'p99':>8} {'added p50':>10} {'added p99':>10} {'x direct':>9}")
    for name, row in lat.items():
        print(f"{name:<10} {row['p50']:>8.3f} {row['p99']:>8.3f} {row['added_p50']:>10.3f} {row['added_p99']:>10.3f} "
              f"{row['ratio_p50']:>9.2f}")
    if "litellm" in lat and lat["gateway"]["added_p50"] > 0:
        library = lat["library"]["added_p50"]
        # the library's own upstream client is cheaper than the direct httpx call: its added p50 can be
        # below zero, where a ratio means nothing
        of_library = f"{lat['litellm']['added_p50'] / library:.1f}x the library's" if library > 0 else \
            f"the library adds nothing over the direct call ({library:+.3f} ms)"
        print(f"LiteLLM adds {lat['litellm']['added_p50'] / lat['gateway']['added_p50']:.1f}x the gateway's p50; {of_library}")
    print("\nthroughput (requests/s; medians of alternated rounds, bench/peers.py)")
    for c, row in h["throughput_rps"].items():
        print(f"  concurrency {c:>3}: " + ", ".join(f"{k} {v:,.0f}" for k, v in row.items()))
        cpu = h.get("throughput_client_cpu_ms", {}).get(c)
        if cpu:
            print("    the httpx client's own CPU per request: " + ", ".join(f"{k} {v:.2f} ms" for k, v in cpu.items()))
    for c, row in h.get("throughput_raw", {}).items():
        print(f"  concurrency {c:>3}, raw asyncio clients (bench/load.py's): " + ", ".join(
            f"{k} {v['rps']:,.0f} (client {v['client_cpu_ms_per_request']:.2f} ms a request)" for k, v in row.items()))
    print("\n200-frame streams (median; per frame = the slope from a 1-frame stream, minus direct's)")
    for name, row in h["stream"].items():
        print(f"  {name:<8} first byte {row['ttfb_ms']:.2f} ms (+{row['first_byte_added_ms']:.2f}), total "
              f"{row['total_ms']:.2f} ms, {row['per_frame_us']:.1f} µs per frame ({row['per_frame_added_us']:+.1f} "
              "over direct)")
    held = h["held"]
    print(f"\n{held['streams']} concurrent streams through the gateway: {held['ok']} ok, {held['errors']} errors; "
          f"gateway RSS {held['gateway_rss_before_kib'] / 1024:.0f} -> {held['gateway_rss_peak_kib'] / 1024:.0f} MiB "
          f"({held['gateway_kib_per_stream']:.1f} KiB per in-flight stream)")
    cpu = h["gateway_cpu"]
    print(f"\ngateway process CPU: {cpu['ms_per_request']:.2f} ms per non-streamed request "
          f"({cpu['ms_per_request_in_process_upstream']:.2f} ms with an in-process upstream: no HTTP call), "
          f"{cpu['us_per_frame']:.1f} µs per streamed frame (10 ms ticks: a rough figure)")
    print("\nthe performance targets")
    for t in h["targets"]:
        lite = f"; LiteLLM {t['litellm']:.3g} {t['unit']}" if t["litellm"] is not None else ""
        sign = ">=" if t["at_least"] else "<="
        print(f"  {t['target']}: {t['value']:.3g} {t['unit']} ({sign} {t['limit']:g}: "
              f"{'holds' if t['holds'] else 'does not hold'}){lite}")


def print_levers(levers: dict) -> None:
    print(f"\nstream pipeline per frame (SSE decode, parse, gate, render): {levers['per_frame_us']:.2f} µs")
    for key, value in levers.items():
        if key.startswith("per_frame_us_without_"):
            print(f"  without {key.removeprefix('per_frame_us_without_').replace('_', ' '):<16} {value:.2f} µs")


def main() -> int:
    quick = "--quick" in sys.argv
    results = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load_average_at_start": os.getloadavg(),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "engine": bench_engine(),
        "core_turn": bench_core_turn(),
        "catalog_plan": bench_catalog_plan(),
        "stream": bench_stream_frames(),
        "driver": bench_driver(),
        "wire": bench_wire(),
        "frame_levers": bench_frame_levers(),
        "trio_handoff": bench_trio_handoff(),
        "floor": floor.run(rounds=1 if quick else 3),
        "gateway_levers": gateway_cpu.run(rounds=4 if quick else 20, c16_rounds=1 if quick else 3),
        "workers": workers.run(seconds=2.0 if quick else 4.0, rounds=1 if quick else 3),
        "hosts": bench_hosts(quick),
        "http": http_benchmarks(quick),
        "fleet": fleet.run(),
        "ops": ops.run(rounds=2 if quick else 5),
    }
    e, c, s, d = results["engine"], results["core_turn"], results["stream"], results["driver"]
    rows = [
        ("spec table, 4 triggers", f"{e['table_4_triggers_us']:.2f} µs", "transitions, same 4 triggers",
         f"{e['transitions_4_triggers_us']:.2f} µs", f"{e['transitions_over_table']:.0f}x slower"),
        ("core turn (plan+walk+turn)", f"{c['core_turn_us']:.1f} µs", "bare call",
         f"{c['bare_call_us']:.3f} µs", "target <= 100 µs"),
        ("plan, 3-hop catalog chain", f"{results['catalog_plan']['catalog_plan_us']:.1f} µs",
         "plan, default domain (1 entry)", f"{results['catalog_plan']['default_plan_us']:.1f} µs", ""),
        ("gate per frame after commit", f"{s['per_frame_after_commit_us']:.2f} µs", "bare loop per frame",
         f"{s['bare_loop_per_frame_us']:.3f} µs", "target <= 5 µs"),
        ("library complete() on sim", f"{d['library_complete_turn_us']:.0f} µs", "trio checkpoint",
         f"{d['trio_checkpoint_us']:.1f} µs", ""),
        ("wire: read + translate", f"{results['wire']['translate_25_messages_us']:.0f} µs",
         f"json.loads ({results['wire']['body_bytes']} B)", f"{results['wire']['json_loads_us']:.0f} µs",
         f"same family {results['wire']['passthrough_25_messages_us']:.0f} µs"),
    ]
    print(f"{'measure':<30} {'relayline':>12}   {'baseline':<30} {'value':>10}   note")
    for name, value, base_name, base_value, note in rows:
        print(f"{name:<30} {value:>12}   {base_name:<30} {base_value:>10}   {note}")
    print_levers(results["frame_levers"])
    t = results["trio_handoff"]
    print(f"trio hand-off per item: unbuffered channel {t['unbuffered_channel_item_us']:.1f} µs, buffered "
          f"{t['buffered_channel_item_us']:.1f} µs, the library's batches (100 a read) "
          f"{t['batched_handoff_item_us']:.2f} µs; a bare checkpoint {t['checkpoint_us']:.1f} µs")
    floor.report(results["floor"])
    gateway_cpu.report(results["gateway_levers"])
    workers.report(results["workers"])
    print_hosts(results["hosts"])
    print_http(results["http"])
    fleet.report(results["fleet"])
    ops.report(results["ops"])
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"{dt.date.today().isoformat()}.json"
    results["load_average_at_end"] = os.getloadavg()
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

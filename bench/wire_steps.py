"""The wire around the turn, step by step: instructions (or µs) a non-streamed OpenAI request
spends in each of the gateway's steps that read and write bytes (never part of `make test`).

bench/core_steps.py measures the turn's pure steps and bench/gateway_phases.py every step in a
serving process, where at a load average of 6 one step's µs moves by half between two runs of the
same code. Here each wire step runs alone in a loop, as the gateway calls it, on bench/load.py's
request and bench/upstream.py's answer: the server's read of the request by llhttp (its callbacks),
the body's JSON (and a 40-turn conversation's), its parse into wire.Request (the headers the dialect reads decoded), the upstream
request built and rendered, the upstream answer read by llhttp (bench/upstream.py's two-header head,
and a provider's 23-header one) and decoded, the answer head rendered, and the whole answer written
through the ASGI path (its JSON, relayline field, attribution and dropped-parameters headers, the
access wrapper and the server's head, into a connection that keeps the bytes). `--instructions`
counts each step's instructions under valgrind's cachegrind: a run of `--count` requests against one
of none, their difference over the requests (deterministic, whatever the load); otherwise µs a step,
the least of ROUNDS rounds in each of `--pairs` children a tree, the trees alternated. `--base DIR`
(and `--after DIR`) measure two trees, a lever's before and after, in one run.

    python bench/wire_steps.py [--instructions [--requests 2000]] [--steps NAME ...] [--base DIR [--after DIR]] [--pairs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from common import tree_env

HERE = Path(__file__).resolve().parent
ROUNDS = 5
COUNT = 2000  # --instructions: requests a step runs in its counted run
STEPS = ("server: request read by llhttp", "request body: JSON read", "request body: JSON read, 40 earlier turns",
         "request parse into wire.Request",
         "upstream request: built", "upstream request: rendered", "upstream answer read by llhttp",
         "upstream answer read by llhttp, a provider's 23-header head", "upstream answer: decoded", "server: answer head rendered", "answer: written whole (ASGI path)")


def _steps() -> dict:
    """Each step as a call, on one request's inputs, made once here."""
    from common import MESSAGES, raw_post
    from upstream import body_for

    from relayline.adapters import jsoncodec
    from relayline.adapters.codecs import dialects
    from relayline.adapters.gateway import Gateway, app, http11
    from relayline.adapters.providers import http, upstream
    from relayline.adapters.relay import Relay
    from relayline.machines.config import parse_config

    wire = raw_post("http://127.0.0.1:8080/v1/chat/completions", {"model": "frames-1", "messages": MESSAGES})
    raw = wire.partition(b"\r\n\r\n")[2]
    # a conversation's body (6.6 KB): what a chat client sends once it has some history
    turns = [{"role": ("user", "assistant")[i % 2], "content": f"a turn of the conversation so far, number {i}, "
              "with about as much text in it as a short chat message has, give or take a few words"}
             for i in range(40)]
    history = json.dumps({"model": "frames-1", "messages": [*turns, *MESSAGES]}).encode()
    answer = body_for("frames", 1, False)
    answer_wire = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(answer), answer)
    # the head of an answer as OpenAI's API sends it (bench/upstream.py sends two headers)
    provider_wire = b"".join([
        b"HTTP/1.1 200 OK\r\ndate: Mon, 30 Nov 2026 22:00:00 GMT\r\ncontent-type: application/json\r\n",
        b"content-length: %d\r\nconnection: keep-alive\r\naccess-control-expose-headers: X-Request-ID\r\n" % len(answer),
        b"openai-organization: org-abc\r\nopenai-processing-ms: 312\r\nopenai-project: proj_abc\r\n",
        b"openai-version: 2020-10-01\r\nx-envoy-upstream-service-time: 318\r\nx-ratelimit-limit-requests: 10000\r\n",
        b"x-ratelimit-limit-tokens: 30000000\r\nx-ratelimit-remaining-requests: 9999\r\n",
        b"x-ratelimit-remaining-tokens: 29999990\r\nx-ratelimit-reset-requests: 6ms\r\nx-ratelimit-reset-tokens: 0s\r\n",
        b"x-request-id: req_0123456789abcdef\r\nstrict-transport-security: max-age=31536000\r\n",
        b"cf-cache-status: DYNAMIC\r\nx-content-type-options: nosniff\r\nserver: cloudflare\r\n",
        b"cf-ray: 8f0000000000-AMS\r\nalt-svc: h3=\":443\"; ma=86400\r\n\r\n", answer])
    relay = Relay(parse_config('active = "bench.upstream"\n[providers."bench.upstream"]\nfamily = "openai"\n'
                               'base_url = "http://127.0.0.1:9/v1"\napi_key = "bench-key"\n'), env={})
    gateway = Gateway(relay)
    dialect = dialects.OPENAI
    protocol = relay.clients["openai"].protocol

    reader = http11._Reader(8192)

    def server_read():
        reader.feed(wire)
        while reader.pending():
            reader.take()

    reader.feed(wire)
    head_headers = reader.take().headers
    while reader.pending():
        reader.take()
    # the headers the dialect reads, decoded as the app decodes them: the names an entry may be
    # sent (`travelling_headers`), or those of the prefixes of a tree before it (`_TRAVELLING`);
    # a tree before either lever decoded them all
    names = app.travelling_headers(relay.config) if hasattr(app, "travelling_headers") else None
    prefixes = getattr(app, "_TRAVELLING", None)

    def parse():
        if names is not None:
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in head_headers if k in names]
        elif prefixes is not None:
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in head_headers if k.startswith(prefixes)]
        else:
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in head_headers]
        return dialect.parse(jsoncodec.loads(raw), headers)

    request = parse()
    run = relay.turns.new_run(request, model=request.model, stream=False, gateway=True)
    call_request = run._request(run.turn.start(1.0))
    built = protocol.build(call_request)
    built.headers["x-request-id"] = "0123456789abcdef0123456789abcdef"  # (as the exchange adds it)

    def build():
        upstream_request = protocol.build(call_request)
        upstream_request.headers["x-request-id"] = "0123456789abcdef0123456789abcdef"
        return upstream_request

    connection = upstream.Connection(upstream.Origin("http", "127.0.0.1", 9), None, -1)

    def upstream_read(wire: bytes = answer_wire):
        connection._begin_exchange()
        connection._feed(wire)

    completion = http.decode_completion(protocol, answer)
    result = run.turn.on_completion(completion, 1.01).result
    answer_headers = [(b"content-type", b"application/json"), *gateway._attribution(result),
                      (b"x-request-id", b"0123456789abcdef0123456789abcdef"), (b"date", http11._date()),
                      (b"content-length", b"%d" % len(answer))]

    class Server:
        draining = False

    class Kept(http11._Connection):
        async def _write(self, data: bytes) -> None:
            self.kept = data

    kept = Kept.__new__(Kept)
    kept.server = Server()

    def answer_written():
        kept.keep_alive, kept.method, kept.pending_head, kept.sent_head = True, "POST", None, False
        kept.response_done, kept.gone, kept.remaining, kept.framing = False, False, 0, ""
        exchange = app.Exchange.__new__(app.Exchange)  # (its __init__ reads trio's clock: none here)
        exchange.send, exchange.request_id, exchange.unread_body = kept._send, "0123456789abcdef0123456789abcdef", False
        exchange.first_byte, exchange.sent, exchange.status = 0.0, 0, None
        body = dialect.completion("chatcmpl-bench", result, gateway._relayline_field(result))
        written = gateway._json(exchange, 200, body,
                                headers=gateway._attribution(result) + app.dropped_header(request, result.served))
        try:
            written.send(None)  # (nothing in it waits: the connection keeps the bytes)
        except StopIteration:
            pass

    answer_written()
    assert kept.kept.startswith(b"HTTP/1.1 200 OK\r\n"), kept.kept[:40]
    return dict(zip(STEPS, (server_read, lambda: jsoncodec.loads(raw), lambda: jsoncodec.loads(history), parse, build, lambda: upstream.render(built),
                            upstream_read, lambda: upstream_read(provider_wire),
                            lambda: http.decode_completion(protocol, answer),
                            lambda: http11._render_head(200, answer_headers), answer_written), strict=True))


def timed(names: list[str], n: int) -> dict:
    steps = _steps()
    out = {}
    for name in names:
        step = steps[name]
        best = float("inf")
        for _ in range(ROUNDS):
            start = time.perf_counter_ns()
            for _ in range(n):
                step()
            best = min(best, (time.perf_counter_ns() - start) / n / 1e3)
        out[name] = best
    return out


def counted(name: str | None, n: int) -> None:
    steps = _steps()
    if name is not None:
        step = steps[name]
        for _ in range(n):
            step()


def _refs(tree: str | None, step: str | None, n: int) -> int:
    args = ["--count", str(n)] + (["--step", step] if step else [])
    done = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                           sys.executable, __file__, *args], env={**tree_env(tree), "PYTHONHASHSEED": "0"},
                          capture_output=True, text=True, timeout=1800)
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(done.stderr[-2000:])
    return int(found.group(1).replace(",", ""))


def instructions(trees: dict[str, str | None], names: list[str], count: int = COUNT) -> dict:
    out: dict = {label: {} for label in trees}
    for label, tree in trees.items():
        none = _refs(tree, None, 0)  # start-up and the inputs made, nothing run
        for name in names:
            out[label][name] = (_refs(tree, name, count) - none) / count
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="the package directory of the tree before the lever")
    parser.add_argument("--after", help="the tree after it (default: this one)")
    parser.add_argument("--instructions", action="store_true", help="instructions a step (cachegrind)")
    parser.add_argument("--steps", nargs="*", help="only these steps (their names, or a word of them)")
    parser.add_argument("--n", type=int, default=5000, help="calls of a step a round (µs)")
    parser.add_argument("--pairs", type=int, default=3, help="children a tree, alternated (µs)")
    parser.add_argument("--out", help="write the figures here (JSON)")
    parser.add_argument("--requests", type=int, default=COUNT,
                        help="--instructions: requests a step runs in its counted run (the start-up's own "
                             "variation, a few million instructions, is divided by it)")
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--timed", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    if args.count is not None:
        counted(args.step, args.count)
        return 0
    if args.timed is not None:
        print(json.dumps(timed(args.timed, args.n)))
        return 0
    names = [s for s in STEPS if not args.steps or any(word in s for word in args.steps)]
    trees = {"before": args.base, "after": args.after} if args.base else {"this tree": None}
    if args.instructions:
        out = instructions(trees, names, args.requests)
        unit = "instructions"
    else:
        # each tree's child `--pairs` times, the order turned each pair; a step's figure is its
        # least over them (a loaded machine's noise only adds)
        out = {label: {} for label in trees}
        for pair in range(args.pairs):
            for label, tree in (list(trees.items()) if pair % 2 == 0 else list(trees.items())[::-1]):
                done = subprocess.run([sys.executable, __file__, "--n", str(args.n), "--timed", *names],
                                      env=tree_env(tree), capture_output=True, text=True, timeout=1800)
                if done.returncode != 0:
                    raise SystemExit(done.stderr[-2000:])
                for name, us in json.loads(done.stdout.strip().splitlines()[-1]).items():
                    out[label][name] = min(us, out[label].get(name, us))
        unit = "µs"
    print("  " + "".join(f"{label:>14}" for label in trees) + f"  ({unit} a request)")
    for name in names:
        print("  " + "".join(f"{out[label][name]:14,.1f}" for label in trees) + f"  {name}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

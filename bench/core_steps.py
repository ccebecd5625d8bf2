"""The turn's pure steps of a non-streamed OpenAI request, each in a loop of its own (never part
of `make test`): µs a step, two trees alternated.

bench/gateway_phases.py clocks the same steps in a serving process, where each runs with caches
cold from the step before and a loaded machine preempts some of them: there a lever worth 2 µs
is within one run's noise. Here each step runs on a warm cache, without sockets or trio, as the
gateway calls it (the bench's request body and upstream answer, an openai-family profile): the
request's JSON and its parse, the turn made (plan, turn machine, run), the turn started, the
upstream request built and rendered, the upstream answer decoded, the turn's on_completion, and
the answer (its relayline field, attribution and dropped-parameters headers, body and JSON). A
row is the least of ROUNDS rounds (machine noise only adds), then the median over the pairs.
`--base DIR` names a checkout of the code before a lever (bench/common.py's `tree_env`).

    python bench/core_steps.py [--base DIR [--after DIR]] [--pairs 5] [--n 5000]
    python bench/core_steps.py --instructions [--base DIR [--after DIR]]
    python bench/core_steps.py --instructions --turn [--base DIR [--after DIR]]

A step worth a µs moves less than a loaded machine's noise even here; `--instructions` counts
the instructions of all the steps a request under valgrind's cachegrind (two runs COUNTS apart
per tree, their difference over the requests between: deterministic, whatever the load); with
`--turn`, those of the turn machine's three steps apart (made, started, told the answer: a
request parsed and an answer decoded once, then each step's count the difference of two runs
that go up to it and to the step before).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from common import alternate, per_run_instructions, tree_arguments, tree_env

HERE = Path(__file__).resolve().parent
ROUNDS = 3
COUNTS = (200, 1200)  # --instructions: requests in the two cachegrind runs of a tree
STEPS = ("request: JSON read and parse", "turn made (plan, machine, run)", "turn started",
         "upstream request: built", "upstream request: rendered", "upstream answer: decoded",
         "turn: on_completion", "answer: field, headers, body, JSON")


TURN_STEPS = ("turn made (plan, machine, run)", "turn started", "turn: on_completion")


def _relay_and_bodies():
    """The bench's relay (an openai-family profile), request body and upstream answer."""
    from common import MESSAGES
    from upstream import body_for

    from relayline.adapters.relay import Relay
    from relayline.machines.config import parse_config

    raw = json.dumps({"model": "frames-1", "messages": MESSAGES}).encode()
    relay = Relay(parse_config('active = "bench.upstream"\n[providers."bench.upstream"]\nfamily = "openai"\n'
                               'base_url = "http://127.0.0.1:9/v1"\napi_key = "bench-key"\n'), env={})
    return relay, raw, body_for("frames", 1, False)


def _request_path():
    """The steps, as one call a request, and the dict of ns each step spent."""
    from relayline.adapters import jsoncodec
    from relayline.adapters.codecs import dialects
    from relayline.adapters.gateway.bookkeeping import attribution, dropped_header, relayline_field
    from relayline.adapters.providers import http, upstream
    from relayline.adapters.relay import turns_of

    relay, raw, answer = _relay_and_bodies()
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
               (b"content-length", str(len(raw)).encode()), (b"user-agent", b"bench")]
    dialect = dialects.OPENAI
    protocol = relay.clients["openai"].protocol
    spent = dict.fromkeys(STEPS, 0)

    def one() -> None:
        clock = time.perf_counter_ns
        a = clock()
        request = dialect.parse(jsoncodec.loads(raw), [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers])
        b = clock()
        run = turns_of(relay).new_run(request, model=request.model, stream=False, gateway=True)
        c = clock()
        call = run.turn.start(1.0)
        d = clock()
        built = protocol.build(run._request(call))
        e = clock()
        upstream.render(built)
        f = clock()
        completion = http.decode_completion(protocol, answer)
        g = clock()
        result = run.turn.on_completion(completion, 1.01).result
        h = clock()
        body = dialect.completion("chatcmpl-bench", result, relayline_field(result))
        attribution(result) + dropped_header(request, result.served)
        jsoncodec.dumps(body)
        i = clock()
        for step, took in zip(STEPS, (b - a, c - b, d - c, e - d, f - e, g - f, h - g, i - h), strict=True):
            spent[step] += took

    return one, spent


def child(n: int) -> dict:
    one, spent = _request_path()
    for _ in range(n):  # warm
        one()
    best = dict.fromkeys(STEPS, float("inf"))
    for _ in range(ROUNDS):
        spent.update(dict.fromkeys(STEPS, 0))
        for _ in range(n):
            one()
        for step in STEPS:
            best[step] = min(best[step], spent[step] / n / 1e3)
    return best


def counted(n: int) -> None:
    """`n` requests' steps and nothing else (run under cachegrind by `instructions`)."""
    one, _ = _request_path()
    for _ in range(n):
        one()


def turn_counted(n: int, upto: int) -> None:
    """`n` turns up to and including TURN_STEPS[upto] (`--turn`): the request parsed and the
    answer decoded once, outside the count's difference."""
    from relayline.adapters import jsoncodec
    from relayline.adapters.codecs import dialects
    from relayline.adapters.providers import http
    from relayline.adapters.relay import turns_of

    relay, raw, answer = _relay_and_bodies()
    request = dialects.OPENAI.parse(jsoncodec.loads(raw), [])
    completion = http.decode_completion(relay.clients["openai"].protocol, answer)
    for _ in range(n):
        run = turns_of(relay).new_run(request, model=request.model, stream=False, gateway=True)
        if upto >= 1:
            run.turn.start(1.0)
        if upto >= 2:
            run.turn.on_completion(completion, 1.01)


def turn_instructions(trees: dict[str, str | None]) -> dict[str, dict[str, float]]:
    out = {}
    for label, tree in trees.items():
        env = {**tree_env(tree), "PYTHONHASHSEED": "0"}
        upto = [per_run_instructions([__file__, "--turn-upto", str(i), "--count"], env, COUNTS, label)
                for i in range(len(TURN_STEPS))]
        out[label] = {step: upto[i] - (upto[i - 1] if i else 0) for i, step in enumerate(TURN_STEPS)}
        print(f"  {label:<8} " + ", ".join(f"{step} {n:,.0f}" for step, n in out[label].items()), flush=True)
    return out


def instructions(trees: dict[str, str | None]) -> dict[str, float]:
    out = {}
    for label, tree in trees.items():
        out[label] = per_run_instructions([__file__, "--count"], {**tree_env(tree), "PYTHONHASHSEED": "0"},
                                          COUNTS, label)
        print(f"  {label:<8} {out[label]:10,.0f} instructions a request, all the steps", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tree_arguments(parser, pairs=5)
    parser.add_argument("--n", type=int, default=5000, help="requests per round (ROUNDS rounds per child)")
    parser.add_argument("--out", help="write the figures here (JSON)")
    parser.add_argument("--instructions", action="store_true", help="instructions a request (cachegrind)")
    parser.add_argument("--turn", action="store_true", help="with --instructions: the turn machine's steps apart")
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--turn-upto", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child or args.count:
        sys.path.insert(0, str(HERE))
        if args.count and args.turn_upto is not None:
            turn_counted(args.count, args.turn_upto)
        elif args.count:
            counted(args.count)
        else:
            print(json.dumps(child(args.n)))
        return 0
    if args.instructions:
        trees = {"before": args.base, "after": args.after} if args.base else {"this tree": None}
        out = turn_instructions(trees) if args.turn else instructions(trees)
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        return 0
    sides = alternate(__file__, args, ["--n", str(args.n)], timeout_s=600)
    medians = {side: {step: statistics.median(run[step] for run in runs) for step in STEPS}
               for side, runs in sides.items()}
    print(f"µs a step, each in a loop of its own (least of {ROUNDS} rounds of {args.n}), medians of {args.pairs} "
          "children a tree")
    print("  " + "".join(f"{side:>9}" for side in medians))
    for step in STEPS:
        print("  " + "".join(f"{medians[side][step]:9.2f}" for side in medians) + f"  {step}")
    print("  " + "".join(f"{sum(medians[side].values()):9.2f}" for side in medians) + "  all of them")
    if args.out:
        Path(args.out).write_text(json.dumps({"medians": medians, "runs": sides}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

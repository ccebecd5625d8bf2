"""What a coding agent's request costs: a long history, tools, long tool results (never part of
`make test`).

An agent sends its whole conversation on every turn: here 100 messages (about 200 KB) and 200
messages (about 400 KB), 30 tool definitions, every other message a tool result of a few KB
(source text: quotes, backslashes, newlines, some non-ASCII). The same conversation is written
in both client dialects and sent to two `relayline serve` processes in the default
configuration (info logging, the SQLite ledger on), one whose active profile is `openai`, one
`anthropic`, both in front of bench/upstream.py: each dialect reaches its own family (same
dialect) and the other (translated). A one-message request without tools rides along as the small figure.

The figure is the gateway's CPU a request (its threads' own count in /proc, summed over the
round's requests at concurrency 1, a raw asyncio client) over the cost of `orjson.loads` plus `orjson.dumps` of the
same body, timed in this process in the same round: the least any proxy that reads and writes
the body pays. The library's `complete` is measured likewise, in this process (its CPU a call,
its HTTP client included), on the OpenAI-style messages it takes, towards either family.
Beside them, where installed, Portkey's gateway (bench/peers.py: PORTKEY_GATEWAY_DIR) serves the
OpenAI dialect towards both families, its Node process's CPU a request counted the same way.
Rounds interleave everything; a row is the median of its rounds' figures.

With `--base DIR` the gateways of another tree (a checkout before a lever) serve the same rounds
("before->openai" beside "gateway->openai").

Run: python bench/agent_history.py [--rounds 5] [--requests 20] [--base DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import back_to_back, listening_logged, stop, threads_cpu_s, tree_env  # noqa: E402

FAMILIES = ("openai", "anthropic")
DIALECT_PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages"}
TOOLS = 30


# -- the conversation ----------------------------------------------------------------------------


def _source_text(rng: random.Random, size: int) -> str:
    """A tool's long result: lines of code-like text, about `size` characters."""
    words = ["def", "return", "self", "value", "config", "async", "await", "for", "in", "if", "else", "None",
             "\"quoted\"", "'x'", "path\\to\\file", "{key: 1}", "[0, 1]", "naïve", "→", "# comment", "λ", "=="]
    lines, total = [], 0
    while total < size:
        line = "    " * rng.randrange(4) + " ".join(rng.choice(words) for _ in range(rng.randrange(3, 12)))
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines)


def _tool_schema(i: int) -> dict:
    return {"type": "object", "properties": {
        "path": {"type": "string", "description": f"The file tool {i} reads or writes, relative to the root."},
        "pattern": {"type": "string", "description": "A regular expression, matched line by line."},
        "limit": {"type": "integer", "minimum": 1, "maximum": 2000, "description": "At most this many lines."},
        "flags": {"type": "array", "items": {"type": "string", "enum": ["i", "m", "s"]}}},
        "required": ["path"], "additionalProperties": False}


def conversation(messages: int, result_chars: int, seed: int = 35) -> list[dict]:
    """Turns in a neutral shape: system, user, then (assistant tool call, tool result) pairs with
    now and then an assistant's text and a user's follow-up; `messages` after the system."""
    rng = random.Random(seed)
    turns: list[dict] = [{"kind": "system", "text": "You are a coding agent. " * 40},
                         {"kind": "user", "text": "Fix the failing test in the parser, then run the suite."}]
    call = 0
    while len(turns) < messages + 1:
        if call % 7 == 6:
            turns.append({"kind": "assistant_text", "text": _source_text(rng, 600)})
            turns.append({"kind": "user", "text": "Go on, and keep the public API as it is."})
        else:
            name = f"tool_{call % TOOLS}"
            arguments = {"path": f"src/module_{call}.py", "pattern": "def .*\\(", "limit": 400}
            turns.append({"kind": "call", "id": f"call_{call:04d}", "name": name, "arguments": arguments,
                          "text": "Reading it." if call % 3 == 0 else ""})
            turns.append({"kind": "result", "id": f"call_{call:04d}", "text": _source_text(rng, result_chars)})
        call += 1
    return turns[:messages + 1]


def openai_body(turns: list[dict], model: str) -> dict:
    out: list[dict] = []
    for turn in turns:
        kind = turn["kind"]
        if kind in ("system", "user"):
            out.append({"role": kind, "content": turn["text"]})
        elif kind == "assistant_text":
            out.append({"role": "assistant", "content": turn["text"]})
        elif kind == "call":
            out.append({"role": "assistant", "content": turn["text"] or None, "tool_calls": [
                {"id": turn["id"], "type": "function",
                 "function": {"name": turn["name"], "arguments": json.dumps(turn["arguments"])}}]})
        else:
            out.append({"role": "tool", "tool_call_id": turn["id"], "content": turn["text"]})
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool {i}: " + "does a thing. " * 8,
                                               "parameters": _tool_schema(i)}} for i in range(TOOLS)]
    return {"model": model, "messages": out, "max_tokens": 1024, **({"tools": tools} if len(turns) > 1 else {})}


def anthropic_body(turns: list[dict], model: str) -> dict:
    out: list[dict] = []
    system = ""
    for turn in turns:
        kind = turn["kind"]
        if kind == "system":
            system = turn["text"]
        elif kind == "user":
            out.append({"role": "user", "content": turn["text"]})
        elif kind == "assistant_text":
            out.append({"role": "assistant", "content": [{"type": "text", "text": turn["text"]}]})
        elif kind == "call":
            blocks = [{"type": "text", "text": turn["text"]}] if turn["text"] else []
            blocks.append({"type": "tool_use", "id": turn["id"], "name": turn["name"], "input": turn["arguments"]})
            out.append({"role": "assistant", "content": blocks})
        else:
            out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": turn["id"],
                                                      "content": turn["text"]}]})
    tools = [{"name": f"tool_{i}", "description": f"Tool {i}: " + "does a thing. " * 8, "input_schema": _tool_schema(i)}
             for i in range(TOOLS)]
    body = {"model": model, "messages": out, "max_tokens": 1024}
    return {**body, "system": system, "tools": tools} if len(turns) > 1 else body


SHAPES = {"small": (1, 0), "200 KB": (100, 3800), "400 KB": (200, 3800)}


def bodies() -> dict[tuple[str, str], bytes]:
    """(shape, dialect) -> the request body's bytes."""
    out = {}
    for shape, (messages, chars) in SHAPES.items():
        turns = conversation(messages, chars) if messages > 1 else [{"kind": "user", "text": "hi"}]
        out[(shape, "openai")] = orjson.dumps(openai_body(turns, "frames-1"))
        out[(shape, "anthropic")] = orjson.dumps(anthropic_body(turns, "frames-1"))
    return out


# -- the processes -------------------------------------------------------------------------------


def start_gateways(upstream: str, tmp: str, tree: str | None = None, name: str = "gateway"
                   ) -> dict[str, tuple[subprocess.Popen, str]]:
    """"name->family" -> (process, base URL): `relayline serve` of `tree` (None: this one) as a
    user runs it (info logging, to a file)."""
    out = {}
    for family in FAMILIES:
        base = f"{upstream}/v1" if family == "openai" else upstream
        config = Path(tmp) / f"{name}-{family}.toml"
        config.write_text(f'active = "bench.{family}"\n[ledger]\npath = "{tmp}/{name}-{family}.sqlite3"\n'
                          f'[providers."bench.{family}"]\nfamily = "{family}"\nbase_url = "{base}"\n'
                          'api_key = "bench-key"\n')
        log = Path(tmp) / f"{name}-{family}.log"
        with log.open("w") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "relayline.adapters.cli", "serve", "--config", str(config),
                                     "--port", "0"], stderr=sink, env=tree_env(tree))
        url = listening_logged(proc, log, f"the {family} gateway")
        out[f"{name}->{family}"] = (proc, url)
    return out


def _request(url: str, path: str, body: bytes, extra: str = "") -> bytes:
    host = url.removeprefix("http://")
    return (f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n{extra}"
            f"authorization: Bearer bench-key\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


def gateway_cpu_ms(proc: subprocess.Popen, url: str, path: str, body: bytes, n: int, extra: str = "") -> float:
    request = _request(url, path, body, extra)
    before = threads_cpu_s(proc.pid)
    asyncio.run(back_to_back(url, request, n))
    return (threads_cpu_s(proc.pid) - before) / n * 1e3


def orjson_ms(body: bytes, n: int) -> float:
    """orjson.loads + orjson.dumps of the body: this process's CPU a call."""
    start = time.process_time()
    for _ in range(n):
        orjson.dumps(orjson.loads(body))
    return (time.process_time() - start) / n * 1e3


def library_cpu_ms(relays: dict, body: bytes, family: str, n: int) -> float:
    """`Relay.complete` on the OpenAI-style messages and tools of `body`, towards `family`."""
    import trio

    parsed = orjson.loads(body)
    relay = relays[family]

    async def calls() -> None:
        for _ in range(n):
            await relay.complete(parsed["messages"], tools=parsed["tools"] if "tools" in parsed else (),
                                 model="frames-1", max_tokens=1024)

    start = time.process_time()
    trio.run(calls)
    return (time.process_time() - start) / n * 1e3


class _Holder:
    """What start_portkey (bench/peers.py) appends its process to."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []


# -- the run -------------------------------------------------------------------------------------


def profile(gateways: dict, cases: dict, case: str, path: str, seconds: float = 15.0) -> None:
    """py-spy on the gateway serving one case ("200 KB|openai|openai": shape, client dialect,
    family) for `seconds`: collapsed stacks, to add up with bench/stacks.py."""
    shape, dialect, family = case.split("|")
    proc, url = gateways[f"gateway->{family}"]
    spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(proc.pid), "--format",
                            "raw", "--duration", str(int(seconds)), "--rate", "500", "--nonblocking", "-o", path],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and spy.poll() is None:
        gateway_cpu_ms(proc, url, DIALECT_PATHS[dialect], cases[(shape, dialect)], 20)
    spy.wait(seconds + 30)


def portkey_headers(upstream: str, family: str) -> str:
    return f"x-portkey-provider: {family}\r\nx-portkey-custom-host: {upstream}/v1\r\n"


def run(rounds: int, n: int, library: bool, profile_case: str | None = None, profile_path: str = "",
        base: str | None = None) -> dict:
    from peers import portkey_dir, start_portkey

    from relayline.adapters import Relay

    tmp = tempfile.TemporaryDirectory()
    up = subprocess.Popen([sys.executable, str(HERE / "upstream.py"), "0"], stdout=subprocess.PIPE, text=True)
    procs: list[subprocess.Popen] = [up]
    samples: dict[str, list[float]] = {}
    try:
        upstream = f"http://127.0.0.1:{up.stdout.readline().split()[1]}"
        gateways = start_gateways(upstream, tmp.name)
        if base:
            gateways.update(start_gateways(upstream, tmp.name, base, "before"))
        procs += [proc for proc, _url in gateways.values()]
        portkey = None
        if portkey_dir() is not None:
            holder = _Holder()
            url, _pid = start_portkey(holder, portkey_dir())
            procs += holder.procs
            portkey = (holder.procs[0], url)
        relays = {}
        for family in FAMILIES:
            base = f"{upstream}/v1" if family == "openai" else upstream
            relays[family] = Relay.from_toml(
                f'active = "lib.{family}"\n[ledger]\npath = "{tmp.name}/lib-{family}.sqlite3"\n'
                f'[providers."lib.{family}"]\nfamily = "{family}"\nbase_url = "{base}"\napi_key = "bench-key"\n',
                env={})
        cases = bodies()
        for (_shape, dialect), body in cases.items():  # warm: imports, caches, connections
            for proc, url in gateways.values():
                gateway_cpu_ms(proc, url, DIALECT_PATHS[dialect], body, 3)
            if library and dialect == "openai":
                for family in FAMILIES:
                    library_cpu_ms(relays, body, family, 2)
            if portkey is not None and dialect == "openai":
                for family in FAMILIES:
                    gateway_cpu_ms(*portkey, DIALECT_PATHS[dialect], body, 3, portkey_headers(upstream, family))
        if profile_case:
            profile(gateways, cases, profile_case, profile_path)
        for round_ in range(rounds):
            order = list(cases.items()) if round_ % 2 == 0 else list(cases.items())[::-1]
            for (shape, dialect), body in order:
                count = n * 5 if shape == "small" else n
                samples.setdefault(f"{shape}|{dialect}|orjson", []).append(orjson_ms(body, count))
                for through in (list(gateways) if round_ % 2 == 0 else list(gateways)[::-1]):
                    proc, url = gateways[through]
                    samples.setdefault(f"{shape}|{dialect}|{through}", []).append(
                        gateway_cpu_ms(proc, url, DIALECT_PATHS[dialect], body, count))
                for family in (FAMILIES if round_ % 2 == 0 else FAMILIES[::-1]):
                    if library and dialect == "openai":
                        samples.setdefault(f"{shape}|library|library->{family}", []).append(
                            library_cpu_ms(relays, body, family, count))
                    if portkey is not None and dialect == "openai":
                        samples.setdefault(f"{shape}|openai|portkey->{family}", []).append(gateway_cpu_ms(
                            *portkey, DIALECT_PATHS[dialect], body, count, portkey_headers(upstream, family)))
            print(f"  round {round_ + 1} of {rounds} (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        stop(procs)
        tmp.cleanup()
    return {"sizes_kb": {f"{shape}|{dialect}": round(len(body) / 1024, 1) for (shape, dialect), body in cases.items()},
            "samples_ms": samples}


def summarise(result: dict) -> list[dict]:
    """One row per (shape, client, target): CPU a request, orjson's, their ratio (the median of
    each round's own ratio), the target and whether it holds."""
    samples = result["samples_ms"]
    rows = []
    for key, values in samples.items():
        shape, dialect, who = key.split("|")
        if who == "orjson":
            continue
        base = samples[f"{shape}|{'openai' if dialect == 'library' else dialect}|orjson"]
        family = who.split("->")[1]
        same = family == ("openai" if dialect == "library" else dialect)
        limit = 2.0 if same else 4.0
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        rows.append({"shape": shape, "client": dialect, "through": who, "same_dialect": same,
                     "cpu_ms": round(statistics.median(values), 3), "orjson_ms": round(statistics.median(base), 3),
                     "ratio": round(ratio, 2), "limit": limit, "holds": shape == "small" or ratio <= limit})
    return rows


def growth(rows: list[dict]) -> dict[str, float]:
    """Per path, what the 400 KB body costs beyond the 200 KB one over what orjson's read and
    write cost beyond it: below 1, the path grows slower than the body's own JSON."""
    keyed = {(r["shape"], r["client"], r["through"]): r for r in rows}
    out = {}
    for (shape, client, through), big in keyed.items():
        small = keyed.get(("200 KB", client, through))
        if shape == "400 KB" and small is not None and big["orjson_ms"] > small["orjson_ms"]:
            out[f"{client}|{through}"] = round((big["cpu_ms"] - small["cpu_ms"]) / (big["orjson_ms"] - small["orjson_ms"]), 2)
    return out


def report(rows: list[dict]) -> None:
    print(f"\n  {'shape':<8} {'client':<10} {'through':<20} {'CPU/req':>9} {'orjson':>8} {'ratio':>6} target")
    for row in rows:
        target = "" if row["shape"] == "small" else f"<= {row['limit']:.0f}x {'holds' if row['holds'] else 'NO'}"
        print(f"  {row['shape']:<8} {row['client']:<10} {row['through']:<20} {row['cpu_ms']:>7.3f}ms "
              f"{row['orjson_ms']:>6.3f}ms {row['ratio']:>6.2f} {target}")


def markdown(result: dict) -> str:
    """The rows as docs/performance.md's table: per shape and path, each system's CPU a
    request and its ratio to orjson's read and write of the same body."""
    rows = [r for r in result["rows"] if r["shape"] != "small"]
    systems = list(dict.fromkeys(r["through"].split("->")[0] for r in rows))
    out = ["| body | client -> family | target | orjson loads + dumps | " + " | ".join(systems) + " |",
           "| --- | --- | --- | --- | " + " | ".join("---" for _ in systems) + " |"]
    keyed = {(r["shape"], r["client"], r["through"]): r for r in rows}
    for shape in (s for s in SHAPES if s != "small"):
        for client in ("openai", "anthropic", "library"):
            for family in FAMILIES:
                cells = []
                for system in systems:
                    row = keyed.get((shape, client, f"{system}->{family}"))
                    cells.append(f"{row['cpu_ms']:.2f} ms ({row['ratio']:.1f}x)" if row else "")
                if not any(cells):
                    continue
                same = family == ("openai" if client == "library" else client)
                base = next(r for r in rows if r["shape"] == shape and r["client"] == client)["orjson_ms"]
                out.append(f"| {shape} | {client} -> {family} | {'<= 2x' if same else '<= 4x'} | {base:.2f} ms | "
                           + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20, help="requests a round for a long shape (x5 small)")
    parser.add_argument("--no-library", action="store_true", help="the gateway rows only")
    parser.add_argument("--base", help="also the gateways of this tree (a checkout before a lever), same rounds")
    parser.add_argument("--out", help="write the results here")
    parser.add_argument("--table", metavar="FILE", help="print a results file's rows as a markdown table, and exit")
    parser.add_argument("--profile", metavar="FILE", help="first py-spy the gateway serving --case into FILE "
                        "(collapsed stacks)")
    parser.add_argument("--case", default="200 KB|openai|openai", help="shape|client dialect|family to profile")
    args = parser.parse_args()
    if args.table:
        result = json.loads(Path(args.table).read_text())
        print(markdown(result))
        print("\n200 -> 400 KB, the added CPU over orjson's added cost: " + ", ".join(
            f"{path} {ratio:.2f}x" for path, ratio in growth(result["rows"]).items()))
        return
    result = {"date": dt.date.today().isoformat(), "python": platform.python_version(), "cpus": os.cpu_count(),
              "load_average_before": os.getloadavg()}
    result.update(run(args.rounds, args.requests, not args.no_library, args.profile and args.case, args.profile,
                      args.base))
    result["load_average_after"] = os.getloadavg()
    result["rows"] = summarise(result)
    result["growth"] = growth(result["rows"])
    report(result["rows"])
    print("\n  200 -> 400 KB, the added CPU over orjson's added cost: " + ", ".join(
        f"{path} {ratio:.2f}x" for path, ratio in result["growth"].items()))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""The gateway's answers, byte for byte, against another tree's (never part of `make test`): a
speed change must not change what a client gets or what the ledger bills.

Each case is a fresh gateway (sim profiles over real loopback HTTP in the openai and anthropic
shapes, each falling back to the other, a ledger file) driven by a raw socket with a seeded mix
of what reaches it: either dialect, streamed or not, unicode, NUL, huge and odd parameters,
unknown and wrongly typed ones, broken JSON, client headers that travel, drop_unsupported_params
and every notice mode; the upstream scripts answer, fail (503, 429, 400, 401), refuse, cut a
stream, send an in-band error or a malformed frame. `--turns` requests a case, on one gateway,
so cooldowns and breakers carry from one to the next. Kept per case: the whole answer (the
Date, the request id and the generated ids and timestamps masked; a chunked body de-chunked)
and the ledger's rows. The same cases run on both trees; any difference is printed.

    python bench/answers_diff.py --base DIR [--after DIR] [--cases 200] [--turns 2] [--seed 6]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import child_in_tree  # noqa: E402

REPLIES = [{"text": "hello world"}, {"text": "héllo ✓ 世界 \u2028 \"q\" \\ end"}, {"text": "r", "reasoning": "think hard"},
           {"tool_call": "lookup"}, {"empty": True}, {"status": 503}, {"status": 429, "retry_after": 1},
           {"status": 400, "error": "context_length_exceeded"}, {"status": 400, "error": "content_policy_violation"},
           {"status": 401, "error": "invalid_api_key"}, {"connect_error": True},
           {"text": "cut", "finish": "length"}, {"text": "", "finish": "content_filter"},
           {"text": "no", "finish": "content_filter"}, {"status": 200, "malformed_body": True},
           {"frames": [{"role": True}, {"text": "a "}, {"error": "overloaded_error"}]},
           {"frames": [{"role": True}, {"ping": True}, {"text": "x"}, {"eof": True}]},
           {"frames": [{"role": True}, {"error": "overloaded_error"}]},
           {"frames": [{"role": True}, {"malformed": True}]},
           {"frames": [{"role": True}, {"reasoning": "hm"}, {"text": "ok"}, {"usage": [5, 2]}, {"done": True}]},
           {"text": "with usage", "usage": [123, 45]}]
CONTENTS = ["hi", "héllo ✓ 世界", "", "a" * 3000, "\u0000nul", "emoji 😀 \ud83d\ude00", "line\nbreak\r\n", "\u2028"]
PARAMS = [{}, {"temperature": 0.2}, {"temperature": 2}, {"top_p": 1, "max_tokens": 5}, {"stop": ["x", "y"]},
          {"seed": 1}, {"user": "ü"}, {"temperature": None}, {"max_tokens": 10**12}, {"reasoning_effort": "low"},
          {"response_format": {"type": "json_object"}}, {"logprobs": True}, {"n": 2},
          {"unknown_param": {"a": [1, None]}}, {"tool_choice": "auto"}, {"metadata": {"user_id": "u1"}},
          {"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]},
          {"temperature": "hot"}, {"stream_options": {"include_usage": True}}, {"top_k": 3},
          {"stop_sequences": ["z"]}, {"thinking": {"type": "enabled", "budget_tokens": 1024}}]
CLIENT_HEADERS = [b"", b"openai-beta: assistants=v2\r\n", b"anthropic-beta: x\r\nanthropic-version: 2023-06-01\r\n",
                  b"x-relayline-model: m-main\r\n"]

_IDS = re.compile(rb'(chatcmpl-|msg_|toolu_|call_|req_)[A-Za-z0-9_-]+')
_CREATED = re.compile(rb'"created": ?\d+')
_MASKED = (b"date:", b"x-request-id:", b"content-length:")  # (a length moves with the masked ids)


def _masked(answer: bytes) -> str:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(_MASKED)]
    body = _CREATED.sub(b'"created":0', _IDS.sub(rb"\1ID", body))
    if b"transfer-encoding: chunked" in head.lower():  # (the chunk sizes move with the masked ids)
        whole, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            if int(size, 16) == 0:
                break
            whole, rest = whole + rest[:int(size, 16)], rest[int(size, 16) + 2:]
        body = whole
    return (b"\r\n".join(lines) + b"\r\n\r\n" + body).decode("utf-8", "backslashreplace")


def _exchange(port: int, path: bytes, body: bytes, extra: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        client.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n"
                       b"%scontent-length: %d\r\n\r\n" % (path, extra, len(body)) + body)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    return answer


def _case(rng: random.Random, turns: int) -> dict:
    shape = rng.choice(["openai", "anthropic"])
    other = "anthropic" if shape == "openai" else "openai"
    config = {"active": f"{shape}.main", "reliability": {"provider_retries": rng.choice([0, 1]), "backoff_ms": 1},
              "notices": {"model_fallback_notice": rng.choice(["off", "redacted", "detailed"])},
              # an unknown model ("nope") is refused with a 404 or served by the default profile
              "gateway": {"drop_unsupported_params": rng.random() < 0.5,
                          "unknown_models": rng.choice(["reject", "default"])},
              "breaker": {"failure_threshold": rng.choice([1, 2, 3])},
              "providers": {f"{shape}.main": {"family": "sim", "model": "m-main", "fallbacks": [f"{other}.backup"],
                                              "price": {"input_per_mtok": 2.0, "output_per_mtok": 10.0}},
                            f"{other}.backup": {"family": "sim", "model": "m-backup",
                                                "price": {"input_per_mtok": 1.0, "output_per_mtok": 3.0}}}}
    replies = [{"provider": alias, "script": [rng.choice(REPLIES) for _ in range(3 * turns)]}
               for alias in (f"{shape}.main", f"{other}.backup")]
    dialect = rng.choice(["/v1/chat/completions", "/v1/messages"])
    # a model the gateway offers, mostly: an unknown one or none is refused before any dialect
    # codec or upstream is reached, so a case spent on it compares only the refusal
    model = rng.choices(["m-main", f"{shape}.main/m-main", "nope", None], weights=[8, 8, 1, 1])[0]
    body = {"model": model, "stream": rng.random() < 0.5,
            "messages": [{"role": "user", "content": rng.choice(CONTENTS)}]}
    for _ in range(rng.choice([0, 1, 2])):
        body.update(rng.choice(PARAMS))
    if dialect == "/v1/messages":
        body.setdefault("max_tokens", 64)
    if body["model"] is None:
        del body["model"]
    raw = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    if rng.random() < 0.05:
        raw = raw[:-3]  # broken JSON
    # the body as latin-1: any bytes as sent (a cut UTF-8 character in the broken JSON too)
    return {"config": config, "replies": replies, "dialect": dialect, "body": raw.decode("latin-1"),
            "headers": rng.choice(CLIENT_HEADERS).decode()}


def _child(cases: int, turns: int, seed: int) -> None:
    from relayline.adapters.sim.background import BackgroundGateway

    rng = random.Random(seed)
    answers = []
    for _ in range(cases):
        case = _case(rng, turns)
        with tempfile.TemporaryDirectory() as tmp:
            ledger = os.path.join(tmp, "ledger.sqlite3")
            with BackgroundGateway(case["config"], case["replies"], ledger_path=ledger) as gateway:
                port = int(gateway.url.rsplit(":", 1)[1])
                body = case["body"].encode("latin-1")
                got = [_masked(_exchange(port, case["dialect"].encode(), body, case["headers"].encode()))
                       for _ in range(turns)]
                time.sleep(0.05)  # (the last turn's bookkeeping)
            rows = sqlite3.connect(ledger).execute(
                "SELECT requested, provider, model, mode, outcome, accepted, input_tokens, output_tokens, cost_usd,"
                " client FROM attempts ORDER BY id").fetchall() if os.path.exists(ledger) else []
        answers.append({**case, "answers": got, "ledger": rows})
    print(json.dumps(answers, ensure_ascii=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the package directory of the tree to compare with")
    parser.add_argument("--after", help="the other tree (default: this one)")
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--turns", type=int, default=2, help="requests a case, on one gateway")
    parser.add_argument("--seed", type=int, default=6)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.cases, args.turns, args.seed)
        return
    sides = {}
    for side, tree in (("before", args.base), ("after", args.after)):
        result = child_in_tree(__file__, tree, ["--base", args.base, "--cases", str(args.cases), "--turns",
                                                str(args.turns), "--seed", str(args.seed)], timeout_s=3600)
        sides[side] = result
    differ = [(b, a) for b, a in zip(sides["before"], sides["after"], strict=True) if b != a]
    statuses: dict[str, int] = {}
    for case in sides["after"]:
        for answer in case["answers"]:
            statuses[answer[9:12]] = statuses.get(answer[9:12], 0) + 1
    print(f"{args.cases} cases, {args.cases * args.turns} answers ({statuses}), "
          f"{sum(len(c['ledger']) for c in sides['after'])} ledger rows: {len(differ)} differ")
    for before, after in differ[:5]:
        print(json.dumps({"request": after["body"][:300], "dialect": after["dialect"], "replies": after["replies"]},
                         ensure_ascii=False))
        for b, a in zip(before["answers"] + [str(before["ledger"])], after["answers"] + [str(after["ledger"])],
                        strict=True):
            if b != a:
                print("  before:", b[:1500], "\n  after: ", a[:1500])
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()

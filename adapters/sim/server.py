"""The sim family over real loopback HTTP: scripted upstreams speaking both protocol shapes.

One server serves every scripted profile under its own path prefix, so a profile points at it
with an ordinary base_url:

    openai shape:     base_url = "http://127.0.0.1:PORT/ALIAS/v1"
                      -> POST /ALIAS/v1/chat/completions
    anthropic shape:  base_url = "http://127.0.0.1:PORT/ALIAS"
                      -> POST /ALIAS/v1/messages

Each call takes the profile's next scripted reply (docs/scenario-files.md, "Replies") and renders it
as the real provider would send it: JSON bodies, SSE byte streams, HTTP errors with Retry-After,
refused connections, hangs, pauses between frames. The demo, the gateway tests and the
benchmarks use it; nothing here is mocked on the client side.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from relayline.machines.families import FAMILIES, WIRES

from ..providers.sim import aggregate_frames, default_usage, finish_of, reply_frames, scripts_of
from .loopback import LoopbackServer, Reply, Seen

SSE = (("content-type", "text/event-stream"), ("cache-control", "no-cache"))
# a scripted finish reason (OpenAI's words) as Anthropic's stop_reason
ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                  "content_filter": "refusal"}
JSON = (("content-type", "application/json"),)


def _sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return (f"event: {event}\n" if event else "").encode() + f"data: {payload}\n\n".encode()


def _openai_chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
                  usage: dict[str, Any] | None = None, model: str = "") -> dict[str, Any]:
    chunk = {"id": "chatcmpl-sim", "object": "chat.completion.chunk", "created": 0, "model": model,
             "choices": [] if delta is None else [{"index": 0, "delta": delta,
                                                   "finish_reason": finish}]}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def openai_stream(reply: Mapping[str, Any], model: str) -> list[bytes | float]:
    out: list[bytes | float] = []
    tools = 0
    for frame in reply_frames(reply):
        if "wait" in frame:
            out.append(float(frame["wait"]))
        elif frame.get("role"):
            out.append(_sse(_openai_chunk({"role": "assistant", "content": ""}, model=model)))
        elif frame.get("ping"):
            out.append(b": keep-alive\n\n")
        elif "text" in frame:
            out.append(_sse(_openai_chunk({"content": frame["text"]}, model=model)))
        elif "reasoning" in frame:
            out.append(_sse(_openai_chunk({"reasoning_content": frame["reasoning"]}, model=model)))
        elif "tool_call" in frame:
            call = {"index": tools, "id": f"call_sim{tools}", "type": "function",
                    "function": {"name": frame["tool_call"], "arguments": "{}"}}
            tools += 1
            out.append(_sse(_openai_chunk({"tool_calls": [call]}, model=model)))
        elif "usage" in frame:
            tokens_in, tokens_out = frame["usage"]
            out.append(_sse(_openai_chunk(usage={"prompt_tokens": tokens_in,
                                                 "completion_tokens": tokens_out,
                                                 "total_tokens": tokens_in + tokens_out},
                                                 model=model)))
        elif "error" in frame:
            out.append(_sse({"error": {"message": "sim error", "type": frame["error"],
                                       "code": None}}))
        elif frame.get("malformed"):
            out.append(b"data: {not json\n\n")
        elif frame.get("eof"):
            break
        elif frame.get("done"):
            out.append(
                _sse(
                    _openai_chunk(
                        {},
                        finish_of(reply, frame) or ("tool_calls" if tools else "stop"),
                        model=model,
                    )
                )
            )
            out.append(_sse("[DONE]"))
            break
        # executed_tool: the OpenAI shape has no provider-executed tool events
    return out


def anthropic_stream(reply: Mapping[str, Any], model: str) -> list[bytes | float]:
    out: list[bytes | float] = []
    index = 0
    usage = {"input_tokens": 10, "output_tokens": 1}
    tools = False
    out.append(
        _sse(
            {
                "type": "message_start",
                "message": {
                    "id": "msg_sim",
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": model,
                    "usage": usage,
                },
            },
            "message_start",
        )
    )

    def block(start: dict[str, Any], delta: dict[str, Any] | None) -> list[bytes]:
        nonlocal index
        parts = [_sse({"type": "content_block_start", "index": index, "content_block": start},
                      "content_block_start")]
        if delta is not None:
            parts.append(_sse({"type": "content_block_delta", "index": index, "delta": delta},
                              "content_block_delta"))
        parts.append(_sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
        index += 1
        return parts

    for frame in reply_frames(reply):
        if "wait" in frame:
            out.append(float(frame["wait"]))
        elif frame.get("role"):
            continue  # message_start is the role preamble
        elif frame.get("ping"):
            out.append(_sse({"type": "ping"}, "ping"))
        elif "text" in frame:
            out.extend(block({"type": "text", "text": ""},
                             {"type": "text_delta", "text": frame["text"]}))
        elif "reasoning" in frame:
            out.extend(block({"type": "thinking", "thinking": ""},
                             {"type": "thinking_delta", "thinking": frame["reasoning"]}))
        elif "tool_call" in frame:
            out.extend(
                block(
                    {
                        "type": "tool_use",
                        "id": f"toolu_sim{index}",
                        "name": frame["tool_call"],
                        "input": {},
                    },
                    {"type": "input_json_delta", "partial_json": "{}"},
                )
            )
            tools = True
        elif "executed_tool" in frame:
            out.extend(
                block(
                    {
                        "type": "server_tool_use",
                        "id": "srvtoolu_sim",
                        "name": frame["executed_tool"],
                        "input": {},
                    },
                    None,
                )
            )
        elif "usage" in frame:
            usage = {"input_tokens": frame["usage"][0], "output_tokens": frame["usage"][1]}
        elif "error" in frame:
            out.append(
                _sse(
                    {"type": "error", "error": {"type": frame["error"], "message": "sim error"}},
                    "error",
                )
            )
        elif frame.get("malformed"):
            out.append(b"event: content_block_delta\ndata: {not json\n\n")
        elif frame.get("eof"):
            break
        elif frame.get("done"):
            stop = ANTHROPIC_STOP[finish_of(reply, frame) or ("tool_calls" if tools else "stop")]
            out.append(_sse({"type": "message_delta",
                             "delta": {"stop_reason": stop, "stop_sequence": None},
                             "usage": usage}, "message_delta"))
            out.append(_sse({"type": "message_stop"}, "message_stop"))
            break
    return out


def openai_body(reply: Mapping[str, Any], model: str) -> dict[str, Any]:
    usage = default_usage(reply, [] if reply.get("empty") else None)
    message: dict[str, Any] = {"role": "assistant",
                               "content": None if reply.get("empty") else reply.get("text", "")}
    if reply.get("reasoning"):
        message["reasoning_content"] = reply["reasoning"]
    if reply.get("tool_call"):
        message["tool_calls"] = [{"id": "call_sim", "type": "function",
                                  "function": {"name": reply["tool_call"], "arguments": "{}"}}]
    return {
        "id": "chatcmpl-sim",
        "object": "chat.completion",
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_of(reply)
                or ("tool_calls" if reply.get("tool_call") else "stop"),
            }
        ],
        "usage": {"prompt_tokens": usage.input_tokens, "completion_tokens": usage.output_tokens},
    }


def anthropic_body(reply: Mapping[str, Any], model: str) -> dict[str, Any]:
    usage = default_usage(reply, [] if reply.get("empty") else None)
    content = []
    if reply.get("reasoning"):
        content.append({"type": "thinking", "thinking": reply["reasoning"], "signature": "sim"})
    if reply.get("text") and not reply.get("empty"):
        content.append({"type": "text", "text": reply["text"]})
    if reply.get("tool_call"):
        content.append({"type": "tool_use", "id": "toolu_sim", "name": reply["tool_call"],
                        "input": {}})
    return {
        "id": "msg_sim",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": ANTHROPIC_STOP[
            finish_of(reply) or ("tool_calls" if reply.get("tool_call") else "stop")
        ],
        "usage": {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens},
    }


def _coalesce(pieces: list[bytes | float]) -> tuple[bytes | float, ...]:
    """Frames with no pause between them leave in one write, as a fast provider's do."""
    out: list[bytes | float] = []
    for piece in pieces:
        if isinstance(piece, bytes) and out and isinstance(out[-1], bytes):
            out[-1] += piece
        else:
            out.append(piece)
    return tuple(out)


def error_body(shape: str, status: int, error: str | None) -> dict[str, Any]:
    code = error or (
        "overloaded_error"
        if status == 529
        else "rate_limit_error"
        if status == 429
        else "api_error"
    )
    if shape == "anthropic":
        return {"type": "error", "error": {"type": code, "message": code}}
    return {"error": {"message": code, "type": code, "code": code}}


class SimHTTPServer:
    """Scripted upstreams for many profiles behind one loopback port."""

    def __init__(self, replies: Sequence[Mapping[str, Any]] = ()) -> None:
        # a reply script may name a model (absent: any model on that profile)
        self.scripts = scripts_of(replies)
        self.server = LoopbackServer(self._answer)
        self.calls = 0
        self.request_ids: list[str | None] = []  # each call's x-request-id (the gateway sends one)

    @property
    def port(self) -> int:
        return self.server.port

    def base_url(self, alias: str, shape: str = "openai") -> str:
        return f"http://127.0.0.1:{self.port}/{alias}" + ("/v1" if shape == "openai" else "")

    async def start(self, nursery: trio.Nursery) -> SimHTTPServer:
        await self.server.start(nursery)
        return self

    def _answer(self, seen: Seen) -> Reply:
        self.calls += 1
        self.request_ids.append(seen.headers.get("x-request-id"))
        path = seen.path
        shape = "anthropic" if path.endswith("/v1/messages") else "openai"
        alias = path.strip("/").split("/", 1)[0]
        body: dict[str, Any] = seen.body or {}
        model = body.get("model", "")
        script = next((s for s in self.scripts if s.provider == alias and s.model in (None, model)),
                      None)
        reply: Mapping[str, Any] = script.next() if script is not None else {"text": "ok"}
        delay = math.inf if reply.get("hang") else float(reply.get("delay", 0.0))
        if reply.get("connect_error"):
            return Reply(refuse=True)
        if reply.get("malformed_body"):  # the right status and shape, fields of the wrong types
            broken = {"choices": "none",
                      "usage": 7} if shape == "openai" else {"content": "none", "usage": 7}
            if body.get("stream"):  # a stream whose first event has them
                event = {**broken, "type": "message_start",
                         "message": 7} if shape == "anthropic" else broken
                return Reply(headers=SSE, pieces=(f"data: {json.dumps(event)}\n\n".encode(),),
                             delay=delay)
            return Reply(headers=JSON, pieces=(json.dumps(broken).encode(),), delay=delay)
        if "status" in reply:
            headers = JSON + ((("retry-after", str(reply["retry_after"])),
                               ) if "retry_after" in reply else ())
            return Reply(
                status=int(reply["status"]),
                headers=headers,
                delay=delay,
                pieces=(
                    json.dumps(
                        error_body(shape, int(reply["status"]), reply.get("error"))
                    ).encode(),
                ),
            )
        if body.get("stream"):
            stream = openai_stream if shape == "openai" else anthropic_stream
            frames = stream(reply, model)
            return Reply(headers=SSE, pieces=_coalesce(frames), delay=delay)
        if "frames" in reply:
            reply = aggregate_frames(reply["frames"])
            delay += reply["wait"]
            if reply.get("cut"):
                return Reply(headers=JSON, pieces=(b'{"id": "cut',), delay=delay, end=False)
            if "stream_error" in reply:
                return Reply(
                    status=500,
                    headers=JSON,
                    delay=delay,
                    pieces=(json.dumps(error_body(shape, 500, reply["stream_error"])).encode(),),
                )
        rendered = openai_body(reply, model) if shape == "openai" else anthropic_body(reply, model)
        return Reply(headers=JSON, pieces=(json.dumps(rendered).encode(),), delay=delay)


def shape_by_alias(alias: str) -> str:
    """A profile named after a wire family (anthropic.*) speaks that family's shape; everything
    else the first wire's (openai)."""
    family = FAMILIES.get(alias.split(".", 1)[0])
    return family.wire if family is not None and family.wire is not None else WIRES[0]


def wire_to(config: Mapping[str, Any], server: SimHTTPServer,
            shape_for: Callable[[str], str] = shape_by_alias) -> dict[str, Any]:
    """`config` with every sim profile pointed at the loopback sim server, in the protocol shape
    `shape_for(alias)` gives (openai or anthropic)."""
    copied: dict[str, Any] = json.loads(json.dumps(config))
    for alias, profile in copied.get("providers", {}).items():
        family = FAMILIES.get(profile.get("family", ""))
        if family is not None and family.wire is None:
            shape = shape_for(alias)
            if shape not in WIRES:
                raise ValueError(f"no wire shape {shape!r} (known: {', '.join(WIRES)})")
            profile["family"] = shape
            profile["base_url"] = server.base_url(alias, shape)
            if not any(k in profile for k in ("api_key", "api_key_env", "api_keys")):
                profile["api_key"] = "sim-key"
    return copied

"""A recording loopback upstream on a thread of its own: it answers as an OpenAI-compatible or
Anthropic provider would (by the request path: /v1/chat/completions, /v1/responses or
/v1/messages; JSON or SSE by the request's `stream`) and keeps every request it got, bodies and
headers, so a test can say exactly what reached the provider. The official SDKs are blocking
clients: this upstream, like the gateway (background.py), runs its own trio loop.

    with RecordingUpstream() as upstream:
        upstream.answer = Answer(text="hi", finish="length")
        ... a gateway profile with base_url = upstream.url ...
        upstream.seen[-1].body

A script (`RecordingUpstream(script)`, a function of the request) answers each request by what
it carries instead, as a model in a tool loop would: a tool call on one turn, text on the next.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs

from .loopback import BackgroundLoopback, Reply, Seen

SSE = (("content-type", "text/event-stream"),)
JSON = (("content-type", "application/json"),)


@attrs.frozen
class Answer:
    """What the upstream says, in the family's own words (finish is the family's own value)."""

    text: str = "ok"
    reasoning: str = ""
    tool_calls: tuple[tuple[str, str, str], ...] = ()  # (id, name, JSON arguments)
    finish: str | None = None  # e.g. "length" / "max_tokens"; None: the natural one
    stop_sequence: str | None = None  # Anthropic: the stop sequence that matched
    refusal: str = ""  # OpenAI: the model declined (message.refusal, streamed as refusal deltas)
    # OpenAI: the message's url citations (search models; not streamed)
    annotations: tuple[dict[str, Any], ...] = ()
    # OpenAI: each text piece with its token's logprob, as logprobs: true asks
    logprobs: bool = False
    # Anthropic: the text block's citations (not streamed)
    citations: tuple[dict[str, Any], ...] = ()
    redacted: str = ""  # Anthropic: a redacted_thinking block's data, after the thinking
    signature: str = "sig"  # Anthropic: the thinking block's signature
    # Anthropic: further thinking blocks, (words, signature) each, after the first (server tool
    # use between them, in a real answer)
    more_thinking: tuple[tuple[str, str], ...] = ()
    usage: dict[str, Any] | None = None  # the family's usage object; None: a small default
    status: int = 200
    # the error body for a status >= 400 (or an `error` in a 200)
    error: dict[str, Any] | None = None


def _sse(obj: str | dict[str, Any], event: str | None = None) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj)
    return (f"event: {event}\n" if event else "").encode() + f"data: {data}\n\n".encode()


def _logprobs(text: str) -> dict[str, Any]:
    return {
        "content": [
            {"token": text, "logprob": -0.25, "bytes": list(text.encode()), "top_logprobs": []}
        ],
        "refusal": None,
    }


def openai_reply(answer: Answer, model: str, stream: bool) -> tuple[bytes, ...]:
    finish = answer.finish or ("tool_calls" if answer.tool_calls else "stop")
    usage = answer.usage or {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    if not stream:
        message: dict[str, Any] = {"role": "assistant", "content": answer.text or None,
                                   "refusal": answer.refusal or None}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        message["annotations"] = list(answer.annotations)  # ([] when none, as OpenAI sends it)
        if answer.tool_calls:
            message["tool_calls"] = [{"id": i, "type": "function",
                                      "function": {"name": n, "arguments": a}}
                                     for i, n, a in answer.tool_calls]
        body = {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish,
                             "logprobs": _logprobs(answer.text) if answer.logprobs else None}],
                             "usage": usage}
        if answer.error is not None:
            body["error"] = answer.error
        return (json.dumps(body).encode(),)

    def chunk(delta: dict[str, Any] | None, finish_reason: str | None = None,
              logprobs: dict[str, Any] | None = None, **extra: Any) -> bytes:
        choices = [] if delta is None else [{"index": 0, "delta": delta,
                                             "finish_reason": finish_reason,
                                             "logprobs": logprobs}]
        return _sse({"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1,
                     "model": model,
                     "choices": choices, **extra})

    out = [chunk({"role": "assistant", "content": ""})]
    if answer.reasoning:
        out.append(chunk({"reasoning_content": answer.reasoning}))
    if answer.text:
        out.append(chunk({"content": answer.text},
                         logprobs=_logprobs(answer.text) if answer.logprobs else None))
    if answer.refusal:  # in two pieces, as OpenAI streams it
        half = len(answer.refusal) // 2
        out += [chunk({"refusal": answer.refusal[:half]}),
                chunk({"refusal": answer.refusal[half:]})]
    for index, (call_id, name, arguments) in enumerate(answer.tool_calls):
        out.append(chunk({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                          "function": {"name": name, "arguments": ""}}]}))
        out.append(chunk({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}))
    out.append(chunk({}, finish))
    out.append(chunk(None, usage=usage))
    out.append(_sse("[DONE]"))
    return tuple(out)


def anthropic_reply(answer: Answer, model: str, stream: bool) -> tuple[bytes, ...]:
    finish = answer.finish or ("tool_use" if answer.tool_calls else "end_turn")
    usage = answer.usage or {"input_tokens": 12, "output_tokens": 3}
    content: list[dict[str, Any]] = []
    if answer.reasoning:
        content.append({"type": "thinking", "thinking": answer.reasoning,
                        "signature": answer.signature})
    content += [
        {"type": "thinking", "thinking": words, "signature": signature}
        for words, signature in answer.more_thinking
    ]
    if answer.redacted:
        content.append({"type": "redacted_thinking", "data": answer.redacted})
    if answer.text:
        content.append({"type": "text", "text": answer.text} | (
            {"citations": list(answer.citations)} if answer.citations and not stream else {}))
    content += [
        {"type": "tool_use", "id": i, "name": n, "input": json.loads(a)}
        for i, n, a in answer.tool_calls
    ]
    if not stream:
        if answer.error is not None:
            return (json.dumps({"type": "error", "error": answer.error}).encode(),)
        return (
            json.dumps(
                {
                    "id": "msg_up",
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": content,
                    "stop_reason": finish,
                    "stop_sequence": answer.stop_sequence,
                    "usage": usage,
                }
            ).encode(),
        )
    start_usage = {k: v for k, v in usage.items() if k != "output_tokens"} | {"output_tokens": 1}
    out = [_sse({"type": "message_start",
                 "message": {"id": "msg_up", "type": "message", "role": "assistant",
                                                      "model": model, "content": [],
                                                      "stop_reason": None,
                                                      "stop_sequence": None, "usage": start_usage}},
                                                      "message_start")]
    for index, block in enumerate(content):
        if block["type"] == "redacted_thinking":  # whole in its start, no deltas
            out.append(_sse({"type": "content_block_start", "index": index, "content_block": block},
                            "content_block_start"))
            out.append(_sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
            continue
        if block["type"] == "tool_use":
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        elif block["type"] == "thinking":
            start, delta = {"type": "thinking",
                            "thinking": ""}, {"type": "thinking_delta",
                                              "thinking": block["thinking"]}
        else:
            start, delta = {"type": "text", "text": ""}, {"type": "text_delta",
                                                          "text": block["text"]}
        out.append(_sse({"type": "content_block_start", "index": index, "content_block": start},
                        "content_block_start"))
        out.append(_sse({"type": "content_block_delta", "index": index, "delta": delta},
                        "content_block_delta"))
        if block["type"] == "thinking":
            out.append(_sse({"type": "content_block_delta", "index": index,
                             "delta": {"type": "signature_delta", "signature": block["signature"]}},
                             "content_block_delta"))
        out.append(_sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
    out.append(_sse({"type": "message_delta",
                     "delta": {"stop_reason": finish, "stop_sequence": answer.stop_sequence},
                     "usage": {"output_tokens": usage.get("output_tokens", 0)}}, "message_delta"))
    out.append(_sse({"type": "message_stop"}, "message_stop"))
    return tuple(out)


def family_of(seen: Seen) -> str:
    """The family a request speaks, by its path (a query such as ?beta=true aside)."""
    return "anthropic" if seen.path.partition("?")[0].endswith("/v1/messages") else "openai"


def responses_reply(answer: Answer, model: str, stream: bool) -> tuple[bytes, ...]:
    """OpenAI's Responses API: the `response` object, or its event stream (text, reasoning with
    its encrypted content, function calls; incomplete for finish "max_output_tokens")."""
    usage = answer.usage or {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": 3,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}
    items: list[dict[str, Any]] = []
    if answer.reasoning:
        items.append({"id": "rs_up", "type": "reasoning",
                      "summary": [{"type": "summary_text", "text": answer.reasoning}],
                      "encrypted_content": "enc-up"})
    if answer.text:
        items.append({"id": "msg_up", "type": "message", "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": answer.text, "annotations": []}]})
    items += [{"id": f"fc_up{n}", "type": "function_call", "status": "completed", "call_id": i,
               "name": name,
               "arguments": a} for n, (i, name, a) in enumerate(answer.tool_calls)]
    incomplete = answer.finish == "max_output_tokens"
    response = {"id": "resp_up", "object": "response", "created_at": 1, "model": model,
                "output": items,
                "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "usage": usage}
    if not stream:
        return (json.dumps(response).encode(),)
    events: list[dict[str, Any]] = [{"type": "response.created",
                                     "response": {**response, "status": "in_progress",
                                                  "output": []}}]
    for index, item in enumerate(items):
        events.append({"type": "response.output_item.added", "output_index": index, "item": item | (
            {"arguments": ""} if item["type"] == "function_call" else {})})
        if item["type"] == "message":
            events.append({"type": "response.output_text.delta", "item_id": item["id"],
                           "output_index": index,
                           "content_index": 0, "delta": answer.text})
        elif item["type"] == "reasoning":
            events.append({"type": "response.reasoning_summary_text.delta", "item_id": item["id"],
                           "output_index": index, "summary_index": 0, "delta": answer.reasoning})
        else:
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": index, "delta": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": "response.incomplete" if incomplete else "response.completed",
                   "response": response})
    return tuple(_sse(dict(e, sequence_number=n), e["type"]) for n, e in enumerate(events))


class RecordingUpstream(BackgroundLoopback):
    def __init__(self, script: Callable[[Seen], Answer] | None = None) -> None:
        super().__init__(self._answer)
        self.answer = Answer()
        self.script = script

    def _answer(self, seen: Seen) -> Reply:
        answer = self.script(seen) if self.script is not None else self.answer
        family = family_of(seen)
        responses = seen.path.partition("?")[0].endswith("/responses")
        if answer.status >= 400:
            error = answer.error or {"type": "invalid_request_error", "message": "rejected"}
            refused = {"type": "error",
                       "error": error} if family == "anthropic" else {"error": error}
            return Reply(status=answer.status, headers=JSON, pieces=(json.dumps(refused).encode(),))
        body: dict[str, Any] = seen.body or {}
        stream = bool(body.get("stream"))
        render = (
            anthropic_reply
            if family == "anthropic"
            else responses_reply
            if responses
            else openai_reply
        )
        model: str = body.get("model", "")
        return Reply(headers=SSE if stream else JSON, pieces=render(answer, model, stream))

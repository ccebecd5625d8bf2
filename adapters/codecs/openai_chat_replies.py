"""OpenAI chat completions replies: what an `openai` profile answered, whole (JSON) or streamed
(SSE chunks), read into the canonical completion and stream frames.

Completion is `data: [DONE]`, or a choice with a finish_reason (some compatible servers close
right after it); EOF before either is truncation. A reply of the wrong shape is a `malformed`
failure naming the field; a 200 carrying `error` is a failure. A profile that serves OpenAI's
Responses API or embeddings answers in those shapes, read by their own codecs.
"""

from __future__ import annotations

import json
from typing import Any

from relayline.machines import classify as fc
from relayline.machines import wire as w
from relayline.machines.ledger import MAX_TOKENS, Usage
from relayline.machines.stream import (
    FINISH,
    PREAMBLE,
    REASONING,
    ROLE,
    TEXT,
    TOOL_ARGS,
    TOOL_CALL,
    USAGE,
    Frame,
)
from relayline.machines.turn import Completion

from .. import jsoncodec
from ..sse import SSEEvent
from . import embeddings, responses_replies, shape
from .common import OPENAI_FINISH, ProviderFailure, json_frame, openai_reply_usage


def _reasoning(message: dict[str, Any], param: str) -> str:
    value = message.get("reasoning_content")
    if value is None:
        value = message.get("reasoning")
    return "" if value is None else shape.want_str(value, shape.path(param, "reasoning_content"))


def _arguments(value: object, param: str) -> str:
    if value is None:
        return ""
    if isinstance(value, dict):  # some compatible servers send the object itself
        return json.dumps(value)
    return shape.want_str(value, param)


def _finish(raw: object, param: str) -> str | None:
    if raw is None:
        return None
    return OPENAI_FINISH.get(shape.want_str(raw, param), w.STOP)


def _raise_error(error: object) -> None:
    text = (
        error
        if isinstance(error, str)
        else " ".join(str(error.get(k, "")) for k in ("code", "type", "message"))
        if isinstance(error, dict)
        else "error"
    )
    raise ProviderFailure(fc.classify_stream_error(text))


def _text(content: object, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # a few compatible servers answer with text parts
        return "".join(shape.want_str(shape.want_dict(p, shape.path(param, i)).get("text", ""),
                                      shape.path(shape.path(param, i), "text"))
                       for i, p in enumerate(content))
    return shape.want_str(content, param)


def _plain_answer(body: dict[str, Any]) -> Completion | None:
    """A plain answer (a first choice whose message is text alone, a finish reason or none, usage
    of two plain counts or none) read at once: nearly every non-streamed answer, where the general
    walk below checked each field through a helper and built the path of each for its errors
    (most of the answer's decoding, measured per step in a serving process). None sends the answer
    through the walk, which reads it exactly the same way when it fits (a property test holds
    the two equal)."""
    choices = body.get("choices")
    if type(choices) is not list or not choices or body.get("error"):
        return None
    choice = choices[0]
    if type(choice) is not dict:
        return None
    message = choice.get("message")
    if type(message) is not dict:
        return None
    text = message.get("content")
    finish = choice.get("finish_reason")
    if (
        type(text) is not str
        or (finish is not None and type(finish) is not str)
        or message.get("tool_calls") is not None
        or message.get("reasoning_content") is not None
        or message.get("reasoning") is not None
        or message.get("refusal") is not None
        or choice.get("logprobs") is not None
        or message.get("annotations")
    ):
        return None
    raw = body.get("usage")
    usage: Usage | None = None  # none reported: the ledger bills the answer at an estimate
    if raw is not None:
        if type(raw) is not dict or raw.get("prompt_tokens_details") is not None or \
                raw.get("completion_tokens_details") is not None:
            return None
        prompt, output = raw.get("prompt_tokens", 0), raw.get("completion_tokens", 0)
        if type(prompt) is not int or type(output) is not int or not 0 <= prompt <= MAX_TOKENS or \
                not 0 <= output <= MAX_TOKENS:
            return None  # (a null count, or one out of range: the walk reads or refuses it)
        usage = Usage(prompt, output)
    return Completion(text, "", (), usage, (), (),
                      None if finish is None else OPENAI_FINISH.get(finish, w.STOP))


def parse_completion(body: dict[str, Any]) -> Completion:
    plain = _plain_answer(body)
    return plain if plain is not None else _walk_completion(body)


def _walk_completion(body: dict[str, Any]) -> Completion:
    if body.get("error"):
        _raise_error(body["error"])
    choices = shape.want_list(body.get("choices"), "choices")
    if not choices:
        # no answer (an empty completion to the walk); usage none reported stays None, so the
        # ledger estimates it: a missing usage is not a usage of zero
        return Completion(usage=openai_reply_usage(body.get("usage")))
    choice = shape.want_dict(choices[0], "choices[0]")
    message = shape.want_dict(choice.get("message"), "choices[0].message")
    calls = shape.optional(message, "tool_calls", shape.want_list, "choices[0].message") or []
    names, arguments, ids = [], [], []
    for i, call in enumerate(calls):
        where = f"choices[0].message.tool_calls[{i}]"
        call = shape.want_dict(call, where)
        function = shape.want_dict(call.get("function"), f"{where}.function")
        names.append(shape.want_str(function.get("name"), f"{where}.function.name"))
        arguments.append(_arguments(function.get("arguments"), f"{where}.function.arguments"))
        ids.append(shape.optional(call, "id", shape.want_str, where) or "")
    text = _text(message.get("content"), "choices[0].message.content")
    finish = _finish(choice.get("finish_reason"), "choices[0].finish_reason")
    refusal = shape.optional(message, "refusal", shape.want_str, "choices[0].message")
    if refusal:
        # the model declined (structured outputs): its words are the answer, a refusal as
        # on_refusal and both dialects know one (finish_reason stop said nothing of it)
        text, finish = text + refusal, w.CONTENT_FILTER
    return Completion(text, _reasoning(message, "choices[0].message"), tuple(names),
                      openai_reply_usage(body.get("usage")), tuple(arguments), tuple(ids), finish,
                      logprobs=shape.optional(choice, "logprobs", shape.want_dict, "choices[0]"),
                      annotations=tuple(shape.optional(message, "annotations", shape.want_list,
                                                       "choices[0].message") or ()))


def _only_text(obj: dict[str, Any]) -> str | None:
    """The text of a chunk that carries nothing else (one choice, a delta of only `content`, no
    finish, usage or error): nearly every chunk of a stream, read here without the general walk.
    None sends the chunk through `_frames`, which reads it exactly the same way when it fits."""
    choices = obj.get("choices")
    if (
        type(choices) is not list
        or len(choices) != 1
        or obj.get("usage") is not None
        or obj.get("error")
    ):
        return None
    choice = choices[0]
    if (
        type(choice) is not dict
        or choice.get("finish_reason") is not None
        or choice.get("logprobs") is not None
    ):
        return None
    delta = choice.get("delta")
    if type(delta) is not dict or len(delta) != 1:
        return None
    content = delta.get("content")
    return content if type(content) is str and content else None


class OpenAIStreamParser:
    def __init__(self) -> None:
        self.done = False
        self.finished = False
        self.refused = False  # refusal deltas came: the finish is a refusal, whatever it says
        # a tool call's `index` -> its place among the calls opened
        self.calls: dict[object, int] = {}
        # a Responses stream's reader
        self.responses: responses_replies.ResponsesStreamParser | None = None

    def complete_at_eof(self) -> bool:
        return self.finished

    def feed(self, event: SSEEvent) -> list[Frame]:
        if event.event != "message":  # named events: a Responses API stream (chat chunks have none)
            return self._responses_frames(event)
        if event.data[:1] != "{" and event.data.strip() == "[DONE]":
            self.done = True
            return []
        # nearly every chunk carries text alone: read once, without the digit-run check, since
        # the text read from it is a string (jsoncodec.loads_shape); any other is read exactly
        obj = jsoncodec.loads_shape(event.data)
        text = _only_text(obj) if type(obj) is dict else None
        if text is not None:
            return [Frame(TEXT, text)]
        obj = json_frame(event, obj)
        try:
            return self._frames(obj)
        except w.WireError as exc:
            raise ProviderFailure(fc.malformed(f"stream chunk {exc}")) from None

    def _responses_frames(self, event: SSEEvent) -> list[Frame]:
        if self.responses is None:
            self.responses = responses_replies.ResponsesStreamParser()
        frames = self.responses.feed(event)
        self.done, self.finished = self.responses.done, self.responses.finished
        return frames

    def _frames(self, obj: dict[str, Any]) -> list[Frame]:
        if obj.get("error"):
            _raise_error(obj["error"])
        frames: list[Frame] = []
        for i, choice in enumerate(shape.optional(obj, "choices", shape.want_list) or ()):
            where = f"choices[{i}]"
            choice = shape.want_dict(choice, where)
            delta = shape.optional(choice, "delta", shape.want_dict, where) or {}
            if delta.get("role"):
                frames.append(Frame(ROLE))
            reasoning = _reasoning(delta, f"{where}.delta")
            if reasoning:
                frames.append(Frame(REASONING, reasoning))
            content = delta.get("content")
            if content is not None:
                content = shape.want_str(content, f"{where}.delta.content")
                logprobs = shape.optional(choice, "logprobs", shape.want_dict, where)
                # the text's logprobs ride on its frame (the client asked for them), as JSON
                frames.append(Frame(TEXT, content,
                                    ref=jsoncodec.dumps(logprobs).decode() if logprobs else "")
                              if content else Frame(PREAMBLE))
            refusal = delta.get("refusal")
            if refusal is not None and shape.want_str(refusal, f"{where}.delta.refusal"):
                self.refused = True
                frames.append(Frame(TEXT, refusal))
            for j, call in enumerate(shape.optional(delta, "tool_calls", shape.want_list,
                                                    f"{where}.delta") or ()):
                at = f"{where}.delta.tool_calls[{j}]"
                call = shape.want_dict(call, at)
                function = shape.optional(call, "function", shape.want_dict, at) or {}
                name = shape.optional(function, "name", shape.want_str, f"{at}.function")
                index = shape.optional(call, "index", shape.want_int, at)
                index = j if index is None else index
                if name:
                    self.calls[index] = len(self.calls)
                    frames.append(Frame(TOOL_CALL, name,
                                        ref=shape.optional(call, "id", shape.want_str, at) or ""))
                arguments = _arguments(function.get("arguments"), f"{at}.function.arguments")
                if arguments:
                    # a piece of a call opened before the last one names its place (calls opened
                    # together, then their arguments); a piece of the last one goes to it as before
                    place = self.calls.get(index, len(self.calls) - 1)
                    frames.append(Frame(TOOL_ARGS, arguments,
                                        ref=str(place) if place != len(self.calls) - 1 else ""))
            finish = _finish(choice.get("finish_reason"), f"{where}.finish_reason")
            if finish:
                self.finished = True
                frames.append(Frame(FINISH, w.CONTENT_FILTER if self.refused else finish))
        usage = openai_reply_usage(obj.get("usage"))
        if usage is not None:
            frames.append(Frame(USAGE, usage=usage))
        return frames


def parse_reply(body: dict[str, Any]) -> Completion:
    """A whole reply of an `openai` profile: a chat completion, or a Responses API or embeddings
    reply when the profile was asked in those APIs."""
    if responses_replies.is_response(body):
        return responses_replies.parse_response(body)
    if embeddings.is_embeddings(body):
        return embeddings.parse_reply(body)
    return parse_completion(body)

"""What an openai profile that serves the Responses API answers (`capabilities.responses`), read
into the canonical answer: the `response` object, and the Responses event stream as frames.

The client's own items come back as the provider sent them (`Completion.blocks`), so what the
canonical answer has no field for (a reasoning item's encrypted content, a built-in tool's call)
reaches a Responses client unchanged; the frames carry what the gate and the ledger read. In a
stream, an output item no frame kind reads (a built-in tool's call, whatever kind comes next)
is carried whole, once done, as provider-executed tool work, and a message's citations follow
its text once it is done. The provider's response id (the
one its `previous_response_id` knows) rides the answer and the stream's first frame. A
stream is complete at `response.completed` or `response.incomplete`; EOF before either is
truncation, and `response.failed` or an `error` event is the provider's failure.
"""

from __future__ import annotations

from typing import Any

from relayline.machines import classify as fc
from relayline.machines import wire as w
from relayline.machines.ledger import Usage
from relayline.machines.stream import (
    EXECUTED_TOOL,
    FINISH,
    PREAMBLE,
    REASONING,
    TEXT,
    TOOL_ARGS,
    TOOL_CALL,
    USAGE,
    Frame,
)
from relayline.machines.turn import Completion

from .. import jsoncodec
from ..sse import SSEEvent
from . import shape
from .common import ProviderFailure, openai_reply_usage

# a reasoning frame's ref that is a Responses provider's encrypted content (an Anthropic thinking
# block's signature rides the same ref bare)
ENCRYPTED = "encrypted:"

# an executed tool frame's ref that is a whole output item, as JSON (an Anthropic server tool's
# frame carries no ref)
ITEM = "item:"
# an empty text frame's ref that is the citations of the message just shown, as JSON
CITATIONS = "annotations:"
# the output item kinds the stream's frames read; any other kind is carried whole
READ_ITEMS = ("message", "reasoning", "function_call")

# incomplete_details.reason -> the canonical finish reason
INCOMPLETE = {"max_output_tokens": w.LENGTH, "content_filter": w.CONTENT_FILTER}


def _usage(raw: Any, param: str = "usage") -> Usage | None:
    return openai_reply_usage(raw, param, ("input", "output"))


def _failure(error: Any) -> ProviderFailure:
    text = (
        " ".join(str(error.get(k, "")) for k in ("code", "type", "message"))
        if isinstance(error, dict)
        else "error"
    )
    return ProviderFailure(fc.classify_stream_error(text))


def _finish(response: dict[str, Any], calls: int) -> str:
    details = response.get("incomplete_details")
    if response.get("status") == "incomplete" and isinstance(details, dict):
        return INCOMPLETE.get(str(details.get("reason")), w.LENGTH)
    return w.TOOL_CALLS if calls else w.STOP


def parse_response(body: dict[str, Any]) -> Completion:
    """A `response` object as the canonical answer, its output items kept as sent."""
    if body.get("error") or body.get("status") == "failed":
        raise _failure(body.get("error"))
    output = shape.want_list(body.get("output"), "output")
    text, reasoning, names, arguments, ids = [], [], [], [], []
    refused = False
    for i, item in enumerate(output):
        where = shape.path("output", i)
        item = shape.want_dict(item, where)
        kind = item.get("type")
        if kind == "message":
            for j, part in enumerate(shape.want_list(item.get("content"),
                                                     shape.path(where, "content"))):
                part = shape.want_dict(part, shape.path(shape.path(where, "content"), j))
                refused = refused or part.get("type") == "refusal"
                text.append(shape.want_str(part.get("text", part.get("refusal", "")),
                                           shape.path(where, "content")))
        elif kind == "reasoning":
            reasoning += [shape.want_str(s.get("text", ""), shape.path(where, "summary"))
                          for s in item.get("summary") or () if isinstance(s, dict)]
        elif kind == "function_call":
            names.append(shape.want_str(item.get("name"), shape.path(where, "name")))
            arguments.append(shape.want_str(item.get("arguments", ""),
                                            shape.path(where, "arguments")))
            ids.append(shape.want_str(item.get("call_id"), shape.path(where, "call_id")))
    finish = w.CONTENT_FILTER if refused else _finish(body, len(names))
    return Completion("".join(text), "\n".join(reasoning), tuple(names),
                      _usage(body.get("usage")) or Usage(),
                      tuple(arguments), tuple(ids), finish, blocks=tuple(output),
                      response_id=shape.optional(body, "id", shape.want_str))


def is_response(body: dict[str, Any]) -> bool:
    return body.get("object") == "response"


class ResponsesStreamParser:
    """The Responses event stream as frames: text, reasoning summaries, function calls and their
    arguments, and at the end the usage and the finish."""

    __slots__ = ("done", "finished", "calls", "refused")

    def __init__(self) -> None:
        self.done = False
        self.finished = False
        self.calls: dict[str, int] = {}  # a function call item's id -> its place among the calls
        self.refused = False

    def complete_at_eof(self) -> bool:
        return self.finished

    def feed(self, event: SSEEvent) -> list[Frame]:
        try:
            obj = shape.want_dict(jsoncodec.loads(event.data), "event")
            return self._frames(obj, str(obj.get("type") or event.event))
        except ValueError:
            raise ProviderFailure(fc.malformed("stream event: not JSON")) from None
        except w.WireError as exc:
            raise ProviderFailure(fc.malformed(f"stream event {exc}")) from None

    def _frames(self, obj: dict[str, Any], kind: str) -> list[Frame]:
        if kind in ("response.output_text.delta", "response.refusal.delta"):
            self.refused = self.refused or kind == "response.refusal.delta"
            return [Frame(TEXT, shape.want_str(obj.get("delta"), "delta"))]
        if kind in ("response.reasoning_summary_text.delta", "response.reasoning_text.delta"):
            return [Frame(REASONING, shape.want_str(obj.get("delta"), "delta"))]
        if kind == "response.function_call_arguments.delta":
            place = self.calls.get(str(obj.get("item_id")), len(self.calls) - 1)
            return [Frame(TOOL_ARGS, shape.want_str(obj.get("delta"), "delta"),
                          ref=str(place) if place != len(self.calls) - 1 else "")]
        if kind in ("response.output_item.added", "response.output_item.done"):
            return self._item(shape.want_dict(obj.get("item"), "item"),
                              added=kind.endswith("added"))
        if kind == "response.created":
            response = shape.want_dict(obj.get("response"), "response")
            return [Frame(PREAMBLE, kind,
                          ref=shape.optional(response, "id", shape.want_str, "response") or "")]
        if kind in ("response.completed", "response.incomplete"):
            response = shape.want_dict(obj.get("response"), "response")
            self.finished = self.done = True
            finish = w.CONTENT_FILTER if self.refused else _finish(response, len(self.calls))
            return [Frame(USAGE, usage=_usage(response.get("usage"), "response.usage") or Usage()),
                    Frame(FINISH, finish)]
        if kind in ("response.failed", "error"):
            failed = obj.get("response")
            raise _failure(failed.get("error") if isinstance(failed, dict) else obj)
        return []

    def _item(self, item: dict[str, Any], added: bool) -> list[Frame]:
        if added and item.get("type") == "function_call":
            self.calls[str(item.get("id"))] = len(self.calls)
            return [Frame(TOOL_CALL, shape.want_str(item.get("name"), "item.name"),
                          ref=shape.optional(item, "call_id", shape.want_str, "item") or "")]
        if not added and item.get("type") == "reasoning" and item.get("encrypted_content"):
            # the provider's opaque reasoning: the client sends it back on its next turn
            return [Frame(REASONING, "",
                          ref=ENCRYPTED + shape.want_str(item["encrypted_content"],
                                                         "item.encrypted_content"))]
        if not added and item.get("type") == "message":
            parts = shape.optional(item, "content", shape.want_list, "item") or ()
            cited = [a for i, part in enumerate(parts) if isinstance(part, dict)
                     for a in shape.optional(part, "annotations", shape.want_list,
                                             f"item.content[{i}]") or ()]
            return [Frame(TEXT, "",
                          ref=CITATIONS + jsoncodec.dumps(cited).decode())] if cited else []
        if not added and item.get("type") not in READ_ITEMS:
            # a built-in tool's call (web search, code interpreter...): the client sees it whole
            return [Frame(EXECUTED_TOOL, str(item.get("type")),
                          ref=ITEM + jsoncodec.dumps(item).decode())]
        return []

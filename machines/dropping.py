"""What `drop_unsupported_params` may drop from a request, and the request without it.

`wire.unsupported` names every field an entry cannot honour. A field can go alone, said in
x-relayline-dropped; content (an image, a document, the trailing assistant message a client asked
to be continued) never goes, since dropping it would delete what the client said: an entry that
cannot take it stays unfit and the walk skips it.
"""

from __future__ import annotations

from typing import Any

import attrs

from .config import Capabilities
from .wire import (
    DOCUMENT,
    IMAGE,
    OPENAI_FILE_ID,
    RESPONSES,
    STRUCTURED_NAMES,
    Part,
    Passthrough,
    Reasoning,
    Request,
    ResponseFormat,
    unsupported,
)

# what `unsupported` names that is content, not a field of it: an image, a document by URL or by
# an OpenAI file id, the trailing assistant message (prefill), tool call arguments
# `tool_use.input` cannot hold; and the request itself, an embeddings or token counting request
# to a family without that API
CONTENT_NAMES = frozenset({"image", "prefill", "document.source.url", OPENAI_FILE_ID,
                           "messages.tool_calls.function.arguments", "embeddings", "count_tokens"})


def is_content(name: str) -> bool:
    """Whether an unsupported `name` is content rather than a field: a whole part, block or
    message (`content.input_audio`, an Anthropic server tool's result), a tool result's image or
    document, a source only its own family has (`document.source.text`). Dropping it would
    delete what the client said, so `drop_unsupported_params` never does: the entry stays unfit."""
    if name in CONTENT_NAMES or name.startswith("tool_result.content."):
        return True
    head, _, rest = name.partition(".")
    if head == "content":
        return "." not in rest  # (content.image_url.detail is a field of an image)
    return head in (IMAGE, DOCUMENT) and rest.startswith("source.")


def refused(request: Request, family: str, capabilities: Capabilities,
            drop: bool) -> tuple[str, ...]:
    """What keeps an entry of `family` from serving the request: every unsupported field, or
    with `drop_unsupported_params` only the content among them (the rest is dropped)."""
    names = unsupported(request, family, capabilities)
    return tuple(n for n in names if is_content(n)) if drop else names


def droppable(request: Request, family: str, capabilities: Capabilities) -> tuple[str, ...]:
    """The unsupported fields `drop_unsupported_params` drops for an entry (and names in
    x-relayline-dropped): every one that is not content."""
    return tuple(n for n in unsupported(request, family, capabilities) if not is_content(n))


def without(request: Request, names: tuple[str, ...]) -> Request:
    """The request with the named unsupported fields dropped (`drop_unsupported_params`). Exactly
    the named fields go: a part or message that carried one keeps its text, image, document and
    tool data, and a name that is content is never dropped (`is_content`)."""
    dropped = frozenset(n for n in names if not is_content(n))
    if not dropped:
        return request

    def strip(part: Part) -> Part:
        kept = tuple(x for x in part.extra if x not in dropped)
        return part if len(kept) == len(part.extra) else attrs.evolve(part, extra=kept)

    messages = tuple(attrs.evolve(m, content=tuple(map(strip, m.content)),
                                  is_error=m.is_error and "tool_result.is_error" not in dropped)
                     for m in request.messages)
    tools = "tools" in dropped
    strict, schema = STRUCTURED_NAMES.get(request.source, STRUCTURED_NAMES["openai"])
    return attrs.evolve(
        request, messages=messages, passthrough=_own_body_without(request, dropped),
        tools=() if tools else tuple(attrs.evolve(t, strict=False) for t in request.tools)
        if strict in dropped else request.tools,
        tool_choice=None if tools else request.tool_choice,
        parallel_tool_calls=None if tools else request.parallel_tool_calls,
        top_k=None if "top_k" in dropped else request.top_k,
        temperature=None if "temperature" in dropped else request.temperature,
        response_format=_format_without(request.response_format, tuple(dropped), schema),
        reasoning=(None if "reasoning_effort" in dropped
                   else _without_effort(request.reasoning, dropped)),
        extra={k: v for k, v in request.extra.items() if k not in dropped},
    )


# the fields that go with a dropped `tools`, in each dialect's words
TOOL_FIELDS = {"openai": ("tools", "tool_choice", "parallel_tool_calls"),
               "anthropic": ("tools", "tool_choice"),
               RESPONSES: ("tools", "tool_choice", "parallel_tool_calls")}


def _own_body_without(request: Request, dropped: frozenset[str]) -> Passthrough | None:
    """What the client sent, less the dropped fields. Its headers and query go on as before (a
    profile's `forward_headers` reach any family); its body goes only to an entry of the client's
    own family, which lacks at most tools or structured outputs (`unsupported`), each a field
    that can go alone: what relayline does not read (server tool blocks, citations, a document's
    text source, audio parts...) still goes as the client sent it."""
    passthrough = request.passthrough
    if passthrough is None or request.source not in STRUCTURED_NAMES:
        return passthrough
    strict, schema = STRUCTURED_NAMES[request.source]
    body = dict(passthrough.body)
    if "tools" in dropped:
        for name in TOOL_FIELDS[request.source]:
            body.pop(name, None)
    elif strict in dropped and isinstance(body.get("tools"), list):
        body["tools"] = [_unstrict(tool, request.source) for tool in body["tools"]]
    if schema in dropped:
        body.pop("response_format" if request.source == "openai" else "output_format", None)
        # Anthropic's format is output_config.format, the Responses API's text.format: the
        # table keeps its other keys (effort, verbosity)
        for table in ("output_config", "text"):
            _drop_key(body, table, "format")
    return attrs.evolve(passthrough, body=body)


def _drop_key(body: dict[str, Any], table: str, key: str) -> None:
    """`body[table]` without `key`; the table goes too when nothing else is left in it."""
    value = body.get(table)
    if isinstance(value, dict) and key in value:
        rest = {k: v for k, v in value.items() if k != key}
        if rest:
            body[table] = rest
        else:
            del body[table]


def _unstrict(tool: Any, source: str) -> Any:
    """A tool of the client's body without `strict` (a chat completions tool's is in its
    function; an Anthropic or a Responses tool carries it at its top level)."""
    if not isinstance(tool, dict):
        return tool
    if source != "openai":
        return {k: v for k, v in tool.items() if k != "strict"}
    function = tool.get("function")
    if not isinstance(function, dict):
        return tool
    return {**tool, "function": {k: v for k, v in function.items() if k != "strict"}}


def _format_without(form: ResponseFormat | None, names: tuple[str, ...],
                    schema: str) -> ResponseFormat | None:
    if form is None or "response_format" in names or schema in names:
        return None
    if "response_format.json_schema.description" in names and form.json_schema is not None:
        described = form.json_schema.items()
        return attrs.evolve(form, json_schema={k: v for k, v in described if k != "description"})
    return form


def _without_effort(reasoning: Reasoning | None, dropped: frozenset[str]) -> Reasoning | None:
    if reasoning is None or "output_config.effort" not in dropped:
        return reasoning
    return attrs.evolve(reasoning, effort=None)

"""The canonical request written as the chat completions body an `openai` profile is sent: the
client's own body when it spoke this dialect, else the request translated (messages, tools,
their choice, the response format, reasoning as an effort).

Its own module because it runs the other way from `openai_chat.py`, which reads a client's chat
completions body: the two share the dialect's vocabulary but no code, and a profile's body is
written for a request from any dialect (or built by the library).
"""

from __future__ import annotations

from typing import Any

from relayline.machines import wire as w


def _render_part(part: w.Part, cached: bool) -> dict[str, Any]:
    out: dict[str, Any]
    if part.type == w.IMAGE:
        url = part.url if part.url is not None else f"data:{part.media_type};base64,{part.data}"
        out = {"type": "image_url", "image_url": {"url": url}}
    elif part.type == w.DOCUMENT:
        out = {"type": "file", "file": {"filename": part.title or "document.pdf",
                                        "file_data": f"data:{part.media_type};base64,{part.data}"}}
    else:
        out = {"type": "text", "text": part.text}
    if cached and part.cache_control is not None:
        out["cache_control"] = dict(part.cache_control)
    return out


def _render_content(parts: tuple[w.Part, ...], cached: bool) -> str | list[dict[str, Any]]:
    if all(p.type == w.TEXT and (not cached or p.cache_control is None) for p in parts):
        return "".join(p.text for p in parts)
    return [_render_part(p, cached) for p in parts if p.type in (w.TEXT, w.IMAGE, w.DOCUMENT)]


def _render_message(message: w.Message, cached: bool) -> dict[str, Any]:
    """The message as a chat completions message. Caching hints go with it only when an OpenAI
    client wrote them (`cached`): OpenAI caches prefixes itself, and an Anthropic block's hint
    has no place here."""
    content = message.content
    if message.role == w.ASSISTANT:
        # earlier turns' reasoning is not sent back to a chat completions server
        content = tuple(p for p in content if p.type not in w.REASONING_PARTS)
    out: dict[str, Any] = {"role": message.role, "content": _render_content(content, cached)}
    if message.role == w.TOOL:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["content"] = out["content"] or None
        out["tool_calls"] = [_render_call(c, cached) for c in message.tool_calls]
    if cached and message.cache_control is not None:
        out["cache_control"] = dict(message.cache_control)
    return out


def _render_call(call: w.ToolCall, cached: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    if cached and call.cache_control:
        out["cache_control"] = dict(call.cache_control)
    return out


def _render_tool(tool: w.Tool, cached: bool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "description": tool.description,
                                "parameters": dict(tool.parameters)}
    if tool.strict:
        function["strict"] = True
    out: dict[str, Any] = {"type": "function", "function": function}
    if cached and tool.cache_control:
        out["cache_control"] = dict(tool.cache_control)
    return out


def render_request(request: w.Request, model: str, stream: bool) -> dict[str, Any]:
    """The body for an openai-family entry: the client's own body when it spoke this dialect,
    else the canonical request translated (docs/wire.md)."""
    if request.passthrough is not None and request.source == "openai":
        body = dict(request.passthrough.body)
    else:
        body = _translated(request)
    body["model"] = model
    body["stream"] = stream
    if stream:
        # usage is requested for the ledger; the gateway shows it to the client only if asked
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    else:
        body.pop("stream_options", None)
    return body


def _translated(request: w.Request) -> dict[str, Any]:
    """The canonical request written as a chat completions body (another dialect's client, or a
    request built by the library)."""
    cached = request.source == "openai"
    body: dict[str, Any] = {"messages": [_render_message(m, cached) for m in request.messages]}
    if request.max_tokens is not None:
        body["max_tokens"] = request.max_tokens
    for name in ("temperature", "top_p", "user", "parallel_tool_calls"):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.tools:
        body["tools"] = [_render_tool(t, cached) for t in request.tools]
    choice = request.tool_choice
    if choice is not None:
        body["tool_choice"] = (choice.mode if choice.mode != "tool"
                               else {"type": "function", "function": {"name": choice.name}})
    response_format = request.response_format
    if response_format is not None:
        body["response_format"] = {"type": response_format.type}
        if response_format.json_schema:
            body["response_format"]["json_schema"] = dict(response_format.json_schema)
    if request.reasoning is not None and request.reasoning.as_effort():
        body["reasoning_effort"] = request.reasoning.as_effort()
    if request.source == "openai":
        body.update({k: v for k, v in request.extra.items() if "." not in k})
    return body

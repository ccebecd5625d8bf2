"""The canonical request written as the messages body an `anthropic` profile is sent: the
client's own body when it spoke this dialect, else the request translated (roles joined, the
system prompt apart, reasoning as thinking and effort, tools and their choice).

Its own module because it runs the other way from `anthropic_messages.py`, which reads a
client's messages body: the two share the dialect's vocabulary but no code, and a profile's body
is written for a request from any dialect (or built by the library).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relayline.machines import wire as w

# the output limit an anthropic profile is sent when neither the client nor the profile set one
# (Anthropic requires max_tokens)
DEFAULT_MAX_TOKENS = 4096


def _cached(block: dict[str, Any], cache_control: Mapping[str, Any] | None) -> dict[str, Any]:
    """The block with a caching hint, when there is one."""
    return block if cache_control is None else {**block, "cache_control": dict(cache_control)}


def _render_part(part: w.Part) -> dict[str, Any] | None:
    if part.type == w.TEXT:
        return _cached({"type": "text", "text": part.text}, part.cache_control)
    if part.type == w.THINKING:  # back only with the signature its provider gave
        if not part.signature:
            return None
        return {"type": "thinking", "thinking": part.text, "signature": part.signature}
    if part.type == w.REDACTED_THINKING:
        return {"type": "redacted_thinking", "data": part.data}
    if part.type in (w.IMAGE, w.DOCUMENT):
        source = ({"type": "url", "url": part.url} if part.url is not None
                  else {"type": "base64", "media_type": part.media_type, "data": part.data})
        block: dict[str, Any] = {"type": part.type, "source": source}
        if part.title is not None:
            block["title"] = part.title
        return _cached(block, part.cache_control)
    return None


def _blocks(parts: tuple[w.Part, ...]) -> list[dict[str, Any]]:
    return [b for b in map(_render_part, parts)
            if b is not None and (b["type"] != "text" or b["text"])]


def _message_blocks(message: w.Message) -> list[dict[str, Any]]:
    """A user, assistant or system message's blocks. A caching hint on the whole message (an
    OpenAI client's) goes on its last block: Anthropic caches the prefix up to a marked block."""
    blocks = _blocks(message.content) + [
        _cached({"type": "tool_use", "id": c.id, "name": c.name, "input": c.as_object or {}},
                c.cache_control) for c in message.tool_calls]
    blocks = blocks or [{"type": "text", "text": ""}]
    if message.cache_control is not None and "cache_control" not in blocks[-1]:
        blocks[-1] = _cached(blocks[-1], message.cache_control)
    return blocks


def _reasoning_alone(message: w.Message) -> bool:
    """An assistant turn that showed only reasoning no signature covers: left out, as the
    same-family path leaves it (an empty text block in its place is one Anthropic refuses)."""
    return (message.role == w.ASSISTANT and not message.tool_calls
            and any(p.type in w.REASONING_PARTS for p in message.content)
            and not _blocks(message.content))


# the role a message of these roles is sent under; any other is the user's
_BLOCK_ROLES = {w.ASSISTANT: "assistant", w.SYSTEM: "system"}


def render_messages(
        messages: tuple[w.Message, ...]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(system blocks, messages): Anthropic wants the system prompt apart and roles alternating,
    so consecutive messages of one role (tool results and the user's next words) become one. A
    system message after the conversation began stays at its place, as a `system` message."""
    system: list[dict[str, Any]] = []
    out: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})

    for message in messages:
        if _reasoning_alone(message):
            continue
        if message.role == w.SYSTEM and not out:
            system.extend(b for b in _message_blocks(message) if b["type"] != "text" or b["text"])
        elif message.role == w.TOOL:
            result: dict[str, Any] = {"type": "tool_result", "tool_use_id": message.tool_call_id,
                                      "content": _blocks(message.content)}
            if message.is_error:
                result["is_error"] = True
            add("user", [_cached(result, message.cache_control)])
        else:
            add(_BLOCK_ROLES.get(message.role, "user"), _message_blocks(message))
    return system, out


def _budget(request: w.Request) -> int | None:
    """The thinking budget to send: the one asked for, or (`reasoning_effort`) the effort's.
    Adaptive thinking has none, and Anthropic's own effort goes as `output_config.effort`."""
    reasoning = request.reasoning
    if reasoning is None or reasoning.adaptive:
        return None
    if reasoning.budget_tokens is None and request.source == "anthropic":
        return None
    return reasoning.as_budget()


def _render_effort(request: w.Request, body: dict[str, Any]) -> None:
    """Adaptive thinking, and Anthropic's own effort (an OpenAI `reasoning_effort` is a budget)."""
    reasoning = request.reasoning
    if reasoning is None:
        return
    if reasoning.adaptive:
        body["thinking"] = {"type": "adaptive"}
    if reasoning.effort is not None and request.source == "anthropic":
        body["output_config"] = {**(body.get("output_config") or {}), "effort": reasoning.effort}


def render_request(request: w.Request, model: str, stream: bool,
                   max_output_tokens: int = DEFAULT_MAX_TOKENS) -> dict[str, Any]:
    """The body for an anthropic-family entry: the client's own body when it spoke this dialect,
    else the canonical request translated (docs/wire.md)."""
    if request.passthrough is not None and request.source == "anthropic":
        body = dict(request.passthrough.body)
        body.setdefault("max_tokens", max_output_tokens)
    else:
        body = _translated(request, max_output_tokens)
    body["model"] = model
    body["stream"] = stream
    return body


def _translated(request: w.Request, max_output_tokens: int) -> dict[str, Any]:
    """The canonical request written as a messages body (another dialect's client, or a request
    built by the library)."""
    system, messages = render_messages(request.messages)
    body: dict[str, Any] = {"messages": messages}
    if system:
        plain = all(set(b) == {"type", "text"} for b in system)
        body["system"] = "\n\n".join(b["text"] for b in system) if plain else system
    budget = _budget(request)
    if budget is not None and request.max_tokens:
        # OpenAI's limit counts the reasoning too; Anthropic's budget must stay below max_tokens
        budget = min(budget, request.max_tokens - 1)
    # thinking spends from max_tokens: with no limit asked for, leave room for the answer
    body["max_tokens"] = request.max_tokens or (max_output_tokens + (budget or 0))
    for name in ("temperature", "top_p", "top_k"):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    if request.stop:
        body["stop_sequences"] = list(request.stop)
    if request.tools:
        body["tools"] = [_render_tool(t) for t in request.tools]
    tool_choice = _render_tool_choice(request)
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    if request.user is not None:
        body["metadata"] = {"user_id": request.user}
    if budget is not None:
        body["thinking"] = {"type": "enabled", "budget_tokens": budget}
    if request.source == "anthropic":
        body.update({k: v for k, v in request.extra.items() if "." not in k})
    _render_effort(request, body)
    schema = request.response_format.schema if request.response_format is not None else None
    if schema is not None:  # (beside the client's other output_config fields, if it wrote any)
        body["output_config"] = {**body.get("output_config", {}),
                                 "format": {"type": "json_schema", "schema": dict(schema)}}
    return body


def _render_tool(tool: w.Tool) -> dict[str, Any]:
    block: dict[str, Any] = {"name": tool.name, "description": tool.description,
                             "input_schema": dict(tool.parameters)}
    if tool.strict:
        block["strict"] = True
    return _cached(block, tool.cache_control)


_CHOICE_TYPES = {"auto": "auto", "none": "none", "required": "any", "tool": "tool"}


def _render_tool_choice(request: w.Request) -> dict[str, Any] | None:
    choice = request.tool_choice
    if choice is None and request.parallel_tool_calls is not False:
        return None
    mode = choice.mode if choice is not None else "auto"
    rendered: dict[str, Any] = {"type": _CHOICE_TYPES[mode]}
    if choice is not None and mode == "tool":
        rendered["name"] = choice.name
    if request.parallel_tool_calls is False:
        rendered["disable_parallel_tool_use"] = True
    return rendered

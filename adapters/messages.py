"""Conversation shapes: the turn carries OpenAI-style messages; Anthropic speaks blocks.

Both directions matter: an Anthropic profile serves turns that arrived as OpenAI chat messages
(tool calls and tool results included), and the gateway's Anthropic dialect turns Anthropic
requests into the turn's messages. Text, tool calls and tool results survive both ways; the
system prompt moves between a message and the top-level `system` field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content
                   if isinstance(part, Mapping) and part.get("type") in ("text", "input_text"))


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def openai_to_anthropic(messages: Iterable[Mapping]) -> tuple[str, list[dict]]:
    """(system prompt, Anthropic messages) for OpenAI-style chat messages."""
    system: list[str] = []
    out: list[dict] = []

    def add(role: str, blocks: list[dict]) -> None:
        # Anthropic wants alternating roles: consecutive messages of one role become one
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})

    for message in messages:
        role = message.get("role")
        if role in ("system", "developer"):
            system.append(_text(message.get("content")))
        elif role == "tool":
            add("user", [{"type": "tool_result", "tool_use_id": message.get("tool_call_id", ""),
                          "content": _text(message.get("content"))}])
        elif role == "assistant":
            blocks = [{"type": "text", "text": _text(message.get("content"))}] if _text(message.get("content")) else []
            for call in message.get("tool_calls") or ():
                function = call.get("function") or {}
                blocks.append({"type": "tool_use", "id": call.get("id", ""), "name": function.get("name", ""),
                               "input": _arguments(function.get("arguments", ""))})
            add("assistant", blocks or [{"type": "text", "text": ""}])
        else:
            add("user", [{"type": "text", "text": _text(message.get("content"))}])
    return "\n\n".join(s for s in system if s), out


def anthropic_to_openai(system, messages: Iterable[Mapping]) -> list[dict]:
    """OpenAI-style chat messages for an Anthropic request's `system` and `messages`."""
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": _text(system)})
    for message in messages:
        role, content = message["role"], message["content"]
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        text = _text(content)
        calls = [{"id": b.get("id", ""), "type": "function",
                  "function": {"name": b.get("name", ""), "arguments": json.dumps(b.get("input") or {})}}
                 for b in content if isinstance(b, Mapping) and b.get("type") == "tool_use"]
        results = [b for b in content if isinstance(b, Mapping) and b.get("type") == "tool_result"]
        for result in results:
            out.append({"role": "tool", "tool_call_id": result.get("tool_use_id", ""),
                        "content": _text(result.get("content"))})
        if role == "assistant":
            entry: dict = {"role": "assistant", "content": text or None}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
        elif text or not results:
            out.append({"role": role, "content": text})
    return out

"""Anthropic's token counting (`POST /v1/messages/count_tokens`): the client's body kept as sent,
forwarded to an `anthropic` profile's `{base_url}/v1/messages/count_tokens` with only `model` set,
and the count it answers read back. A count is no completion: it carries no usage, so the ledger
bills nothing for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from relayline.machines import wire as w
from relayline.machines.turn import Completion, TurnResult

from . import shape
from .common import client_headers


def parse_request(body: object, headers: Iterable[tuple[str, str]] = (), query: str = ""
                  ) -> w.Request:
    """A count_tokens body (a messages body without max_tokens) as a counting request; the
    shape is checked as far as routing needs it, the rest is the provider's to judge."""
    body = shape.want_dict(body, "")
    if not shape.want_list(body.get("messages"), "messages"):
        raise w.WireError("messages", "must not be empty")
    kept = w.Passthrough(body, client_headers(headers), query)
    return w.Request(messages=(), model=shape.check_model(body.get("model")), counting=True,
                     source="anthropic", passthrough=kept)


def render_request(request: w.Request, model: str) -> dict[str, Any]:
    assert request.passthrough is not None  # (a counting request always keeps its body)
    return {**request.passthrough.body, "model": model}


def is_count(body: dict[str, Any]) -> bool:
    return "input_tokens" in body and "type" not in body


def parse_reply(body: dict[str, Any]) -> Completion:
    return Completion(input_count=shape.want_int(body.get("input_tokens"), "input_tokens"))


def answer(result: TurnResult, relayline: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": result.input_count, "relayline": relayline}

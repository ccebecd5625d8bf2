"""OpenAI's embeddings API (`POST /v1/embeddings`): a client's body read into the canonical
request, the request written for an `openai` profile's `{base_url}/embeddings`, its answer read
back, and the answer given to the client in the same shape.

Vectors from two models are not interchangeable, so an embeddings turn falls back only to
entries that serve the same model name (the library and the gateway plan it so); the vectors
themselves are passed through as the provider sent them (floats, or base64 when asked).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from relayline.machines import wire as w
from relayline.machines.ledger import Usage
from relayline.machines.turn import Completion, TurnResult

from . import shape

SOURCE = "embeddings"
MAX_INPUTS = 2048  # OpenAI's own bound on one request's inputs
ENCODINGS = ("float", "base64")


def _input(raw: Any) -> str | tuple[str, ...] | tuple[tuple[int, ...], ...]:
    if isinstance(raw, str):
        return raw
    items = shape.want_list(raw, "input")
    if not items:
        raise w.WireError("input", "must not be empty")
    if len(items) > MAX_INPUTS:
        raise w.WireError("input", f"at most {MAX_INPUTS} inputs")
    if all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        return (tuple(items),)  # one token array
    if all(isinstance(i, str) for i in items):
        return tuple(items)
    return tuple(tuple(shape.want_int(t, shape.path(shape.path("input", n), k), 0, 2**31)
                       for k, t in enumerate(shape.want_list(i, shape.path("input", n))))
                 for n, i in enumerate(items))


# what relayline reads of a body, and writes again to the profile
READ = ("input", "model", "dimensions", "encoding_format", "user")


def parse_request(body: object, headers: Iterable[tuple[str, str]] = (), query: str = ""
                  ) -> w.Request:
    """An embeddings body as the canonical request; a body of the wrong shape raises WireError
    naming the field."""
    body = shape.want_dict(body, "")
    encoding = shape.optional(body, "encoding_format", shape.want_str)
    if encoding is not None and encoding not in ENCODINGS:
        raise w.WireError("encoding_format", "must be float or base64")
    dimensions = shape.optional(body, "dimensions", shape.want_int, "", 1, 65536)
    embedding = w.Embedding(_input(body.get("input")), dimensions, encoding)
    # kept whole: the fields relayline does not read (an OpenAI-compatible server's own, such as
    # `input_type`) go to the openai profile as sent, as a chat body's do
    return w.Request(messages=(), model=shape.check_model(body.get("model")),
                     user=shape.optional(body, "user", shape.want_str), embedding=embedding,
                     source=SOURCE, passthrough=w.Passthrough(body))


def render_request(request: w.Request, model: str) -> dict[str, Any]:
    """The body for an openai profile's /embeddings."""
    embedding = request.embedding
    assert embedding is not None  # (only an embeddings turn is rendered here)
    raw = embedding.input
    given = raw if isinstance(raw, str) else [list(i) if isinstance(i, tuple) else i for i in raw]
    sent = request.passthrough.body if request.passthrough is not None else {}
    body: dict[str, Any] = {k: v for k, v in sent.items() if k not in READ}
    body.update(input=given, model=model)
    if isinstance(raw, tuple) and len(raw) == 1 and isinstance(raw[0], tuple):
        body["input"] = list(raw[0])  # one token array, as the client sent it
    if embedding.dimensions is not None:
        body["dimensions"] = embedding.dimensions
    if embedding.encoding_format is not None:
        body["encoding_format"] = embedding.encoding_format
    if request.user is not None:
        body["user"] = request.user
    return body


def is_embeddings(body: dict[str, Any]) -> bool:
    return body.get("object") == "list" and isinstance(body.get("data"), list)


def parse_reply(body: dict[str, Any]) -> Completion:
    """A provider's embeddings answer: its items as sent, and the input tokens it billed."""
    data = shape.want_list(body.get("data"), "data")
    for i, item in enumerate(data):
        item = shape.want_dict(item, shape.path("data", i))
        if not isinstance(item.get("embedding"), list | str):
            raise w.WireError(shape.path(shape.path("data", i), "embedding"),
                              "expected a list of numbers or base64 text")
    usage = shape.optional(body, "usage", shape.want_dict) or {}
    tokens = shape.optional(usage, "prompt_tokens", shape.want_int, "usage") or 0
    return Completion(usage=Usage(tokens, 0), vectors=tuple(data))


def answer(result: TurnResult, relayline: dict[str, Any]) -> dict[str, Any]:
    usage = result.usage or Usage()
    return {"object": "list", "data": [dict(v) for v in result.vectors],
            "model": result.served.model if result.served else "",
            "usage": {"prompt_tokens": usage.input_tokens, "total_tokens": usage.input_tokens},
            "relayline": relayline}

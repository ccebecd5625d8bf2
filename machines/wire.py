"""The canonical request and response: what a client asked for and what a provider said, in one
shape that both client dialects and both provider families translate to and from.

The walk, the gate and the ledger see only this model, never dialect JSON. A request remembers
the dialect it was written in (`source`) and, from the gateway, the client's own body
(`passthrough`): a same-family entry is sent that body with only model/stream/stream_options set,
so fields relayline does not know still reach the provider. Across families only what the model
holds is translated, and `unsupported` names what an entry cannot honour, so the walk skips that
entry (or, with `drop_unsupported_params`, the adapter drops those fields and says so) instead of
sending a request with a parameter silently gone.

Values are frozen attrs classes; `converter` structures them from plain data with the same strict
rules as the config (a string is not a number) for embedders who build requests as dicts.
"""

from __future__ import annotations

import functools
import json
import typing
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from .config import Capabilities, _strict

# the config's strict scalar rules (a string is not a number) serve the canonical model too
from .config import _describe as config_describe
from .errors import RelaylineError

SYSTEM, USER, ASSISTANT, TOOL = "system", "user", "assistant", "tool"
# the Responses API's dialect: no family of its own, an openai profile may serve it
RESPONSES = "responses"
TEXT, IMAGE, DOCUMENT = "text", "image", "document"
# reasoning an earlier assistant turn showed, sent back in the history: Anthropic wants a tool
# turn's thinking back with the signature its provider gave (a redacted block: its opaque data)
THINKING, REDACTED_THINKING = "thinking", "redacted_thinking"
REASONING_PARTS = (THINKING, REDACTED_THINKING)

# finish reasons, canonical (OpenAI's words, with stop_sequence kept apart for Anthropic clients,
# and Anthropic's pause_turn: a server tool turn its client must continue)
STOP, STOP_SEQUENCE, LENGTH = "stop", "stop_sequence", "length"
TOOL_CALLS, CONTENT_FILTER = "tool_calls", "content_filter"
PAUSE = "pause_turn"
FINISH_REASONS = (STOP, STOP_SEQUENCE, LENGTH, TOOL_CALLS, CONTENT_FILTER, PAUSE)

# reasoning_effort <-> thinking.budget_tokens (docs/wire.md)
EFFORT_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384}
MIN_BUDGET = EFFORT_BUDGETS["low"]  # Anthropic's least thinking budget


class WireError(RelaylineError):
    """A body of the wrong shape. `param` names the field, in the client's own notation."""

    reason = "invalid_request"

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.detail = message


@attrs.frozen
class Part:
    """One content part: text, an image (by URL or base64 with its media type), a document, or
    reasoning an assistant turn showed (thinking, with its signature; redacted thinking)."""

    type: str = TEXT
    text: str = ""
    url: str | None = None
    data: str | None = None  # base64 (a redacted thinking block's: its opaque data)
    media_type: str | None = None
    extra: tuple[str, ...] = ()  # fields of the part relayline does not translate (citations...)
    # a thinking part's signature as its provider gave it; "" when it has none (reasoning from a
    # provider that signs nothing), and then no Anthropic provider can take it back
    signature: str = ""
    cache_control: Mapping[str, Any] | None = None  # a caching hint, as the client wrote it
    # a document's name: OpenAI's file.filename, Anthropic's document title
    title: str | None = None


@attrs.frozen
class ToolCall:
    id: str
    name: str
    arguments: str = "{}"  # JSON text, as the provider sent it
    cache_control: Mapping[str, Any] | None = None  # (an Anthropic tool_use block's)

    @functools.cached_property
    def as_object(self) -> dict[str, Any] | None:
        """The arguments as the JSON object they must be (`json_object`), parsed once: each
        entry's fit check and the Anthropic render read them for every attempt."""
        return json_object(self.arguments)


@attrs.frozen
class Message:
    role: str
    content: tuple[Part, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # a tool result answers this call
    is_error: bool = False
    # a caching hint on the whole message (OpenAI clients') or on an Anthropic tool_result block
    cache_control: Mapping[str, Any] | None = None

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content if p.type == TEXT)


@attrs.frozen
class Tool:
    name: str
    description: str = ""
    parameters: Mapping[str, Any] = attrs.field(factory=lambda: {"type": "object"})
    strict: bool = False  # the call's arguments always match `parameters` (structured outputs)
    cache_control: Mapping[str, Any] | None = None


@attrs.frozen
class ToolChoice:
    mode: str  # auto | none | required | tool
    name: str | None = None


@attrs.frozen
class ResponseFormat:
    type: str  # text | json_object | json_schema
    # OpenAI's json_schema object: name, schema, strict...
    json_schema: Mapping[str, Any] | None = None

    @property
    def schema(self) -> Mapping[str, Any] | None:
        """The JSON schema the answer must match (a json_schema format that gives one)."""
        form = self.json_schema if self.type == "json_schema" else None
        schema = form.get("schema") if form is not None else None
        return schema if isinstance(schema, Mapping) else None


@attrs.frozen
class Reasoning:
    effort: str | None = None  # OpenAI reasoning_effort, Anthropic output_config.effort
    budget_tokens: int | None = None  # Anthropic thinking.budget_tokens
    adaptive: bool = False  # Anthropic thinking.type adaptive: the model decides how much to think

    def as_effort(self) -> str | None:
        if self.effort is not None or self.budget_tokens is None:
            return self.effort
        budget = self.budget_tokens
        return "low" if budget < 2048 else "medium" if budget < 8192 else "high"

    def as_budget(self) -> int | None:
        if self.budget_tokens is not None:
            return self.budget_tokens
        return EFFORT_BUDGETS.get(self.effort or "")


@attrs.frozen
class Embedding:
    """What an embeddings request asks for: its input (a string, strings, or token arrays, as
    the client wrote it) and the vectors' shape."""

    input: str | tuple[str, ...] | tuple[tuple[int, ...], ...]
    dimensions: int | None = None
    encoding_format: str | None = None  # float | base64


class ReadBytes:
    """The bytes a client's body was read from, held with the very object they were read as
    (`body`), so that a body replaced since (a prefill, dropped fields: a new object) is never
    sent as those bytes. Taken once, by the first upstream request built (the adapters'; nothing
    in machines/ takes them): a turn's request lives as long as its stream, and the bytes would
    be a second copy of the prompt all that time. The tie is the body's identity, so a body is
    never changed in place (every change here and in the codecs makes a new one); a request
    evolved from another shares the holder, as it is the same turn's."""

    __slots__ = ("body", "data")

    def __init__(self, body: Mapping[str, Any], data: bytes) -> None:
        self.body: Mapping[str, Any] | None = body
        self.data: bytes | None = data

    def take(self, body: Mapping[str, Any] | None) -> bytes | None:
        """The bytes, if `body` is the object they were read as; held no more either way."""
        data = self.data if body is not None and body is self.body else None
        self.body = self.data = None
        return data


@attrs.frozen
class Passthrough:
    """What the client sent that may reach a provider as it was sent: its body (to a provider of
    its own family), the request headers that may travel (names lowercase; which of them reach
    an entry is the entry's: `CallRequest.forwarded_headers`) and the query of its URL (to a
    provider of its own family). `read`, from the gateway, holds the bytes the body was read
    from, when they can be sent as they are (orjson read them: `jsoncodec.loads_read`)."""

    body: Mapping[str, Any]
    headers: tuple[tuple[str, str], ...] = ()
    query: str = ""  # the URL's query, without its "?" (Claude Code posts /v1/messages?beta=true)
    read: ReadBytes | None = attrs.field(default=None, eq=False, repr=False)


class History:
    """A request's messages, read from the client's body the first time something asks for them.

    A client's body sent on to a provider of its own dialect is sent as it came: the canonical
    messages are then read only by what needs them (a translation, an image or token count, the
    turn's text...), and most turns never build them. The codec has already checked the whole
    body, refusing what it would refuse reading it, before it hands `read` over (taking only
    shapes whose reading cannot fail), and the body, the request's own, is never changed after.
    Read once, then held. The reader is kept (it holds only the body, which the passthrough
    holds anyway): two threads reading at once both read, and either result is the same."""

    __slots__ = ("_read", "_messages")

    def __init__(self, read: Callable[[], tuple[Message, ...]]) -> None:
        self._read = read
        self._messages: tuple[Message, ...] | None = None

    def messages(self) -> tuple[Message, ...]:
        messages = self._messages
        if messages is None:
            messages = self._messages = self._read()
        return messages

    def __reduce__(self) -> tuple[type[tuple[Message, ...]], tuple[tuple[Message, ...]]]:
        # pickled as the messages themselves: a reader is a function of the codec's
        return tuple, (self.messages(),)


def _held(messages: tuple[Message, ...] | History) -> tuple[Message, ...]:
    """The messages a request holds, read if they are not yet (what its equality compares)."""
    return messages if isinstance(messages, tuple) else messages.messages()


@attrs.frozen
class Request:
    # the messages, or a History that reads them when first asked (`messages`); built with
    # `Request(messages=...)`, evolved with `attrs.evolve(request, messages=...)`
    _messages: tuple[Message, ...] | History = attrs.field(
        eq=_held, repr=lambda held: repr(_held(held)))
    model: str | None = None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: the client wants a usage chunk
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning: Reasoning | None = None
    user: str | None = None
    # fields one family has and the canonical model does not translate (seed, logprobs, metadata
    # beyond user_id, service_tier...), as the source dialect wrote them
    extra: Mapping[str, Any] = attrs.field(factory=dict)
    source: str = "openai"  # the dialect the request was written in
    passthrough: Passthrough | None = None
    # optional capabilities the client offered that a translating entry does not offer the model
    # (a Responses client's built-in tools): named to the client, never an unsupported skip
    withdrawn: tuple[str, ...] = ()
    embedding: Embedding | None = None  # an embeddings turn: vectors for this input, no messages
    counting: bool = False  # a token counting turn: the client's body counted, nothing answered

    @property
    def messages(self) -> tuple[Message, ...]:
        held = self._messages
        return held if isinstance(held, tuple) else held.messages()

    @property
    def has_images(self) -> bool:
        return any(p.type == IMAGE for m in self.messages for p in m.content)

    @property
    def prompt_chars(self) -> int:
        """The characters of text the request sends a model (messages, tool calls and results,
        tool definitions): what an estimate of its input tokens reads. Images and documents are
        not counted (their tokens depend on the model)."""
        chars = 0
        for message in self.messages:
            chars += sum(len(p.text) for p in message.content if p.type == TEXT)
            chars += sum(len(call.name) + len(call.arguments) for call in message.tool_calls)
        for tool in self.tools:
            chars += len(tool.name) + len(tool.description) + len(repr(tool.parameters))
        return chars

    @property
    def turn_text(self) -> str:
        """The user's turn text (effort routing reads it): the last user message's text."""
        for message in reversed(self.messages):
            if message.role == USER and message.tool_call_id is None:
                return " ".join(p.text for p in message.content if p.type == TEXT)
        return ""

    def with_prefill(self, text: str) -> Request:
        """This request continued from exactly `text`: a trailing assistant message."""
        messages = (*self.messages, Message(ASSISTANT, (Part(TEXT, text),)))
        passthrough = self.passthrough
        if passthrough is not None:
            body = dict(passthrough.body)
            body["messages"] = [*body.get("messages", ()), {"role": "assistant", "content": text}]
            passthrough = attrs.evolve(passthrough, body=body)
        return attrs.evolve(self, messages=messages, passthrough=passthrough)


def json_object(text: str) -> dict[str, Any] | None:
    """A tool call's JSON arguments as the object they must be ("" is no arguments); None when
    they are not one (cut short, a list...): an Anthropic `tool_use.input` has no place for them."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def passes_through(request: Request, family: str, capabilities: Capabilities) -> bool:
    """Whether an entry of `family` is sent the client's own body: it speaks the request's
    dialect (a Responses client and an openai profile that serves the Responses API)."""
    return family == request.source or (request.source == RESPONSES and family == "openai"
                                        and capabilities.responses)


# the highest temperature Anthropic takes (OpenAI's range is 0..2)
ANTHROPIC_MAX_TEMPERATURE = 1


def unsupported(request: Request, family: str, capabilities: Capabilities) -> tuple[str, ...]:
    """The request fields an entry of `family` with `capabilities` cannot honour (docs/wire.md),
    by name. Empty: the entry can serve the request as asked."""
    if request.counting:
        return () if family == "anthropic" else ("count_tokens",)  # only Anthropic's API counts
    if request.embedding is not None:
        # vectors come from an openai profile's embeddings API; no other family has one
        return () if family == "openai" and capabilities.embeddings else ("embeddings",)
    names: list[str] = []
    # (the capability first: it reads no message)
    if not capabilities.vision and request.has_images:
        names.append("image")
    if not capabilities.tools and (request.tools or any(name.startswith("tools.")
                                                        for name in request.extra)):
        names.append("tools")  # (also tools relayline does not read: server tools, custom tools)
    if not capabilities.structured_outputs:
        names.extend(structured_outputs(request))
    if family not in ("openai", "anthropic") or passes_through(request, family, capabilities):
        return tuple(names)  # the sim family takes anything; the same dialect gets the body as sent
    names.extend(request.extra)
    names.extend(x for m in request.messages for p in m.content for x in p.extra)
    if family == "openai":
        if request.top_k is not None:
            names.append("top_k")
        if any(p.type == DOCUMENT and p.data is None for m in request.messages for p in m.content):
            names.append("document.source.url")
        if any(m.is_error for m in request.messages):
            names.append("tool_result.is_error")
        effort = None if request.reasoning is None else request.reasoning.effort
        if effort not in (None, *EFFORT_BUDGETS):
            names.append("output_config.effort")  # (max: no reasoning_effort says as much)
        last = request.messages[-1] if request.messages else None
        if (last is not None and last.role == ASSISTANT and not last.tool_calls
                and not capabilities.prefill):
            # Anthropic continues a trailing assistant message; a chat completions server answers
            # anew, and the client would join its answer to the text it asked to be continued
            names.append("prefill")
        # an OpenAI tool message holds text alone: an image or document a tool gave back has no
        # place
        names.extend(dict.fromkeys(f"tool_result.content.{p.type}" for m in request.messages
                                   if m.role == TOOL for p in m.content if p.type != TEXT))
    else:
        form = request.response_format
        if form is not None and form.type != "text" and form.schema is None:
            # JSON mode, or a json_schema without a schema: no equivalent
            names.append("response_format")
        elif (form is not None and form.json_schema is not None
              and form.json_schema.get("description")):
            # an output format has no description
            names.append("response_format.json_schema.description")
        if request.reasoning is not None and (request.reasoning.as_budget() is None or (
                request.max_tokens is not None and request.max_tokens <= MIN_BUDGET)):
            names.append("reasoning_effort")  # (a limit that leaves no room for the least budget)
        if any(c.as_object is None for m in request.messages for c in m.tool_calls):
            names.append("messages.tool_calls.function.arguments")
        if request.temperature is not None and request.temperature > ANTHROPIC_MAX_TEMPERATURE:
            names.append("temperature")  # OpenAI's reaches 2; Anthropic refuses one above 1
    return tuple(dict.fromkeys(names))


# a strict tool and a JSON schema output format, in each dialect's words
STRUCTURED_NAMES = {"openai": ("tools.function.strict", "response_format"),
                    "anthropic": ("tools.strict", "output_config.format"),
                    RESPONSES: ("tools.strict", "text.format")}


def structured_outputs(request: Request) -> list[str]:
    """The names of the structured outputs `request` asks for, in its dialect: strict tools, an
    answer that must match a JSON schema (what `capabilities.structured_outputs` covers)."""
    strict, schema = STRUCTURED_NAMES.get(request.source, STRUCTURED_NAMES["openai"])
    names = [strict] if any(t.strict for t in request.tools) else []
    if request.response_format is not None and request.response_format.type == "json_schema":
        names.append(schema)
    return names


# an OpenAI file part that names an uploaded file by its id: only OpenAI holds the file
OPENAI_FILE_ID = "content.file.file_id"


# -- responses ------------------------------------------------------------------------------------


def finish_reason(reason: str | None, tool_calls: int) -> str:
    """The canonical finish reason of an answer: the provider's, else what the answer shows. An
    answer that asks for tools and says `stop` (Gemini's OpenAI-compatible stream does) ended to
    have them run: a client's tool loop waits for `tool_calls` (`tool_use`) to go on."""
    if reason == STOP and tool_calls:
        return TOOL_CALLS
    if reason in FINISH_REASONS:
        return reason
    return TOOL_CALLS if tool_calls else STOP


def describe(value: object) -> str:
    """A JSON value's kind in a client's words: null, a string, an object..."""
    if value is None:
        return "null"
    return "an object" if isinstance(value, dict) else config_describe(value)


# -- structuring from plain data (embedders) --------------------------------------------------

converter = cattrs.Converter(forbid_extra_keys=True)


for _kind, _label in ((str, "a string"), (int, "an integer"), (float, "a number"),
                      (bool, "a boolean")):
    converter.register_structure_hook(_kind, _strict(_kind, _label))
# an object-valued field (extra, parameters, json_schema): the JSON object as given. Registered by
# origin: a hook for the bare Mapping would not match Mapping[str, Any], and cattrs' own would call
# .items() on a string or array and fail with an AttributeError's text
converter.register_structure_hook_func(
    lambda t: t is Mapping or typing.get_origin(t) is Mapping,  # type: ignore[comparison-overlap]
    lambda v, _t: v if isinstance(v, dict) else _bad_mapping(v),
)
# a request's messages: given as data, never a History (a codec's)
converter.register_structure_hook_func(
    lambda t: t == tuple[Message, ...] | History,
    lambda v, _t: converter.structure(v, tuple[Message, ...]),
)
converter.register_structure_hook_func(
    lambda t: typing.get_origin(t) is tuple,  # type: ignore[comparison-overlap]
    lambda v, t: tuple(converter.structure(x, typing.get_args(t)[0]) for x in _as_list(v)),
)


def _bad_mapping(value: object) -> NoReturn:
    raise ValueError(f"expected an object, got {describe(value)}")


def _as_list(value: object) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"expected a list, got {describe(value)}")
    return list(value)


# a request's messages are the `messages` key (its attribute is private: it may hold a History)
converter.register_structure_hook(Request, make_dict_structure_fn(
    Request, converter, _cattrs_forbid_extra_keys=True, _messages=override(rename="messages")))
converter.register_unstructure_hook(Request, make_dict_unstructure_fn(
    Request, converter, _messages=override(rename="messages",
                                           unstruct_hook=lambda held: converter.unstructure(
                                               _held(held), tuple[Message, ...]))))

"""What providers and clients send, read and classified: failure classes from what real providers
send, and the canonical wire model's own rules (the reasoning conversions, the continuation
prefill, dropping unsupported fields, the checks every dialect body and provider reply is read
with), directly; the gateway tests show the same through both dialects."""

import email.utils
import json

import attrs
import pytest

from relayline.adapters.codecs.shape import (
    MAX_MODEL_CHARS,
    check_model,
    extras,
    optional,
    path,
    want,
    want_bool,
    want_dict,
    want_int,
    want_list,
    want_number,
    want_str,
)
from relayline.machines import classify as fc
from relayline.machines.dropping import droppable, is_content, refused, without
from relayline.machines.ledger import MAX_TOKENS
from relayline.machines.wire import (
    ASSISTANT,
    DOCUMENT,
    IMAGE,
    TEXT,
    USER,
    Message,
    Part,
    Passthrough,
    Reasoning,
    Request,
    ResponseFormat,
    Tool,
    ToolChoice,
    WireError,
    describe,
    finish_reason,
)


@pytest.mark.parametrize("status,body,kind", [
    (503, None, fc.RETRYABLE),
    (500, "internal error", fc.RETRYABLE),
    (502, None, fc.RETRYABLE),
    (408, None, fc.RETRYABLE),
    (529, '{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}', fc.RETRYABLE),
    (429, '{"error":{"type":"rate_limit_error"}}', fc.RATE_LIMITED),
    (429, '{"error":{"code":"insufficient_quota","message":"You exceeded your current quota"}}', fc.QUOTA),
    (402, '{"error":{"message":"Insufficient credits"}}', fc.QUOTA),
    (400, "Your credit balance is too low to access the Anthropic API", fc.QUOTA),
    (403, "The model is not available on your current plan", fc.QUOTA),
    # context windows, as OpenAI, Anthropic, OpenRouter, Groq, vLLM, Ollama, llama.cpp word them
    (400, '{"error":{"code":"context_length_exceeded"}}', fc.CONTEXT_WINDOW),
    (400, "prompt is too long: 210000 tokens > 200000 maximum", fc.CONTEXT_WINDOW),
    (400, "This endpoint's maximum context length is 128000 tokens", fc.CONTEXT_WINDOW),
    (400, "Please reduce the length of the messages or completion.", fc.CONTEXT_WINDOW),
    (400, "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens", fc.CONTEXT_WINDOW),
    (400, "input length exceeds maximum context length", fc.CONTEXT_WINDOW),
    (500, "the request exceeds the available context size, try increasing it", fc.CONTEXT_WINDOW),
    (401, '{"error":{"code":"invalid_api_key"}}', fc.REJECTED),
    (404, "model_not_found", fc.REJECTED),
    (422, None, fc.REJECTED),
    # content policy: a refusal (the turn keeps it a rejection unless on_refusal = "advance")
    (400, "content_policy_violation", fc.REFUSED),
    (400, '{"error":{"code":"content_filter","message":"The response was filtered"}}', fc.REFUSED),
    (400, '{"error":{"message":"Your request was rejected as a result of our safety system","code":'
          '"content_policy_violation","type":"invalid_request_error"}}', fc.REFUSED),
    (403, "content_policy_violation", fc.REJECTED),  # only a 400 names a refusal
])
def test_http_classification(status, body, kind):
    assert fc.classify_http(status, body).kind == kind


def test_detail_never_carries_the_provider_body():
    failure = fc.classify_http(500, "secret-ish provider text sk-abc")
    assert "sk-abc" not in failure.detail and "provider text" not in failure.detail


def test_retry_after_seconds_ms_and_http_date():
    assert fc.parse_retry_after({"Retry-After": "7"}) == 7.0
    assert fc.parse_retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    now = 1_700_000_000.0
    date = email.utils.formatdate(now + 42, usegmt=True)
    assert fc.parse_retry_after({"Retry-After": date}, now_epoch=now) == pytest.approx(42, abs=1)
    assert fc.parse_retry_after({"Retry-After": "soon"}) is None
    assert fc.parse_retry_after({"Retry-After": "-3"}) is None


def test_a_429_carries_its_retry_after():
    assert fc.classify_http(429, None, {"retry-after": "12"}).retry_after_s == 12.0


@pytest.mark.parametrize("error,kind", [
    ("overloaded_error", fc.RETRYABLE),
    ("api_error", fc.RETRYABLE),
    ("rate_limit_error", fc.RATE_LIMITED),
    ("invalid_request_error", fc.REJECTED),
    ("content_filter", fc.REFUSED),
])
def test_in_band_stream_errors(error, kind):
    assert fc.classify_stream_error(error).kind == kind


F = fc.Failure


@pytest.mark.parametrize("status, body, headers, failure", [
    (503, None, {"retry-after": "3"}, F(fc.RETRYABLE, "HTTP 503", 503, 3.0)),
    (409, None, None, F(fc.RETRYABLE, "HTTP 409", 409)),
    (425, None, None, F(fc.RETRYABLE, "HTTP 425", 425)),
    (500, None, None, F(fc.RETRYABLE, "HTTP 500", 500)),
    (499, None, None, F(fc.REJECTED, "HTTP 499", 499)),
    (400, None, {"retry-after": "3"}, F(fc.REJECTED, "HTTP 400", 400)),
    (429, None, {"retry-after-ms": "250"}, F(fc.RATE_LIMITED, "HTTP 429 rate limited", 429, 0.25)),
    (413, "Request too large: input is too long", None, F(fc.CONTEXT_WINDOW, "HTTP 413 context window exceeded", 413)),
    (422, "n_ctx exceeded", None, F(fc.CONTEXT_WINDOW, "HTTP 422 context window exceeded", 422)),
    (500, "CONTEXT WINDOW exceeded", None, F(fc.CONTEXT_WINDOW, "HTTP 500 context window exceeded", 500)),
    (503, "context length", None, F(fc.RETRYABLE, "HTTP 503", 503)),  # an outage that names context
    (401, "context_length_exceeded", None, F(fc.REJECTED, "HTTP 401", 401)),
    (429, "INSUFFICIENT_QUOTA", {"retry-after": "9"}, F(fc.QUOTA, "HTTP 429 quota or billing", 429)),
    (402, "payment required", None, F(fc.QUOTA, "HTTP 402 quota or billing", 402)),
    (400, "upgrade your plan", None, F(fc.QUOTA, "HTTP 400 quota or billing", 400)),
    (500, "billing system down", None, F(fc.RETRYABLE, "HTTP 500", 500)),  # a 5xx is an outage, whatever it says
    (400, "Content Policy", None, F(fc.REFUSED, "HTTP 400 content policy", 400)),
    (422, "content_filter", None, F(fc.REJECTED, "HTTP 422", 422)),
])
def test_an_http_failure_is_its_class_detail_status_and_wait(status, body, headers, failure):
    assert fc.classify_http(status, body, headers) == failure


@pytest.mark.parametrize("error, failure", [
    # Anthropic's in-band error types
    ("overloaded_error", F(fc.RETRYABLE, "stream error: overloaded")),
    ("api_error", F(fc.RETRYABLE, "stream error: overloaded")),
    ("rate_limit_error", F(fc.RATE_LIMITED, "stream error: rate limited")),
    ("invalid_request_error", F(fc.REJECTED, "stream error: invalid_request_error")),
    ("authentication_error", F(fc.REJECTED, "stream error: authentication_error")),
    ("permission_error", F(fc.REJECTED, "stream error: permission_error")),
    ("not_found_error", F(fc.REJECTED, "stream error: not_found_error")),
    # OpenAI-compatible chunk error codes and messages, in any case
    ("Invalid_Request_Error", F(fc.REJECTED, "stream error: invalid_request_error")),
    ("RATE_LIMIT_EXCEEDED", F(fc.RATE_LIMITED, "stream error: rate limited")),
    ("server_error", F(fc.RETRYABLE, "stream error: overloaded")),
    ("Service Unavailable", F(fc.RETRYABLE, "stream error: overloaded")),
    ("upstream timeout", F(fc.RETRYABLE, "stream error: overloaded")),
    ("context_length_exceeded", F(fc.CONTEXT_WINDOW, "stream error: context window exceeded")),
    ("insufficient_quota", F(fc.QUOTA, "stream error: quota or billing")),
    ("content_policy_violation", F(fc.REFUSED, "stream error: content policy")),
    ("invalid_request_error: bad field", F(fc.RETRYABLE, "stream error")),  # a code, not a sentence
    ("something odd", F(fc.RETRYABLE, "stream error")),
    ("", F(fc.RETRYABLE, "stream error")),
    (None, F(fc.RETRYABLE, "stream error")),
])
def test_an_in_band_stream_error_is_its_class_and_detail(error, failure):
    assert fc.classify_stream_error(error) == failure


@pytest.mark.parametrize("headers, now, seconds", [
    (None, None, None), ({}, None, None), ({"x-other": "1"}, None, None),
    ({"Retry-After-Ms": "0"}, None, 0.0), ({"retry-after-ms": "-5", "retry-after": "4"}, None, 4.0),
    ({"retry-after-ms": "soon", "retry-after": "4"}, None, 4.0), ({"retry-after": " 2.5 "}, None, 2.5),
    ({"retry-after": "0"}, None, 0.0),
    ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, None, None),  # a date needs a clock
    ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, 1445412480.0 + 60, 0.0),  # in the past: now
    ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, 1445412480.0 - 30, 30.0),
])
def test_retry_after_edges(headers, now, seconds):
    assert fc.parse_retry_after(headers, now) == seconds


def test_the_failures_relayline_names_itself():
    assert fc.malformed("choices[0]") == F(fc.MALFORMED, "malformed response: choices[0]")
    assert fc.connection_error() == F(fc.RETRYABLE, "connection error")
    assert fc.truncated() == F(fc.RETRYABLE, "stream truncated before its completion signal")
    assert fc.truncated("cut") == F(fc.RETRYABLE, "cut")
    assert fc.timed_out("first byte", 2.5) == F(fc.TIMEOUT, "no first byte within 2.5s")
    assert fc.too_large(1024) == F(fc.TOO_LARGE, "response larger than limits.max_response_bytes (1024 bytes)")
    assert fc.too_large(9, "frame") == F(fc.TOO_LARGE, "frame larger than limits.max_response_bytes (9 bytes)")
    assert fc.internal(KeyError("sk-secret")) == F(fc.INTERNAL, "internal error (KeyError)")
    assert fc.BREAKER_CLASSES == {fc.RETRYABLE, fc.MALFORMED, fc.TIMEOUT}


@pytest.mark.parametrize("reasoning, effort, budget", [
    (Reasoning(effort="medium"), "medium", 4096),
    (Reasoning(effort="low", budget_tokens=9000), "low", 9000),  # each side keeps what it was given
    (Reasoning(budget_tokens=2047), "low", 2047),
    (Reasoning(budget_tokens=2048), "medium", 2048),
    (Reasoning(budget_tokens=8191), "medium", 8191),
    (Reasoning(budget_tokens=8192), "high", 8192),
    (Reasoning(effort="high"), "high", 16384),
    (Reasoning(effort="low"), "low", 1024),
    (Reasoning(effort="minimal"), "minimal", None),
    (Reasoning(), None, None),
])
def test_reasoning_converts_between_effort_and_budget(reasoning, effort, budget):
    assert (reasoning.as_effort(), reasoning.as_budget()) == (effort, budget)


def test_a_prefill_is_a_trailing_assistant_message_in_the_model_and_in_the_clients_body():
    request = Request((Message(USER, (Part(TEXT, "hi"),)),),
                      passthrough=Passthrough({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, (("a", "b"),)))
    continued = request.with_prefill("Once upon")
    assert continued.messages[:-1] == request.messages
    assert continued.messages[-1] == Message(ASSISTANT, (Part(TEXT, "Once upon"),))
    assert continued.passthrough == Passthrough(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]},
        (("a", "b"),))
    assert request.passthrough.body["messages"] == [{"role": "user", "content": "hi"}]  # the original is untouched
    bare = Request((Message(USER, (Part(TEXT, "hi"),)),)).with_prefill("x")
    assert bare.passthrough is None and bare.messages[-1].text == "x"
    assert Request((), passthrough=Passthrough({})).with_prefill("x").passthrough.body == {
        "messages": [{"role": "assistant", "content": "x"}]}


FULL = Request(
    (Message(USER, (Part(TEXT, "look"), Part(IMAGE, url="http://i"), Part(DOCUMENT, url="http://d"),
                    Part(DOCUMENT, data="ZGF0YQ==", media_type="application/pdf"))),
     Message("tool", (Part(TEXT, "oops"),), tool_call_id="t1", is_error=True)),
    top_k=5, tools=(Tool("lookup"),), tool_choice=ToolChoice("auto"), parallel_tool_calls=False,
    response_format=ResponseFormat("json_object"), reasoning=Reasoning(effort="low"),
    extra={"seed": 1, "service_tier": "flex"}, passthrough=Passthrough({"model": "m"}),
)


def test_dropping_nothing_keeps_the_request_as_sent():
    assert without(FULL, ()) is FULL


def test_dropping_each_field_removes_exactly_it():
    kept = without(FULL, ("seed",))
    # (the client's body, which only its own family gets, is edited only for tools and structured outputs)
    assert kept.passthrough == FULL.passthrough and kept.extra == {"service_tier": "flex"}
    assert kept.messages == FULL.messages and kept.tools == FULL.tools and kept.top_k == 5
    assert (kept.response_format, kept.reasoning) == (FULL.response_format, FULL.reasoning)
    # content is never dropped: an entry that cannot take it is skipped instead (dropping.refused)
    assert without(FULL, ("image", "document.source.url", "prefill", "tool_result.content.image")) is FULL
    assert without(FULL, ("image", "seed")).messages == FULL.messages
    assert without(FULL, ("tool_result.is_error",)).messages[1].is_error is False
    assert without(FULL, ("top_k",)).messages[1].is_error is True
    no_tools = without(FULL, ("tools",))
    assert (no_tools.tools, no_tools.tool_choice, no_tools.parallel_tool_calls) == ((), None, None)
    assert without(FULL, ("top_k",)).top_k is None and without(FULL, ("top_k",)).tools == FULL.tools
    assert without(FULL, ("response_format",)).response_format is None
    assert without(FULL, ("reasoning_effort",)).reasoning is None
    assert without(FULL, ("response_format",)).reasoning == Reasoning(effort="low")
    everything = without(FULL, ("top_k", "response_format", "reasoning_effort", "seed", "service_tier"))
    assert (everything.top_k, everything.response_format, everything.reasoning, everything.extra) == (None, None, None, {})
    assert everything.tool_choice == ToolChoice("auto") and everything.parallel_tool_calls is False


STRICT_TOOL = {"type": "function", "function": {"name": "f", "parameters": {}, "strict": True}}


@pytest.mark.parametrize("source, strict, schema, body", [
    ("openai", "tools.function.strict", "response_format",
     {"tools": [STRICT_TOOL, "not a tool", {"type": "custom"}], "response_format": {"type": "json_schema"}}),
    ("anthropic", "tools.strict", "output_config.format",
     {"tools": [{"name": "f", "input_schema": {}, "strict": True}],
      "output_format": {"type": "json_schema"}, "output_config": {"format": {}, "effort": "low"}}),
    ("responses", "tools.strict", "text.format",
     {"tools": [{"type": "function", "name": "f", "parameters": {}, "strict": True}], "tool_choice": "auto",
      "parallel_tool_calls": False, "text": {"format": {"type": "json_schema"}, "verbosity": "low"}}),
])
def test_a_profile_without_structured_outputs_drops_strictness_and_the_schema_alone(source, strict, schema, body):
    from relayline.machines.config import Capabilities
    from relayline.machines.wire import structured_outputs, unsupported

    request = Request((Message(USER, (Part(TEXT, "q"),)),), source=source, tools=(Tool("f", strict=True),),
                      response_format=ResponseFormat("json_schema", {"name": "w", "schema": {}}),
                      passthrough=Passthrough(body))
    assert structured_outputs(request) == [strict, schema]
    assert structured_outputs(attrs.evolve(request, response_format=ResponseFormat("json_object"))) == [strict]
    assert structured_outputs(attrs.evolve(request, tools=(Tool("f"),))) == [schema]
    assert unsupported(request, "sim", Capabilities(structured_outputs=False)) == (strict, schema)
    kept = without(request, (strict,))
    assert kept.tools == (Tool("f"),) and kept.response_format == request.response_format
    assert without(request, (schema,)).tools == request.tools  # still strict
    if source == "openai":
        assert kept.passthrough.body == {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}},
                                                   "not a tool", {"type": "custom"}],
                                         "response_format": {"type": "json_schema"}}
        assert without(request, (schema,)).passthrough.body == {"tools": body["tools"]}
    elif source == "anthropic":
        assert kept.passthrough.body["tools"] == [{"name": "f", "input_schema": {}}]
        assert without(request, (schema,)).passthrough.body == {"tools": body["tools"],
                                                                 "output_config": {"effort": "low"}}
    else:  # a Responses tool carries strict at its top level, the schema is text.format
        assert kept.passthrough.body == {**body, "tools": [{"type": "function", "name": "f", "parameters": {}}]}
        assert without(request, (schema,)).passthrough.body == {**body, "text": {"verbosity": "low"}}
    # tools dropped whole take their choice with them, in the client's own words
    no_tools = without(request, ("tools",)).passthrough.body
    assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(no_tools)


@pytest.mark.parametrize("name, content", [
    ("image", True), ("prefill", True), ("document.source.url", True), ("document.source.text", True),
    ("image.source.file", True), ("tool_result.content.image", True), ("content.input_audio", True),
    ("content.server_tool_use", True), ("messages.tool_calls.function.arguments", True),
    ("cache_control", False), ("content.image_url.detail", False), ("tool_result.is_error", False),
    ("seed", False), ("tools", False), ("top_k", False), ("metadata.x", False), ("metadata.source.x", False),
    ("image.cache_control", False), ("document.title", False),
])
def test_a_name_is_content_or_a_field(name, content):
    assert is_content(name) is content


def test_with_drop_only_content_keeps_an_entry_from_serving():
    from relayline.machines.config import Capabilities
    caps, request = Capabilities(vision=False), attrs.evolve(FULL, source="anthropic")
    assert refused(request, "openai", caps, drop=False) == ("image", "seed", "service_tier", "top_k", "document.source.url",
                                                          "tool_result.is_error")
    assert refused(request, "openai", caps, drop=True) == ("image", "document.source.url")
    assert droppable(request, "openai", caps) == ("seed", "service_tier", "top_k", "tool_result.is_error")


@pytest.mark.parametrize("value, kind", [
    (None, "null"), ({}, "an object"), ("x", "a string"), ([], "a list"), (True, "a boolean"), (1, "a number"),
    (1.5, "a number"),
])
def test_a_value_is_described_in_a_clients_words(value, kind):
    assert describe(value) == kind


@pytest.mark.parametrize("check, value, args, message", [
    (want_str, 1, (), "p: expected a string, got a number"),
    (want_list, {}, (), "p: expected a list, got an object"),
    (want_dict, [], (), "p: expected an object, got a list"),
    (want_bool, 1, (), "p: expected a boolean, got a number"),
    (want_bool, None, (), "p: expected a boolean, got null"),
    (want_int, True, (), "p: expected an integer, got a boolean"),
    (want_int, 1.0, (), "p: expected an integer, got a number"),
    (want_int, -1, (), f"p: must be between 0 and {MAX_TOKENS}"),
    (want_int, MAX_TOKENS + 1, (), f"p: must be between 0 and {MAX_TOKENS}"),
    (want_int, 3, (4, 9), "p: must be between 4 and 9"),
    (want_int, 10, (4, 9), "p: must be between 4 and 9"),
    (want_number, "1", (0, 2), "p: expected a number, got a string"),
    (want_number, False, (0, 2), "p: expected a number, got a boolean"),
    (want_number, -0.5, (0, 2), "p: must be between 0 and 2"),
    (want_number, 2.5, (0, 2.5e-1), "p: must be between 0 and 0.25"),
])
def test_a_value_of_the_wrong_shape_names_its_param(check, value, args, message):
    with pytest.raises(WireError) as caught:
        check(value, "p", *args)
    assert str(caught.value) == message and caught.value.param == "p"
    assert caught.value.detail == message[len("p: "):]


def test_values_in_range_are_returned_as_given():
    assert want_str("s", "p") == "s" and want_list([1], "p") == [1] and want_dict({"a": 1}, "p") == {"a": 1}
    assert want_bool(False, "p") is False and want_bool(True, "p") is True
    assert want_int(0, "p") == 0 and want_int(MAX_TOKENS, "p") == MAX_TOKENS and want_int(4, "p", 4, 9) == 4
    assert want_int(9, "p", 4, 9) == 9
    number = want_number(2, "p", 0, 2)
    assert number == 2.0 and isinstance(number, float) and want_number(0, "p", 0, 2) == 0.0
    assert WireError("", "bare").args == ("bare",)


def test_paths_and_optional_fields():
    assert path("", "a") == "a" and path("a", "b") == "a.b" and path("a", 2) == "a[2]"
    assert optional({"a": None}, "a", want_int) is None and optional({}, "a", want_int) is None
    assert optional({"n": 5}, "n", want_int, "body", 1, 9) == 5
    with pytest.raises(WireError) as caught:
        optional({"n": "x"}, "n", want_int, "body")
    assert caught.value.param == "body.n"


def test_a_model_name_is_printable_and_bounded():
    assert check_model(None) is None and check_model("m-1") == "m-1"
    assert check_model("x" * MAX_MODEL_CHARS) == "x" * MAX_MODEL_CHARS
    for bad, message in [(5, "model: expected a string, got a number"),
                         ("", f"model: must be 1 to {MAX_MODEL_CHARS} printable characters"),
                         ("x" * (MAX_MODEL_CHARS + 1), f"model: must be 1 to {MAX_MODEL_CHARS} printable characters"),
                         ("a\nb", f"model: must be 1 to {MAX_MODEL_CHARS} printable characters")]:
        with pytest.raises(WireError) as caught:
            check_model(bad)
        assert str(caught.value) == message
    with pytest.raises(WireError, match="^name: "):
        check_model(5, "name")


@pytest.mark.parametrize("reason, tools, canonical", [
    ("length", 0, "length"), ("content_filter", 2, "content_filter"), ("stop_sequence", 0, "stop_sequence"),
    (None, 0, "stop"), (None, 1, "tool_calls"), ("weird", 0, "stop"), ("weird", 3, "tool_calls"),
])
def test_a_finish_reason_is_the_providers_else_what_the_answer_shows(reason, tools, canonical):
    assert finish_reason(reason, tools) == canonical


# -- what an entry cannot honour (docs/wire.md): named, so the walk skips it ----------------

def _unsupported(family, source="openai", capabilities=None, **request):
    from relayline.machines.config import Capabilities
    from relayline.machines.wire import unsupported

    request.setdefault("messages", (Message(USER, (Part(TEXT, "hi"),)),))
    return unsupported(Request(source=source, **request), family, capabilities or Capabilities())


def test_what_a_capability_lacks_is_named_for_every_family():
    from relayline.machines.config import Capabilities

    picture = (Message(USER, (Part(IMAGE, url="https://x/c.png"),)),)
    none = Capabilities(vision=False, tools=False)
    tools = (Tool("weather"),)
    for family in ("sim", "openai", "anthropic"):
        assert _unsupported(family, messages=picture, tools=tools, capabilities=none) == ("image", "tools")
        assert _unsupported(family, messages=picture, tools=tools) == ()
    assert _unsupported("sim", messages=picture, capabilities=Capabilities(vision=False)) == ("image",)
    assert _unsupported("sim", tools=tools, capabilities=Capabilities(tools=False)) == ("tools",)


def test_anthropic_only_fields_are_named_for_an_openai_entry():
    document = (Message(USER, (Part(DOCUMENT, url="https://x/d.pdf"), Part(TEXT, "sum", extra=("cache_control",)))),
                Message("tool", (Part(TEXT, "boom"),), tool_call_id="t1", is_error=True))
    assert _unsupported("openai", source="anthropic", messages=document, top_k=5,
                        extra={"metadata": {"x": 1}}) == (
        "metadata", "cache_control", "top_k", "document.source.url", "tool_result.is_error")
    inline = (Message(USER, (Part(DOCUMENT, data="JVBER", media_type="application/pdf"),)),)
    assert _unsupported("openai", source="anthropic", messages=inline) == ()
    assert _unsupported("anthropic", source="anthropic", messages=document, top_k=5) == ()  # the body as sent


def test_openai_only_fields_are_named_for_an_anthropic_entry():
    assert _unsupported("anthropic", response_format=ResponseFormat("json_object"),
                        reasoning=Reasoning(effort="extreme"), extra={"seed": 7, "logprobs": True}) == (
        "seed", "logprobs", "response_format", "reasoning_effort")
    assert _unsupported("anthropic", response_format=ResponseFormat("text"), reasoning=Reasoning(effort="high")) == ()
    assert _unsupported("openai", response_format=ResponseFormat("json_object"), extra={"seed": 7}) == ()


def test_a_field_named_twice_is_named_once():
    doubled = (Message(USER, (Part(TEXT, "a", extra=("cache_control",)), Part(TEXT, "b", extra=("cache_control",)))),)
    assert _unsupported("openai", source="anthropic", messages=doubled) == ("cache_control",)


def test_extras_are_the_unknown_fields_that_carry_something():
    fields = {"model": "m", "seed": 7, "user": None, "tags": [], "meta": {}, "presence_penalty": 0,
              "frequency_penalty": 0.5, "logprobs": False, "store": True, "top_logprobs": 0}
    assert extras(fields, {"model"}) == ["seed", "frequency_penalty", "store", "top_logprobs"]


@pytest.mark.parametrize(("raw", "problem"), [
    ({"messages": "hi"}, "expected a list, got a string"),
    ({"messages": [], "extra": ["seed"]}, "expected an object, got a list"),
    ({"messages": [], "tools": [{"name": "t", "parameters": None}]}, "expected an object, got null"),
    ({"messages": [], "max_tokens": True}, "expected an integer, got a boolean"),
])
def test_an_embedders_request_of_the_wrong_shape_names_the_kind(raw, problem):
    from cattrs.errors import ClassValidationError

    from relayline.machines.wire import converter

    with pytest.raises(ClassValidationError) as info:
        converter.structure(raw, Request)
    leaves, todo = [], [info.value]
    while todo:
        exc = todo.pop()
        if hasattr(exc, "exceptions"):
            todo.extend(exc.exceptions)
        else:
            leaves.append(str(exc))
    assert leaves == [problem]
    assert converter.structure({"messages": [{"role": "user"}], "extra": {"seed": 1}, "stop": ("a",)},
                               Request).extra == {"seed": 1}


def test_a_bool_is_a_number_only_where_a_bool_is_also_asked_for():
    with pytest.raises(WireError, match="p: expected a number, got a boolean"):
        want(True, (int, float), "p", "a number")
    assert want(True, (bool, int), "p", "a flag or count") is True
    assert want(3, int, "p", "an integer") == 3


def test_an_http_failure_reads_a_dated_retry_after_against_the_clock_it_is_given():
    now = 1_700_000_000.0
    date = email.utils.formatdate(now + 30, usegmt=True)
    assert fc.classify_http(429, None, {"retry-after": date}, now_epoch=now).retry_after_s == pytest.approx(30, abs=1)
    assert fc.classify_http(503, None, {"retry-after": date}, now).retry_after_s == pytest.approx(30, abs=1)
    assert fc.classify_http(503, None, {"retry-after": date}).retry_after_s is None  # no clock, no date


def test_an_optional_field_is_checked_under_its_own_path():
    assert optional({}, "max_tokens", want_int) is None and optional({"n": None}, "n", want_int) is None
    with pytest.raises(WireError) as info:
        optional({"max_tokens": "9"}, "max_tokens", want_int)
    assert info.value.param == "max_tokens"
    with pytest.raises(WireError, match=r"^thinking.budget_tokens: must be between 1024 and 2048$"):
        optional({"budget_tokens": 5}, "budget_tokens", want_int, "thinking", 1024, 2048)
    assert optional({"budget_tokens": 1500}, "budget_tokens", want_int, "thinking", 1024, 2048) == 1500


def test_a_message_level_caching_hint_goes_on_the_messages_last_block_towards_anthropic():
    from relayline.adapters.codecs import anthropic_messages_render, openai_chat, openai_chat_render
    hint = {"type": "ephemeral"}
    body = {"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "looking", "cache_control": hint, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one", "cache_control": hint},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "two", "cache_control": hint}]}]}
    request = openai_chat.parse_request(body)
    _, messages = anthropic_messages_render.render_messages(request.messages)
    assert messages[1]["content"] == [
        {"type": "text", "text": "looking"}, {"type": "tool_use", "id": "c1", "name": "f", "input": {}},
        {"type": "tool_use", "id": "c2", "name": "g", "input": {}, "cache_control": hint}]
    assert messages[2]["content"] == [
        {"type": "tool_result", "tool_use_id": "c1", "content": [{"type": "text", "text": "one"}], "cache_control": hint},
        {"type": "tool_result", "tool_use_id": "c2", "content": [{"type": "text", "text": "two", "cache_control": hint}]}]
    # an OpenAI body written again for its own family keeps each hint where its client put it
    again = openai_chat_render.render_request(attrs.evolve(request, passthrough=None), "m", False)["messages"]
    assert [m.get("cache_control") for m in again] == [None, hint, hint, None]
    assert again[3]["content"] == [{"type": "text", "text": "two", "cache_control": hint}]
    # and written for the other family from an Anthropic client's, nothing of them is left
    assert "cache_control" not in json.dumps(openai_chat_render.render_request(attrs.evolve(request, source="anthropic"), "m", False))


def test_dropping_removes_a_named_key_of_a_part_a_format_or_an_effort_and_nothing_beside():
    described = ResponseFormat("json_schema", {"name": "w", "description": "d", "schema": {}})
    plain, cited = Part(TEXT, "a"), Part(TEXT, "b", extra=("citations", "cache_control"))
    request = Request((Message(USER, (plain, cited)),), temperature=1.5, response_format=described,
                      reasoning=Reasoning(effort="max", budget_tokens=2048))
    kept = without(request, ("citations", "temperature", "response_format.json_schema.description",
                             "output_config.effort"))
    assert kept.messages[0].content[0] is plain  # a part without the key is the same part
    assert kept.messages[0].content[1] == Part(TEXT, "b", extra=("cache_control",))
    assert kept.temperature is None and without(request, ("top_k",)).temperature == 1.5
    assert kept.response_format == ResponseFormat("json_schema", {"name": "w", "schema": {}})
    assert kept.reasoning == Reasoning(budget_tokens=2048)
    untouched = without(request, ("top_k",))
    assert (untouched.response_format, untouched.reasoning) == (described, request.reasoning)
    assert untouched.messages[0].content == (plain, cited)
    assert without(attrs.evolve(request, reasoning=None), ("output_config.effort",)).reasoning is None


@pytest.mark.parametrize("source, family, responses, same", [
    ("openai", "openai", False, True), ("anthropic", "anthropic", False, True), ("openai", "anthropic", True, False),
    ("responses", "openai", True, True), ("responses", "openai", False, False), ("responses", "anthropic", True, False),
    ("anthropic", "openai", True, False),
])
def test_only_the_clients_own_dialect_gets_its_body(source, family, responses, same):
    from relayline.machines.config import Capabilities
    from relayline.machines.wire import passes_through

    request = Request((Message(USER, (Part(TEXT, "q"),)),), source=source)
    assert passes_through(request, family, Capabilities(responses=responses)) is same


def test_a_responses_clients_json_mode_goes_by_its_canonical_name():
    # towards anthropic JSON mode has no equivalent: unsupported names it response_format, whatever
    # the client's dialect called it (a Responses client's is text.format)
    from relayline.machines.config import Capabilities
    from relayline.machines.wire import unsupported

    request = Request((Message(USER, (Part(TEXT, "q"),)),), source="responses",
                      response_format=ResponseFormat("json_object"))
    assert unsupported(request, "anthropic", Capabilities()) == ("response_format",)
    assert without(request, ("response_format",)).response_format is None


def test_counting_and_embeddings_go_only_to_the_family_with_that_api():
    from relayline.machines.config import Capabilities
    from relayline.machines.wire import Embedding, json_object, unsupported

    counting, vectors = Request((), counting=True), Request((), embedding=Embedding("text"))
    assert [unsupported(counting, family, Capabilities()) for family in ("anthropic", "openai", "sim")] == [
        (), ("count_tokens",), ("count_tokens",)]
    assert [unsupported(vectors, family, Capabilities()) for family in ("openai", "anthropic", "sim")] == [
        (), ("embeddings",), ("embeddings",)]
    assert unsupported(vectors, "openai", Capabilities(embeddings=False)) == ("embeddings",)
    # a tool call's arguments: "" is no arguments, an object as is, anything else no object
    assert (json_object(""), json_object('{"a": 1}'), json_object("[1]"), json_object("{")) == ({}, {"a": 1}, None, None)


def test_a_profile_without_tools_refuses_tools_relayline_does_not_read():
    from relayline.machines.config import Capabilities
    from relayline.machines.wire import unsupported

    # a server tool (Anthropic's web search) is kept in extra under its own name, not in tools
    request = Request((Message(USER, (Part(TEXT, "q"),)),), source="anthropic",
                      extra={"tools.web_search": [{"type": "web_search_20250305"}]})
    assert unsupported(request, "anthropic", Capabilities(tools=False)) == ("tools",)
    assert unsupported(request, "anthropic", Capabilities()) == ()


def test_each_family_names_what_it_cannot_say():
    from relayline.machines.config import Capabilities
    from relayline.machines.wire import ToolCall, unsupported

    ask = Message(USER, (Part(TEXT, "q"),))
    caps = Capabilities()

    def named(family, **fields):  # a request of the other dialect: the same one goes as sent
        source = "anthropic" if family == "openai" else "openai"
        return unsupported(Request(**{"messages": (ask,), "source": source, **fields}), family, caps)

    # towards openai: an effort it has no word for; a trailing assistant message to continue
    assert named("openai", reasoning=Reasoning(effort="max")) == ("output_config.effort",)
    assert named("openai", reasoning=Reasoning(effort="high")) == ()
    assert named("openai", messages=(ask, Message(ASSISTANT, (Part(TEXT, "Once"),)))) == ("prefill",)
    assert unsupported(Request((ask, Message(ASSISTANT, (Part(TEXT, "Once"),))), source="anthropic"), "openai",
                       Capabilities(prefill=True)) == ()
    called = Message(ASSISTANT, tool_calls=(ToolCall("t1", "f"),))
    assert named("openai", messages=(ask, called)) == ()
    assert named("openai", messages=()) == ()
    # towards anthropic: a schema's description; a max_tokens that leaves no room for thinking
    described = ResponseFormat("json_schema", {"name": "w", "description": "d", "schema": {}})
    assert named("anthropic", response_format=described) == ("response_format.json_schema.description",)
    assert named("anthropic", reasoning=Reasoning(effort="low"), max_tokens=1024) == ("reasoning_effort",)
    assert named("anthropic", reasoning=Reasoning(effort="low"), max_tokens=1025) == ()
    # OpenAI's temperature reaches 2, Anthropic's 1
    assert (named("anthropic", temperature=1.5), named("anthropic", temperature=1.0)) == (("temperature",), ())

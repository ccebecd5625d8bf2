"""A same-dialect client's body goes upstream as the bytes it sent (`jsoncodec.dumps_appended`,
`wire.ReadBytes`, `CallRequest.body_bytes`): only bytes orjson read, only while the body is the
very object they were read as, only when every member is kept (the same object, or written
alike) with at most members appended; anything else is written anew as before."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from relayline.adapters import Relay, jsoncodec
from relayline.adapters.codecs import anthropic_messages, openai_chat, responses
from relayline.adapters.providers.base import CallRequest
from relayline.machines import dropping, wire

# -- bytes as a client may write them ---------------------------------------------------------

_WS = st.text(alphabet=" \t\n\r", max_size=2)
_KEYS = st.text(max_size=6).filter(lambda k: not any(0xD800 <= ord(c) <= 0xDFFF for c in k))
_STRINGS = st.text(max_size=8).filter(lambda k: not any(0xD800 <= ord(c) <= 0xDFFF for c in k))
_SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
            | st.floats(allow_nan=False, allow_infinity=False) | _STRINGS)
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(_KEYS, inner, max_size=3), max_leaves=10)


def _string(draw, text: str) -> str:
    """`text` as a JSON string, each character escaped or not as the client chose."""
    out = ['"']
    for c in text:
        must = c in '"\\' or ord(c) < 0x20
        if must or draw(st.booleans()):
            if c in '"\\/' and draw(st.booleans()):
                out.append("\\" + c)
            elif ord(c) > 0xFFFF:  # (a surrogate pair)
                high, low = divmod(ord(c) - 0x10000, 0x400)
                out.append(f"\\u{0xD800 + high:04x}\\u{0xDC00 + low:04X}")
            else:
                out.append(f"\\u{ord(c):04{'x' if draw(st.booleans()) else 'X'}}")
        else:
            out.append(c)
    return "".join(out) + '"'


def _write(draw, value) -> str:
    ws = lambda: draw(_WS)  # noqa: E731
    if isinstance(value, dict):
        members = [f"{ws()}{_string(draw, k)}{ws()}:{ws()}{_write(draw, v)}{ws()}" for k, v in value.items()]
        return "{" + ",".join(members) + (ws() if not members else "") + "}"
    if isinstance(value, list):
        return "[" + ",".join(f"{ws()}{_write(draw, v)}{ws()}" for v in value) + (ws() if not value else "") + "]"
    if isinstance(value, str):
        return _string(draw, value)
    if isinstance(value, float):
        return draw(st.sampled_from([repr(value), repr(value).upper()]))
    return json.dumps(value)


@st.composite
def client_bodies(draw) -> bytes:
    body = draw(st.dictionaries(_KEYS, _VALUES, max_size=5))
    return (draw(_WS) + _write(draw, body) + draw(_WS)).encode()


# what a render may do to a member of the client's body, and what it may append
CHANGES = st.lists(st.tuples(st.sampled_from(["same", "copy", "other", "true_for_1", "pop", "reset"]),
                             st.integers(0, 10)), max_size=3)
APPENDED = st.dictionaries(st.sampled_from(["model", "stream", "stream_options", "max_tokens", "ü\u2028"]),
                           _VALUES, max_size=3)


def _written(value) -> bytes:
    return orjson.dumps(value)


@given(client_bodies(), CHANGES, APPENDED)
@example(b'{"model":"m","stream":1}', [("true_for_1", 1)], {})
@example(b' { } \n', [], {"stream": True})
@example(b'{"a":1.0}', [("other", 0)], {})
def test_what_is_sent_reads_as_the_rendered_body_in_its_order(data, changes, appended):
    read, _, exact = jsoncodec.loads_read(data)
    assume(exact and isinstance(read, dict))
    rendered = dict(read)
    names = list(rendered)
    kept = True  # every member of the client's body still there, in place, written alike
    for change, at in changes:
        if not names:
            break
        name = names[at % len(names)]
        if name not in rendered:
            continue
        value = rendered[name]
        if change == "same":
            rendered[name] = value
        elif change == "copy":  # equal, another object
            rendered[name] = orjson.loads(orjson.dumps(value))
        elif change == "other":
            rendered[name] = value + 1 if type(value) is int else 1 if value != 1 or type(value) is not int else 2
            kept = False
        elif change == "true_for_1":
            rendered[name] = True if value == 1 and value is not True else 1
            kept = kept and _written(rendered[name]) == _written(value)
        elif change == "pop":
            rendered.pop(name)
            kept = False
        else:  # removed and set again: at the end
            rendered.pop(name)
            rendered[name] = value
            kept = kept and list(read).index(name) == len(read) - 1
    for name, value in appended.items():
        if name in read and (name not in rendered or _written(rendered[name]) != _written(value)):
            kept = False
        rendered[name] = value

    sent = jsoncodec.dumps_appended(data, read, rendered)

    if not kept:
        assert sent is None
        return
    assert sent is not None
    assert orjson.loads(sent) == rendered
    assert list(orjson.loads(sent)) == list(rendered)  # the rendered order
    assert orjson.dumps(orjson.loads(sent)) == orjson.dumps(rendered)  # (`1` is not `true`)
    if len(rendered) == len(read):
        assert sent is data  # nothing appended: the client's bytes themselves
    else:
        assert sent.startswith(data.rstrip(b" \t\n\r")[:-1])


@pytest.mark.parametrize("data", [
    b'{"model": "m", "temperature": NaN}', b'{"model": "m", "seed": 1234567890123456789012}',
    b'{"model": "m", "user": "\\ud800"}', '{"model": "m", "user": "é"}'.encode("utf-16"),
    b'{"model": "m", "user": "\xed\xa0\x80"}'])
def test_only_bytes_orjson_read_are_sent_as_they_are(data):
    # `json` reads these (NaN, an integer beyond 64 bits, a lone surrogate, UTF-16): what was
    # accepted stays so, and the body is written anew, as strict JSON a provider reads alike
    document, _, exact = jsoncodec.loads_read(data)
    assert document == json.loads(data) or document["temperature"] != document["temperature"]
    assert exact is False
    assert jsoncodec.loads_read(b'{"model": "m", "seed": 123456789012345678}')[2] is True


# -- the bytes held with the body they were read as -------------------------------------------

HI = b'{ "model" : "m",\n  "messages": [{"role": "user", "content": "h\\u00e9"}],  "tools": [%s] }'
TOOL = b'{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}'


def _relay(family: str) -> Relay:
    return Relay.from_toml(f'active = "p"\n[providers.p]\nfamily = "{family}"\nmodel = "m"\n'
                           'base_url = "http://127.0.0.1:9"\napi_key = "sk-bytes-test-key"\n', env={})


def _read(parse, data: bytes) -> wire.Request:
    """The request as the gateway reads it (chat_request.py): the bytes held with its body."""
    body, _, exact = jsoncodec.loads_read(data)
    assert exact
    request = parse(body, read=wire.ReadBytes(body, data))
    assert request.passthrough.body is body
    return request


FAMILIES = [("openai", openai_chat.parse_request), ("anthropic", anthropic_messages.parse_request)]


@pytest.mark.parametrize(("family", "parse"), FAMILIES)
@pytest.mark.parametrize("stream", [False, True])
def test_a_body_kept_but_for_appended_members_is_sent_as_the_client_s_bytes(family, parse, stream):
    data = HI % TOOL
    if family == "anthropic":
        data = data.replace(b'"tools"', b'"max_tokens": 9, "tools"')
    relay = _relay(family)
    request = _read(parse, data)
    call = CallRequest(relay.plan().entries[0], "m", request, stream=stream)
    sent = relay.clients[family].protocol.build(call).body
    assert sent.startswith(data.rstrip()[:-1])
    assert orjson.loads(sent)["stream"] is stream
    assert request.passthrough.read.data is None  # taken: the turn holds the bytes no more
    # a request of the same turn built again (a retry, the next entry) writes the body anew
    again = relay.clients[family].protocol.build(call).body
    assert orjson.loads(again) == orjson.loads(sent) and again != sent


@pytest.mark.parametrize(("family", "parse"), FAMILIES)
def test_a_changed_member_writes_the_body_anew(family, parse):
    data = (HI % TOOL).replace(b'"model" : "m"', b'"model": "asked-for"')
    relay = _relay(family)
    call = CallRequest(relay.plan().entries[0], "m", _read(parse, data), stream=False)
    sent = relay.clients[family].protocol.build(call).body
    assert orjson.loads(sent)["model"] == "m"
    assert sent == jsoncodec.dumps(orjson.loads(sent))  # today's compact writing


@pytest.mark.parametrize(("family", "parse"), FAMILIES)
@pytest.mark.parametrize("replace", ["prefill", "drop"])
def test_a_body_replaced_since_it_was_read_is_never_sent_as_the_old_bytes(family, parse, replace):
    # both replace the passthrough's body by attrs.evolve: the new passthrough still carries the
    # bytes, which are sent only with the body they were read as
    relay = _relay(family)
    request = _read(parse, HI % TOOL)
    if replace == "prefill":
        replaced = request.with_prefill("Sure")
    else:
        replaced = dropping.without(request, ("tools",))
    assert replaced.passthrough.read is request.passthrough.read
    call = CallRequest(relay.plan().entries[0], "m", replaced)
    sent = relay.clients[family].protocol.build(call).body
    expected = dict(replaced.passthrough.body)
    if family == "anthropic":
        expected.setdefault("max_tokens", 4096)
    assert orjson.loads(sent) == expected | {"model": "m", "stream": False}
    assert sent == jsoncodec.dumps(orjson.loads(sent))
    assert request.passthrough.read.data is None  # (taken all the same)


def test_the_responses_passthrough_is_sent_as_the_client_s_bytes():
    data = b'{"model":"m", "input": "h\\u00e9", "store": false}'
    relay = Relay.from_toml('active = "p"\n[providers.p]\nfamily = "openai"\nmodel = "m"\n'
                            'base_url = "http://127.0.0.1:9"\napi_key = "sk-bytes-test-key"\n'
                            '[providers.p.capabilities]\nresponses = true\n', env={})
    request = _read(responses.parse_request, data)
    sent = relay.clients["openai"].protocol.build(CallRequest(relay.plan().entries[0], "m", request, stream=True)).body
    assert sent == data[:-1] + b',"stream":true}'

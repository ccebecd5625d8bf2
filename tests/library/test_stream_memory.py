"""What an in-flight turn keeps alive is its own size: the upstream request body, kept for the
whole exchange (a stream's life), is not orjson's output buffer (4 KiB at least, about 12 times a
10 KB document)."""

from __future__ import annotations

import functools
import tracemalloc

import pytest

from relayline.adapters import Relay, jsoncodec
from relayline.adapters.providers.base import CallRequest
from relayline.adapters.relay import wire_request


def _traced(make, times: int) -> tuple[list, int]:
    """`times` results of `make`, kept alive, and the bytes they hold (tracemalloc)."""
    tracemalloc.start()
    try:
        made = [make() for _ in range(times)]
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return made, held


@pytest.mark.parametrize("text", ["hi", "word " * 2000])
def test_a_kept_body_holds_its_own_size(text):
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "stream": True}
    size = len(jsoncodec.dumps(body))
    kept, held = _traced(lambda: jsoncodec.dumps_kept(body), 100)
    assert kept[0] == jsoncodec.dumps(body)
    assert held < 100 * (size + 200)


async def test_the_upstream_request_of_each_family_is_built_with_a_kept_body():
    for family in ("openai", "anthropic"):
        relay = Relay.from_toml(f'active = "p"\n[providers.p]\nfamily = "{family}"\nmodel = "m"\n'
                                'base_url = "http://127.0.0.1:9"\napi_key = "sk-memory-test-key"\n', env={})
        entry = relay.plan().entries[0]
        request = CallRequest(entry, "m", wire_request([{"role": "user", "content": "hi"}]), stream=True)
        protocol = relay.clients[family].protocol
        built, held = _traced(functools.partial(protocol.build, request), 50)
        assert held < 50 * 3000, (family, held / 50)  # orjson's own buffer alone is 4 KiB a body
        assert built[0].body.startswith(b"{")

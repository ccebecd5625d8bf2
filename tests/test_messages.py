"""OpenAI chat messages <-> Anthropic messages: text, tool calls and tool results survive."""

from relayline.adapters.messages import anthropic_to_openai, openai_to_anthropic

OPENAI_TOOL_LOOP = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "weather in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "user", "content": "thanks"},
]


def test_openai_tool_loop_becomes_anthropic_blocks():
    system, messages = openai_to_anthropic(OPENAI_TOOL_LOOP)
    assert system == "be brief"
    assert messages == [
        {"role": "user", "content": [{"type": "text", "text": "weather in Paris?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        # the tool result and the next user text share one user turn: roles must alternate
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"},
                                     {"type": "text", "text": "thanks"}]},
    ]


def test_round_trip_keeps_the_conversation():
    system, messages = openai_to_anthropic(OPENAI_TOOL_LOOP)
    back = anthropic_to_openai(system, messages)
    assert back[0] == {"role": "system", "content": "be brief"}
    assert back[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert back[3] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert back[4] == {"role": "user", "content": "thanks"}


def test_anthropic_system_blocks_and_plain_strings():
    out = anthropic_to_openai([{"type": "text", "text": "sys"}], [{"role": "user", "content": "hi"}])
    assert out == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]

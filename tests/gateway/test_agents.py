"""Real agent clients, run as their users run them, against `relayline serve` in front of a
loopback provider that speaks both families and plays one tool round trip (agent_stand.py).

Each client goes through a route of its own family (forwarded as sent) and one of the other
family (translated), and each test sets what the client did (exit code, output) beside what the
provider received: the prompt, the tool definitions, the tool result, thinking sent back.
"""

from __future__ import annotations

import json
import sys
import uuid
from contextlib import ExitStack
from pathlib import Path

import pytest
from agent_stand import (
    ANTHROPIC_ROUTE,
    CLIENT_KEY,
    OPENAI_ROUTE,
    UPSTREAM_KEY,
    UPSTREAM_MODELS,
    ToolRoundTrip,
    loopback_only_env,
    npm_client,
    open_stand,
    python_client,
    run_client,
    tool_names,
    tool_results,
)

PROMPT = "Read notes.txt and tell me the marker it holds."


@pytest.fixture
def stand_for(tmp_path):
    """stand_for(script, drop=False) -> a Stand (agent_stand.py); it stops when the test ends.
    The gateway drops what a family cannot express only where a test says so."""
    with ExitStack() as stack:
        yield lambda script, drop=False: open_stand(script, tmp_path, stack, drop)


def _marker() -> str:
    return f"marker-{uuid.uuid4().hex[:10]}"


def _workdir(tmp_path, marker: str):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text(f"{marker}\n")
    return work


def _said(output: str, marker: str) -> bool:
    return f"The marker is {marker}." in output


def _upstream_key(seen) -> str:
    return seen.headers.get("x-api-key") or seen.headers.get("authorization", "").removeprefix("Bearer ")


def _assistant_messages(body: dict) -> list[dict]:
    return [m for m in body.get("messages") or () if m.get("role") == "assistant"]


def _no_client_key(stand) -> None:
    for seen in stand.seen:
        assert CLIENT_KEY not in json.dumps(seen.headers) + json.dumps(seen.body), f"client key upstream: {seen.path}"
        assert _upstream_key(seen) == UPSTREAM_KEY


# ---- Claude Code -------------------------------------------------------------------------------

def _claude(stand, tmp_path, work, *args: str):
    env = loopback_only_env(tmp_path / "home") | {
        "ANTHROPIC_BASE_URL": stand.url, "ANTHROPIC_API_KEY": CLIENT_KEY,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1", "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1"}
    return run_client([npm_client("claude"), "-p", PROMPT, *args], env, work)


def test_claude_code_on_its_own_family_keeps_what_it_sent(stand_for, tmp_path):
    marker = _marker()
    work = _workdir(tmp_path, marker)
    stand = stand_for(ToolRoundTrip("Read", {"file_path": str(work / "notes.txt")}, marker,
                                    reasoning="The file will say."))
    run = _claude(stand, tmp_path, work)
    assert run.returncode == 0 and _said(run.stdout, marker), f"{run.stdout}\n{run.stderr}\n{stand.explain()}"
    first, second = stand.loop("Read")
    for seen in (first, second):
        # the same family: the query, the beta headers and every field as Claude Code sent them
        assert seen.path == "/v1/messages?beta=true"
        assert "claude-code-20250219" in seen.headers.get("anthropic-beta", "")
        assert seen.headers.get("anthropic-version") == "2023-06-01"
        assert seen.body["thinking"]["type"] == "adaptive"
        assert "effort" in seen.body["output_config"] and "edits" in seen.body["context_management"]
        assert PROMPT in json.dumps(seen.body["messages"])
        # its mid-conversation system text stays a system-role message
        assert any(m["role"] == "system" for m in seen.body["messages"])
        assert any("cache_control" in block for block in seen.body["system"])
    assert marker in " ".join(tool_results(second.body))
    # turn 2 hands the signed thinking back with the tool call it came with
    (assistant,) = _assistant_messages(second.body)
    kinds = [block["type"] for block in assistant["content"]]
    assert kinds == ["thinking", "tool_use"], kinds
    assert assistant["content"][0]["signature"] == "sig-turn1"
    _no_client_key(stand)


def test_claude_code_on_an_openai_route_completes_its_tool_loop(stand_for, tmp_path):
    marker = _marker()
    work = _workdir(tmp_path, marker)
    # context_management has no OpenAI equivalent: this route needs drop_unsupported_params
    stand = stand_for(ToolRoundTrip("Read", {"file_path": str(work / "notes.txt")}, marker,
                                    reasoning="The file will say."), drop=True)
    run = _claude(stand, tmp_path, work, "--model", OPENAI_ROUTE)
    assert run.returncode == 0 and _said(run.stdout, marker), f"{run.stdout}\n{run.stderr}\n{stand.explain()}"
    first, second = stand.loop("Read")
    for seen in (first, second):
        assert seen.path == "/v1/chat/completions" and seen.body["model"] == UPSTREAM_MODELS[OPENAI_ROUTE]
        messages = seen.body["messages"]
        assert PROMPT in json.dumps(messages)
        # the system prompt first, and the mid-conversation system text where Claude Code put it
        assert messages[0]["role"] == "system" and messages[1]["role"] == "user"
        assert messages[2]["role"] == "system" and "Primary working directory" in json.dumps(messages[2])
        # adaptive thinking at an effort becomes reasoning_effort; a caching hint becomes nothing
        assert seen.body.get("reasoning_effort") in ("low", "medium", "high")
        assert "cache_control" not in json.dumps(seen.body) and "context_management" not in seen.body
        read = next(t for t in seen.body["tools"] if t["function"]["name"] == "Read")
        assert "file_path" in json.dumps(read["function"]["parameters"])
    assert marker in " ".join(tool_results(second.body))
    (assistant,) = _assistant_messages(second.body)
    assert assistant["tool_calls"][0]["function"]["name"] == "Read"
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"file_path": str(work / "notes.txt")}
    assert "reasoning_content" not in assistant  # reasoning from history is left out towards openai
    _no_client_key(stand)


# ---- opencode ----------------------------------------------------------------------------------

def _opencode(stand, tmp_path, work, model: str):
    config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
              "provider": {"relay": {"npm": "@ai-sdk/openai-compatible", "name": "relay",
                                     "options": {"baseURL": stand.url + "/v1", "apiKey": CLIENT_KEY},
                                     "models": {model: {"name": model, "tool_call": True}}}}}
    env = loopback_only_env(tmp_path / "home") | {
        "OPENCODE_CONFIG_CONTENT": json.dumps(config), "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1"}
    return run_client([npm_client("opencode"), "run", "--model", f"relay/{model}", PROMPT], env, work)


@pytest.mark.parametrize("route", [OPENAI_ROUTE, ANTHROPIC_ROUTE])
def test_opencode_completes_its_tool_loop(stand_for, tmp_path, route):
    marker = _marker()
    work = _workdir(tmp_path, marker)
    stand = stand_for(ToolRoundTrip("read", {"filePath": str(work / "notes.txt")}, marker,
                                    reasoning="The note will say."))
    run = _opencode(stand, tmp_path, work, route)
    assert run.returncode == 0 and _said(run.stdout, marker), f"{run.stdout}\n{run.stderr}\n{stand.explain()}"
    first, second = stand.loop("read")
    for seen in (first, second):
        assert seen.body["model"] == UPSTREAM_MODELS[route]
        assert PROMPT in json.dumps(seen.body["messages"])
        assert {"bash", "read", "edit"} <= set(tool_names(seen.body))
    assert marker in " ".join(tool_results(second.body))
    if route == OPENAI_ROUTE:  # forwarded as sent
        assert first.path == "/v1/chat/completions" and first.body["tool_choice"] == "auto"
        (assistant,) = _assistant_messages(second.body)
        assert assistant["tool_calls"][0]["id"] == "call_rt1"
        assert assistant["reasoning_content"] == "The note will say."  # its reasoning, sent back
    else:  # translated; opencode marks a "claude" model's messages with cache_control, and a
        # message-level key moves to that message's last block
        assert first.path.startswith("/v1/messages")
        assert "opencode" in json.dumps(first.body["system"]).lower()
        (assistant,) = _assistant_messages(second.body)
        # opencode sends its reasoning back without the signature: Anthropic gets thinking only
        # signed by its provider, so this turn's unsigned words are left out
        thinking = [b for b in assistant["content"] if b["type"] == "thinking"]
        assert all(b.get("signature") == "sig-turn1" for b in thinking), thinking
        # (opencode marks its tool call with cache_control too: the hint stays on the tool_use)
        use = [{k: v for k, v in b.items() if k != "cache_control"}
               for b in assistant["content"] if b["type"] == "tool_use"]
        assert use == [{"type": "tool_use", "id": "toolu_rt1", "name": "read",
                        "input": {"filePath": str(work / "notes.txt")}}]
        assert "cache_control" in assistant["content"][-1], assistant
        read = next(t for t in first.body["tools"] if t["name"] == "read")
        assert "filePath" in json.dumps(read["input_schema"])
        user = [m for m in first.body["messages"] if m["role"] == "user"][-1]
        assert isinstance(user["content"], list) and "cache_control" in user["content"][-1], user
    _no_client_key(stand)


# ---- the OpenAI Agents SDK ---------------------------------------------------------------------

@pytest.mark.parametrize("route", [OPENAI_ROUTE, ANTHROPIC_ROUTE])
def test_openai_agents_sdk_runs_a_strict_function_tool(stand_for, route):
    agents = python_client("agents", "openai-agents")
    import openai

    marker = _marker()
    stand = stand_for(ToolRoundTrip("notes_marker", {"note": "notes.txt"}, marker, reasoning="Ask the tool."))
    calls: list[str] = []

    @agents.function_tool
    def notes_marker(note: str) -> str:
        """The marker a note holds."""
        calls.append(note)
        return f"{note} holds {marker}"

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=stand.url + "/v1", api_key=CLIENT_KEY, max_retries=0, timeout=30)
    agent = agents.Agent(name="reader", instructions="Answer with the marker.", tools=[notes_marker],
                         model=agents.OpenAIChatCompletionsModel(  # reasoning_content goes back
                             model=route, openai_client=client, should_replay_reasoning_content=lambda _: True))
    result = agents.Runner.run_sync(agent, PROMPT, max_turns=4)
    assert calls == ["notes.txt"] and _said(result.final_output, marker), stand.explain()
    first, second = stand.loop("notes_marker")
    assert marker in " ".join(tool_results(second.body))
    for seen in (first, second):
        assert seen.body["model"] == UPSTREAM_MODELS[route] and PROMPT in json.dumps(seen.body["messages"])
    (assistant,) = _assistant_messages(second.body)
    if route == OPENAI_ROUTE:
        (tool,) = first.body["tools"]
        assert tool["function"]["strict"] is True
        assert assistant["reasoning_content"] == "Ask the tool."
    else:  # strict tools become Anthropic's strict tools (structured outputs)
        assert "Answer with the marker." in json.dumps(first.body["system"])
        thinking = [b for b in assistant["content"] if b["type"] == "thinking"]
        assert all(b.get("signature") == "sig-turn1" for b in thinking), thinking  # unsigned: left out
        (tool,) = first.body["tools"]
        assert tool["name"] == "notes_marker" and tool.get("strict") is True, tool
    _no_client_key(stand)


# ---- LangChain ChatAnthropic with thinking -----------------------------------------------------

@pytest.mark.parametrize("route", [ANTHROPIC_ROUTE, OPENAI_ROUTE])
def test_langchain_chat_anthropic_sends_its_thinking_back(stand_for, route):
    python_client("langchain_anthropic", "langchain-anthropic")
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    marker = _marker()
    stand = stand_for(ToolRoundTrip("notes_marker", {"note": "notes.txt"}, marker,
                                    reasoning="I should look at the note first."))

    @tool
    def notes_marker(note: str) -> str:
        """The marker a note holds."""
        return f"{note} holds {marker}"

    model = ChatAnthropic(model=route, base_url=stand.url, api_key=CLIENT_KEY, max_tokens=4096, max_retries=0,
                          timeout=30, thinking={"type": "enabled", "budget_tokens": 2048}).bind_tools([notes_marker])
    history = [HumanMessage(PROMPT)]
    first_reply = model.invoke(history)
    assert [block["type"] for block in first_reply.content] == ["thinking", "tool_use"], first_reply.content
    (call,) = first_reply.tool_calls
    history += [first_reply, ToolMessage(notes_marker.invoke(call["args"]), tool_call_id=call["id"])]
    final = model.invoke(history)
    assert _said(final.text, marker), (final.content, stand.explain())
    first, second = stand.loop("notes_marker")
    assert marker in " ".join(tool_results(second.body))
    if route == ANTHROPIC_ROUTE:
        assert first.body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
        (assistant,) = _assistant_messages(second.body)
        assert assistant["content"][0] == {"type": "thinking", "thinking": "I should look at the note first.",
                                           "signature": "sig-turn1"}
    else:
        assert first.path == "/v1/chat/completions" and first.body["model"] == UPSTREAM_MODELS[OPENAI_ROUTE]
        assert "reasoning_effort" in first.body  # thinking asked for, in the family's words
        (assistant,) = _assistant_messages(second.body)
        assert assistant["tool_calls"][0]["function"]["name"] == "notes_marker"
        assert "reasoning_content" not in assistant
    _no_client_key(stand)


# ---- llm ---------------------------------------------------------------------------------------

def _llm(stand, tmp_path, route: str, *args: str):
    python_client("llm", "llm")
    command = Path(sys.executable).parent / "llm"
    if not command.exists():
        pytest.skip("llm: its command is not installed beside this Python (pip install -e '.[agents]')")
    home = tmp_path / "llm"
    home.mkdir()
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: {route}\n  model_name: {route}\n  api_base: {stand.url}/v1\n  api_key_name: relay\n"
        "  supports_schema: true\n  supports_tools: true\n")
    (home / "keys.json").write_text(json.dumps({"relay": CLIENT_KEY}))
    env = loopback_only_env(tmp_path / "home") | {"LLM_USER_PATH": str(home)}
    return run_client([command, "-m", route, "--no-log", *args, PROMPT], env, tmp_path)


@pytest.mark.parametrize("route", [OPENAI_ROUTE, ANTHROPIC_ROUTE])
def test_llm_schema_asks_the_provider_for_json(stand_for, tmp_path, route):
    marker = _marker()
    stand = stand_for(ToolRoundTrip("no-such-tool", {}, marker, plain=json.dumps({"marker": marker, "lines": 1})))
    run = _llm(stand, tmp_path, route, "--schema", "marker, lines int")
    assert run.returncode == 0 and json.loads(run.stdout) == {"marker": marker, "lines": 1}, (
        f"{run.stdout}\n{run.stderr}\n{stand.explain()}")
    (seen,) = stand.chat()
    assert seen.body["model"] == UPSTREAM_MODELS[route] and PROMPT in json.dumps(seen.body["messages"])
    schema = _json_schema(seen.body)
    assert schema is not None and set(schema["properties"]) == {"marker", "lines"}, seen.body
    _no_client_key(stand)


NOTES_MARKER = '''
def notes_marker(note: str) -> str:
    """The marker a note holds."""
    return open(note).read().strip()
'''


@pytest.mark.parametrize("route", [OPENAI_ROUTE, ANTHROPIC_ROUTE])
def test_llm_calls_a_python_function_then_answers(stand_for, tmp_path, route):
    marker = _marker()
    (tmp_path / "notes.txt").write_text(f"{marker}\n")
    stand = stand_for(ToolRoundTrip("notes_marker", {"note": "notes.txt"}, marker))
    run = _llm(stand, tmp_path, route, "--functions", NOTES_MARKER)
    assert run.returncode == 0 and _said(run.stdout, marker), f"{run.stdout}\n{run.stderr}\n{stand.explain()}"
    first, second = stand.loop("notes_marker")
    assert marker in " ".join(tool_results(second.body))
    for seen in (first, second):
        assert seen.body["model"] == UPSTREAM_MODELS[route] and PROMPT in json.dumps(seen.body["messages"])
    if route == OPENAI_ROUTE:
        (tool,) = first.body["tools"]
        assert tool["function"]["name"] == "notes_marker" and "note" in tool["function"]["parameters"]["properties"]
    else:
        (tool,) = first.body["tools"]
        assert tool["name"] == "notes_marker" and "note" in tool["input_schema"]["properties"]
        (assistant,) = _assistant_messages(second.body)
        assert [b["type"] for b in assistant["content"]] == ["tool_use"]
    _no_client_key(stand)


def _json_schema(body: dict) -> dict | None:
    """The JSON schema a request asks its answer to follow, in either family's words."""
    fmt = (body.get("response_format") or {}).get("json_schema", {}).get("schema")
    if fmt is not None:
        return fmt
    for holder in (body.get("output_config") or {}, body):
        found = holder.get("format") or holder.get("output_format")
        if isinstance(found, dict) and found.get("type") == "json_schema":
            return found.get("schema")
    return None

"""OpenAI's Codex CLI as a user runs it: `codex exec` with a custom model provider whose base URL
is `relayline serve` (its own process) and whose wire is the Responses API, served through an
`openai` profile that does not speak that API and through an `anthropic` profile. The upstream
is a real loopback server, scripted: asked first, it calls Codex's shell tool to read a file;
given the tool's output, it answers with what the file says. The gateway's access lines record
every endpoint Codex called. The CLI is pinned with the other agents in tests/agent_clients
(`make agents`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agent_stand import npm_client

from helpers import base_url
from relayline.adapters.sim.loopback import BackgroundLoopback, Reply, Seen
from relayline.adapters.sim.recorder import (
    JSON,
    SSE,
    Answer,
    anthropic_reply,
    openai_reply,
    responses_reply,
)

CLI = [sys.executable, "-m", "relayline.adapters.cli"]
NOTE = "relayline-carried-this"



def _answered(body: dict, anthropic: bool) -> bool:
    """Whether the conversation ends with a tool's output (the second turn)."""
    if "input" in body:  # the Responses API's own body, passed through
        return body["input"][-1].get("type") == "function_call_output"
    messages = body.get("messages") or [{}]
    last = messages[-1]
    if anthropic:
        return isinstance(last.get("content"), list) and any(b.get("type") == "tool_result" for b in last["content"])
    return last.get("role") == "tool"


class ScriptedUpstream(BackgroundLoopback):
    """First a call to Codex's shell tool (`exec_command`) to read note.txt, then, given its
    output, an answer quoting it: in whichever family's shape the request came."""

    def __init__(self) -> None:
        super().__init__(self._answer)

    def _answer(self, seen: Seen) -> Reply:
        body = seen.body or {}
        anthropic = seen.path.endswith("/v1/messages")
        if _answered(body, anthropic):
            output = json.dumps((body.get("messages") or body.get("input"))[-1])
            answer = Answer(text=f"The note says: {NOTE}" if NOTE in output else "I could not read the note")
        else:
            answer = Answer(text="", tool_calls=(("call_codex_1", "exec_command", json.dumps({"cmd": "cat note.txt"})),))
        stream = bool(body.get("stream"))
        render = anthropic_reply if anthropic else responses_reply if "input" in body else openai_reply
        return Reply(headers=SSE if stream else JSON, pieces=render(answer, body.get("model", ""), stream))


def _serve(config: Path, env: dict) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([*CLI, "serve", "--config", str(config), "--port", "0", "--log-format", "json",
                             "--log-level", "info"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if "listening on" in line:
            return proc, line.rsplit(" ", 1)[1].strip().split(",")[0]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError("the gateway did not start")


def _access(proc: subprocess.Popen) -> list[dict]:
    """The gateway's access lines, once it has drained and exited."""
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("msg") == "access"]


@pytest.mark.parametrize("family", ["openai", "anthropic", "openai-responses"])
def test_codex_exec_runs_a_tool_loop_through_relayline(tmp_path, family):
    codex = npm_client("codex")  # (a skip naming what is missing, before anything starts)
    native = family == "openai-responses"  # an openai profile that serves the Responses API itself
    family = "openai" if native else family
    work, home = tmp_path / "work", tmp_path / "codex-home"
    work.mkdir()
    home.mkdir()
    (work / "note.txt").write_text(NOTE + "\n")
    with ScriptedUpstream() as upstream:
        base = base_url(family, upstream.url)
        (tmp_path / "relayline.toml").write_text(
            f'active = "{family}.up"\n[gateway]\napi_keys_env = "RELAYLINE_CODEX_KEYS"\n'
            f'[providers."{family}.up"]\nfamily = "{family}"\nbase_url = "{base}"\napi_key = "sk-upstream"\n'
            f'model = "model-up"\n' + ("capabilities = {responses = true}\n" if native else ""))
        env = {**os.environ, "RELAYLINE_CODEX_KEYS": "gw-codex-key"}
        proc, url = _serve(tmp_path / "relayline.toml", env)
        try:
            (home / "config.toml").write_text(
                'model = "model-up"\nmodel_provider = "relayline"\n[model_providers.relayline]\n'
                f'name = "relayline"\nbase_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "RELAYLINE_KEY"\n')
            codex_env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home),
                         "RELAYLINE_KEY": "gw-codex-key"}
            run = subprocess.run([str(codex), "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access",
                                  "Read note.txt and tell me what it says."], cwd=work, env=codex_env,
                                 capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
        finally:
            access = _access(proc)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == f"The note says: {NOTE}"
    # every endpoint Codex called, each answered
    assert [(a["method"], a["path"], a["status"]) for a in access] == [("POST", "/v1/responses", 200)] * 2
    paths = [s.path for s in upstream.seen]
    if native:  # Codex's own body as it sent it: its hints and every tool kind reach the provider
        assert paths == ["/v1/responses"] * 2
        first, second = (s.body for s in upstream.seen)
        assert (first["model"], first["stream"], first["store"]) == ("model-up", True, False)
        assert {"prompt_cache_key", "client_metadata", "include", "reasoning"} <= first.keys()
        assert {"function", "namespace", "web_search"} <= {t["type"] for t in first["tools"]}
        assert second["input"][-1]["call_id"] == "call_codex_1" and NOTE in json.dumps(second["input"][-1])
        return
    assert paths == (["/v1/chat/completions"] * 2 if family == "openai" else ["/v1/messages"] * 2)
    first, second = (s.body for s in upstream.seen)
    names = [t["function"]["name"] if family == "openai" else t["name"] for t in first["tools"]]
    assert "exec_command" in names and first["stream"] is True
    # the tool's call id went back with its output
    if family == "openai":
        assert second["messages"][-2]["tool_calls"][0]["id"] == "call_codex_1"
        assert second["messages"][-1]["tool_call_id"] == "call_codex_1" and NOTE in second["messages"][-1]["content"]
    else:
        assert second["messages"][-1]["content"][0]["tool_use_id"] == "call_codex_1"

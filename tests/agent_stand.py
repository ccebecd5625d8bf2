"""The harness tests/gateway/test_agents.py runs real agent clients with: `relayline serve` (the real
process) in front of one recording loopback upstream that speaks both families and plays a model
in a tool loop, so a test can check what the client did (its exit code, its output) beside what
the provider received (prompt, tool definitions, tool result, thinking sent back).

The npm clients are pinned in tests/agent_clients/package.json and installed by `make agents` (npm ci);
the Python ones come with the `agents` extra. A client that is not installed is a skip naming what
is missing and how to install it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import attrs
import pytest
from fleet import ServeProcess

from relayline.adapters.sim.loopback import Seen
from relayline.adapters.sim.recorder import Answer, RecordingUpstream, family_of

NODE_MODULES = Path(__file__).parent / "agent_clients" / "node_modules"
NPM_CLIENTS = {"claude": NODE_MODULES / ".bin" / "claude", "codex": NODE_MODULES / ".bin" / "codex",
               "opencode": NODE_MODULES / "opencode-linux-x64" / "bin" / "opencode"}
CLIENT_KEY = "rl-client-key-agents"  # the key a client presents to the gateway: never upstream
UPSTREAM_KEY = "up-key-agents"  # the key the gateway presents to the upstream
CLIENT_SECONDS = 120  # a client run's bound: killed past it, and the test fails


def npm_client(name: str) -> Path:
    """The installed npm client's executable, or a skip that says what is missing."""
    path = NPM_CLIENTS[name]
    if path.exists():
        return path
    if shutil.which("npm") is None:
        pytest.skip(f"{name}: npm is not installed, so `make agents` could not install the npm clients")
    pytest.skip(f"{name}: not installed under tests/agent_clients/node_modules (run `make agents`; "
                "it needs the npm registry)")


def python_client(module: str, package: str):
    return pytest.importorskip(module, reason=f"{package} is not installed (pip install -e '.[agents]')")


# ---- the model the upstream plays --------------------------------------------------------------

def tool_names(body: dict) -> list[str]:
    """The names of the tools a request offers, in either family's shape."""
    return [tool.get("name") or tool.get("function", {}).get("name", "") for tool in body.get("tools") or ()]


def tool_results(body: dict) -> list[str]:
    """The text of every tool result in a request's history, in either family's shape."""
    out: list[str] = []
    for message in body.get("messages") or ():
        if message.get("role") == "tool":
            out.append(_text(message.get("content")))
        elif isinstance(message.get("content"), list):
            out += [_text(block.get("content")) for block in message["content"]
                    if isinstance(block, dict) and block.get("type") == "tool_result"]
    return out


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(part.get("text", part.get("content", ""))) if isinstance(part, dict) else str(part)
                       for part in content)
    return "" if content is None else str(content)


def prompt_text(body: dict) -> str:
    """Everything a request says in text (system, messages, tool results), for `in` checks."""
    return json.dumps({"system": body.get("system"), "messages": body.get("messages")}, ensure_ascii=False)


@attrs.frozen
class ToolRoundTrip:
    """A model in a tool loop: while no tool result is in the history and the request offers
    `tool`, it calls it with `arguments`; once a result is there, it answers in text, quoting
    `marker` only when the result carries it (so the client's output proves the result arrived).
    Requests that offer no such tool (an agent's side calls: titles, quota probes) get plain text.
    `reasoning` (thinking) rides along with both answers when set."""

    tool: str
    arguments: dict
    marker: str
    reasoning: str = ""
    plain: str = "Side answer."  # the answer to a request that offers no such tool

    def __call__(self, seen: Seen) -> Answer:
        body = seen.body or {}
        prefix = "toolu_" if family_of(seen) == "anthropic" else "call_"
        results = tool_results(body)
        if results:
            found = self.marker if any(self.marker in r for r in results) else "missing"
            return Answer(text=f"The marker is {found}.", reasoning=self.reasoning, signature="sig-final")
        if self.tool in tool_names(body):
            return Answer(text="", tool_calls=((f"{prefix}rt1", self.tool, json.dumps(self.arguments)),),
                          reasoning=self.reasoning, signature="sig-turn1")
        return Answer(text=self.plain)


# ---- the gateway in front of it ----------------------------------------------------------------

ANTHROPIC_ROUTE = "relay-claude"  # a route hint whose target is an anthropic profile
OPENAI_ROUTE = "relay-gpt"  # a route hint whose target is an openai profile
UPSTREAM_MODELS = {ANTHROPIC_ROUTE: "claude-up-route", OPENAI_ROUTE: "gpt-up-route"}


def gateway_toml(upstream_url: str, tmp_path: Path, drop: bool) -> str:
    """The default domain is an unpinned anthropic profile (an agent's own model names reach the
    provider as sent); the two routes name one profile of each family, pinned. `drop`: the
    gateway's drop_unsupported_params."""
    return f"""
active = "anthropic.main"

[providers."anthropic.main"]
family = "anthropic"
base_url = "{upstream_url}"
api_key = "{UPSTREAM_KEY}"

[providers."anthropic.route"]
family = "anthropic"
base_url = "{upstream_url}"
api_key = "{UPSTREAM_KEY}"
model = "{UPSTREAM_MODELS[ANTHROPIC_ROUTE]}"

[providers."openai.route"]
family = "openai"
base_url = "{upstream_url}/v1"
api_key = "{UPSTREAM_KEY}"
model = "{UPSTREAM_MODELS[OPENAI_ROUTE]}"

[[routes]]
hint = "{ANTHROPIC_ROUTE}"
provider = "anthropic.route"
model = "{UPSTREAM_MODELS[ANTHROPIC_ROUTE]}"

[[routes]]
hint = "{OPENAI_ROUTE}"
provider = "openai.route"
model = "{UPSTREAM_MODELS[OPENAI_ROUTE]}"

[reliability]
provider_retries = 0

[timeouts]
headers_s = 30
total_s = 60

[gateway]
api_keys_env = "RELAYLINE_AGENT_KEYS"
drop_unsupported_params = {str(drop).lower()}

[ledger]
path = "{tmp_path / 'ledger.sqlite3'}"
"""


@attrs.define
class Stand:
    """A running upstream and gateway: `url` is the gateway's, `seen` what the upstream got."""

    upstream: RecordingUpstream
    gateway: ServeProcess

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def seen(self) -> list[Seen]:
        return self.upstream.seen

    def chat(self) -> list[Seen]:
        """The requests that reached the provider's chat endpoints."""
        return [s for s in self.seen if s.path.partition("?")[0].endswith(("/v1/messages", "/chat/completions"))]

    def loop(self, tool: str) -> tuple[Seen, Seen]:
        """The tool loop's two provider requests: the one that offered `tool` and got the call,
        and the first after it that carried a tool result. Fails, showing what did arrive."""
        chat = self.chat()
        first = next((s for s in chat if tool in tool_names(s.body or {}) and not tool_results(s.body or {})), None)
        second = next((s for s in chat if tool_results(s.body or {})), None)
        assert first is not None and second is not None, (
            f"no tool round trip for {tool!r} reached the upstream; it saw: {describe(self.seen)}\n"
            f"gateway log:\n{self.gateway.stderr[-4000:]}")
        return first, second

    def explain(self) -> str:
        return f"upstream saw: {describe(self.seen)}\ngateway log:\n{self.gateway.stderr[-6000:]}"


def describe(seen: Sequence[Seen]) -> str:
    return "; ".join(f"{s.method} {s.path} model={(s.body or {}).get('model')!r} "
                     f"tools={tool_names(s.body or {})[:6]} results={len(tool_results(s.body or {}))}"
                     for s in seen) or "nothing"


def open_stand(script: ToolRoundTrip, tmp_path: Path, stack: ExitStack, drop: bool = False) -> Stand:
    """An upstream playing `script` and `relayline serve` in front of it; `stack` stops both."""
    upstream = stack.enter_context(RecordingUpstream(script))
    path = tmp_path / "relayline.toml"
    path.write_text(gateway_toml(upstream.url, tmp_path, drop))
    gateway = stack.enter_context(ServeProcess(path, env={"RELAYLINE_AGENT_KEYS": CLIENT_KEY}))
    return Stand(upstream, gateway)


def loopback_only_env(home: Path) -> dict[str, str]:
    """A client process's environment: a fresh HOME, and any proxy-aware traffic that is not to
    loopback sent to a closed loopback port, so nothing leaves the machine."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR")}
    home.mkdir(parents=True, exist_ok=True)
    return {**keep, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_DATA_HOME": str(home / ".local/share"), "XDG_CACHE_HOME": str(home / ".cache"),
            "XDG_STATE_HOME": str(home / ".local/state"),
            "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
            "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def run_client(argv: Sequence[str | Path], env: dict[str, str], cwd: Path,
               seconds: float = CLIENT_SECONDS) -> subprocess.CompletedProcess:
    """Run a client to its end, bounded: past `seconds` its whole process group is killed (an
    agent may have started tools of its own) and the test fails."""
    proc = subprocess.Popen([str(a) for a in argv], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"{argv[0]} did not finish within {seconds} s; stdout: {out[-3000:]!r}; stderr: {err[-3000:]!r}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


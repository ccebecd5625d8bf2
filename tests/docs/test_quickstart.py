"""The README's gateway quickstart, run as written: its config (with each provider's base URL
pointed at a real loopback upstream of that provider's shape), its `relayline serve` line, its
curl line and its openai SDK snippet; then the same without keys against the built-in
simulator. Only the port changes (a free one, not 8080, which another program may hold)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx

from relayline.adapters.sim.loopback import BackgroundLoopback, Reply, Seen

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SECTION = README[README.index("## Quickstart: the gateway"):README.index("## Quickstart: the library")]
BIN = Path(sys.executable).parent


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", SECTION, re.S)


def commands(block: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shell_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith(("_API_KEY", "_KEYS"))}
    return {**env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", **extra}


class Gateway:
    """`relayline serve` as the README starts it, on `port`; SIGTERM (a drain) at the end."""

    def __init__(self, line: str, port: int, env: dict[str, str], cwd: Path) -> None:
        assert line.startswith("relayline serve"), line
        self.port = port
        self.proc = subprocess.Popen(["bash", "-c", line.replace("8080", str(port))], env=env, cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def __enter__(self) -> Gateway:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}: {self.proc.stdout.read()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError("serve did not answer /healthz within 30 s")

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc.stdout.close()


def run_shell(line: str, port: int, env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(["bash", "-c", line.replace("8080", str(port))], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def openai_upstream(fail: list[bool]):
    def answer(seen: Seen) -> Reply:
        assert seen.path == "/v1/chat/completions"
        if fail[0]:
            return Reply(status=503, headers=(("content-type", "application/json"),),
                         pieces=(b'{"error": {"message": "overloaded", "type": "server_error"}}',))
        body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": seen.body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello from openai"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
        return Reply(headers=(("content-type", "application/json"),), pieces=(json.dumps(body).encode(),))
    return answer


def anthropic_upstream(seen: Seen) -> Reply:
    assert seen.path == "/v1/messages"
    body = {"id": "msg_1", "type": "message", "role": "assistant", "model": seen.body["model"],
            "content": [{"type": "text", "text": "hello from anthropic"}], "stop_reason": "end_turn",
            "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 3}}
    return Reply(headers=(("content-type", "application/json"),), pieces=(json.dumps(body).encode(),))


def test_the_quickstart_config_is_the_shipped_example():
    shown = tomllib.loads(blocks("toml")[0])
    example = tomllib.loads((ROOT / "examples" / "gateway.toml").read_text())

    def within(part, whole, path="") -> None:
        for key, value in part.items():
            assert key in whole, f"{path}{key} is in the README's config, not in examples/gateway.toml"
            if isinstance(value, dict):
                within(value, whole[key], f"{path}{key}.")
            else:
                assert whole[key] == value, f"{path}{key}"

    within(shown, example)


def test_the_gateway_quickstart_in_front_of_real_upstreams(tmp_path):
    toml, = blocks("toml")
    setup, call, no_keys = blocks("sh")
    exports, serve = commands(setup)
    snippet, = blocks("python")
    assert exports.startswith("export ")
    env = shell_env(dict(pair.split("=", 1) for pair in shlex.split(exports)[1:]))
    fail = [False]
    with BackgroundLoopback(openai_upstream(fail)) as openai, BackgroundLoopback(anthropic_upstream) as anthropic:
        config = toml.replace('[providers."openai.main"]\n', f'[providers."openai.main"]\nbase_url = "{openai.url}/v1"\n')
        config = config.replace('[providers."anthropic.main"]\n', f'[providers."anthropic.main"]\nbase_url = "{anthropic.url}"\n')
        (tmp_path / "relayline.toml").write_text(config)
        port = free_port()
        with Gateway(serve.replace("examples/gateway.toml", str(tmp_path / "relayline.toml")), port, env, tmp_path):
            curl, = commands(call)
            answer = json.loads(run_shell(curl, port, env, tmp_path))
            assert answer["choices"][0]["message"]["content"] == "hello from openai"
            assert answer["relayline"]["served"] == "openai.main/gpt-4o-mini"

            fail[0] = True  # OpenAI fails: the same request is answered by Anthropic
            out = run_shell(f"python -c {shlex.quote(snippet)}", port, env, tmp_path)
            assert out.split() == ["hello", "from", "anthropic", "claude-haiku-4-5"], out
            sent = [s.headers.get("authorization") for s in openai.server.seen]
            assert sent and all(h == f"Bearer {env['OPENAI_API_KEY']}" for h in sent)
            assert all(s.headers.get("x-api-key") == env["ANTHROPIC_API_KEY"] for s in anthropic.server.seen)


def test_the_gateway_quickstart_without_keys(tmp_path):
    serve, curl = commands(blocks("sh")[2])
    assert "--config" not in serve
    env = shell_env({})
    port = free_port()
    with Gateway(serve, port, env, tmp_path):
        answer = json.loads(run_shell(curl, port, env, tmp_path))
    assert answer["choices"][0]["message"]["content"] == "ok"
    assert answer["model"] == "claude-sonnet-4"


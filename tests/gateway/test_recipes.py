"""The provider recipes (examples/recipes/, docs/recipes.md) against transcripts of what each
provider sends (tests/transcripts/recipes/, written from its documentation, each exchange naming
its source): the recipe's own config, its base URL on a loopback upstream that replays the
transcript, the real gateway, and the official openai SDK as the client. Each checks what the
client sees (text, finish reason, usage), what the provider was sent (path, credential header),
what the ledger bills, and what each error means for the walk (retry, fail over, or answer)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest

from relayline.adapters.sim.background import BackgroundGateway
from relayline.adapters.sim.loopback import BackgroundLoopback, Reply, Seen
from relayline.adapters.sim.recorder import JSON, SSE, Answer, openai_reply
from relayline.adapters.stores.ledger import LedgerStore
from relayline.machines.config import parse_config
from relayline.machines.plan import build_router

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "examples" / "recipes"
TRANSCRIPTS = Path(__file__).resolve().parents[1] / "transcripts" / "recipes"
NAMES = sorted(p.stem for p in RECIPES.glob("*.toml"))
KEY = "sk-recipe-4242"
HI = [{"role": "user", "content": "hi"}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]


def transcript(name: str) -> dict[str, dict]:
    return {e["name"]: e for e in tomllib.loads((TRANSCRIPTS / f"{name}.toml").read_text())["exchange"]}


class Replay(BackgroundLoopback):
    """Answers /<exchange>/... with that exchange of the transcript, as the provider sent it,
    and /backup/... as a plain OpenAI-compatible backup would."""

    def __init__(self, exchanges: dict[str, dict]) -> None:
        super().__init__(self._answer)
        self.exchanges = exchanges

    def _answer(self, seen: Seen) -> Reply:
        first = seen.path.split("/")[1]
        if first == "backup":
            body = seen.body or {}
            stream = bool(body.get("stream"))
            return Reply(headers=SSE if stream else JSON,
                         pieces=openai_reply(Answer(text="from the backup"), body.get("model", ""), stream))
        exchange = self.exchanges[first]
        headers = (("content-type", exchange["content_type"]), *exchange.get("headers", {}).items())
        return Reply(status=exchange["status"], headers=headers, pieces=(exchange["body"].lstrip("\n").encode(),))


def recipe(name: str, up: Replay, exchange: str, backup: bool = False) -> dict:
    """The recipe's config, its base URL moved onto the loopback upstream (its path kept: what
    the provider is asked for is checked), with a plain backup after it when asked."""
    config = tomllib.loads((RECIPES / f"{name}.toml").read_text())
    config["reliability"] = {"provider_retries": 0, "backoff_ms": 50}
    alias = config["active"]
    profile = config["providers"][alias]
    if profile.pop("api_key_env", None):  # (a recipe with its key inline keeps it)
        profile["api_key"] = KEY
    profile["base_url"] = f"{up.url}/{exchange}{urlsplit(profile['base_url']).path}"
    profile["price"] = {"input_per_mtok": 1.0, "output_per_mtok": 2.0}
    if backup:
        profile["fallbacks"] = ["backup.main"]
        config["providers"]["backup.main"] = {"family": "openai", "base_url": f"{up.url}/backup/v1",
                                              "api_key": "sk-backup", "model": "backup-model"}
    return config


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=20)


def streamed(gw, model: str, **kwargs) -> tuple[str, str | None, dict | None, list]:
    """The text, the finish reason, the usage and the tool calls a streaming client read."""
    text, finish, usage, calls = [], None, None, []
    for chunk in client(gw).chat.completions.create(model=model, messages=HI, stream=True,
                                                    stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage.model_dump() if chunk.usage else usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    return "".join(text), finish, usage, calls


def run(name: str, exchange: str, tmp_path, backup: bool = False, ask=None):
    """One turn through the recipe against one exchange: what the client got (a raw response,
    what `ask(gw, model)` returned, or the SDK's error), what the provider saw, and the ledger."""
    path = tmp_path / f"{name}-{exchange}.sqlite3"
    with Replay(transcript(name)) as up:
        config = recipe(name, up, exchange, backup)
        model = config["providers"][config["active"]]["model"]
        with BackgroundGateway(config, ledger_path=str(path)) as gw:
            try:
                got = ask(gw, model) if ask else client(gw).chat.completions.with_raw_response.create(
                    model=model, messages=HI)
            except openai.APIStatusError as exc:
                got = exc
    return got, up.seen, [(r["provider"], r["input_tokens"], r["output_tokens"], r["accepted"])
                          for r in LedgerStore(path).rows()]


def attempts(got) -> list[str]:
    return got.parse().model_extra["relayline"]["attempts"]


def failed_over(got, seen, rows, reason: str) -> None:
    """The recipe's entry failed as `reason` once (no retry), and the backup answered."""
    assert got.parse().choices[0].message.content == "from the backup"
    assert [a.split()[-1] for a in attempts(got)] == [reason, "ok"]
    assert [s.path.split("/")[1] for s in seen][-1] == "backup" and rows[-1][0] == "backup.main"


@pytest.mark.parametrize("name", NAMES)
def test_each_recipe_loads_as_shipped_and_has_a_transcript(name):
    env = {v: "x" for v in ("AZURE_OPENAI_API_KEY", "GEMINI_API_KEY", "OPENROUTER_API_KEY", "GROQ_API_KEY",
                            "VLLM_API_KEY")}
    router = build_router(parse_config((RECIPES / f"{name}.toml").read_text()), env)
    assert router.warnings == ()
    data = tomllib.loads((TRANSCRIPTS / f"{name}.toml").read_text())
    assert data["sources"] and all(e["source"].startswith("https://") for e in data["exchange"])


# -- Azure OpenAI --------------------------------------------------------------------------------


def test_azure_sends_its_key_in_api_key_and_reads_a_filtered_stream(tmp_path):
    got, seen, rows = run("azure", "stream", tmp_path, ask=streamed)
    assert got[:2] == ("Hello! How can I help?", "stop")
    assert (got[2]["prompt_tokens"], got[2]["completion_tokens"]) == (18, 7)
    sent = seen[0]
    assert sent.path == "/stream/openai/v1/chat/completions"  # the v1 API: no deployment path, no api-version
    assert sent.headers["api-key"] == KEY and "authorization" not in sent.headers
    assert sent.body["stream_options"] == {"include_usage": True}
    assert rows == [("azure.main", 18, 7, 1)]


def test_azure_content_filter_is_a_rejection_and_its_429_a_cooldown(tmp_path):
    # the content filter's 400 is a client error (reliability.on_refusal = "return"); with
    # client_errors = "advance" (the default) the next entry is asked, once
    failed_over(*run("azure", "prompt_filtered", tmp_path, backup=True), "rejected")
    got, seen, rows = run("azure", "rate_limited", tmp_path, backup=True)
    failed_over(got, seen, rows, "rate_limited")
    assert len(seen) == 2  # advanced at once: no retry of the rate-limited deployment


# -- Google Gemini --------------------------------------------------------------------------------


def test_gemini_tool_call_said_stop_reaches_the_client_as_tool_calls(tmp_path):
    got, seen, rows = run("gemini", "stream_tool_call", tmp_path, ask=lambda gw, m: streamed(gw, m, tools=WEATHER))
    text, finish, usage, calls = got
    assert finish == "tool_calls"  # Gemini said "stop": the client's tool loop would end there
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")  # its empty id, replaced
    assert "".join(c.function.arguments or "" for c in calls) == '{"city":"Paris"}'
    assert seen[0].path == "/stream_tool_call/v1beta/openai/chat/completions"
    assert seen[0].headers["authorization"] == f"Bearer {KEY}"
    assert rows == [("gemini.main", 61, 16, 1)]


def test_gemini_errors_in_a_list_are_read(tmp_path):
    got, seen, rows = run("gemini", "invalid_argument", tmp_path)
    assert isinstance(got, openai.BadRequestError) and rows == []
    # the provider's own words reach the client (its error object sits in a list)
    assert got.body["message"] == "Function calling with a response mime type: 'application/json' is unsupported"
    assert got.body["type"] == "INVALID_ARGUMENT"
    # "you exceeded your current quota": no retry, the next entry at once
    got, seen, rows = run("gemini", "quota", tmp_path, backup=True)
    failed_over(got, seen, rows, "quota")
    assert len(seen) == 2


# -- OpenRouter -----------------------------------------------------------------------------------


def test_openrouter_comments_and_cost_in_usage(tmp_path):
    got, seen, rows = run("openrouter", "stream", tmp_path, ask=streamed)
    assert got[:2] == ("Hello there.", "stop")
    assert (got[2]["prompt_tokens"], got[2]["completion_tokens"]) == (194, 2)
    assert seen[0].path == "/stream/api/v1/chat/completions"
    assert seen[0].headers["x-title"] == "my-app" and seen[0].headers["http-referer"] == "https://example.com"
    # the tokens are billed at the profile's price; OpenRouter's own cost (credits) is not the ledger's
    assert rows == [("openrouter.main", 194, 2, 1)]


def test_openrouter_in_stream_error_fails_over_and_402_is_quota(tmp_path):
    got, seen, rows = run("openrouter", "stream_error", tmp_path, backup=True, ask=streamed)
    assert got[:2] == ("from the backup", "stop")  # the error came before any text: nothing was shown
    assert [s.path.split("/")[1] for s in seen] == ["stream_error", "backup"]
    got, seen, rows = run("openrouter", "no_credits", tmp_path, backup=True)
    failed_over(got, seen, rows, "quota")


# -- Groq -----------------------------------------------------------------------------------------


def test_groq_usage_and_length_finish(tmp_path):
    got, seen, rows = run("groq", "stream", tmp_path, ask=streamed)
    assert got[:2] == ("Fast inference, cut short", "length")
    assert (got[2]["prompt_tokens"], got[2]["completion_tokens"]) == (42, 5)
    assert seen[0].path == "/stream/openai/v1/chat/completions"
    assert rows == [("groq.main", 42, 5, 1)]


def test_groq_498_is_retried_and_429_cools_down(tmp_path):
    def retried(gw, model):
        return client(gw).chat.completions.with_raw_response.create(model=model, messages=HI)

    # flex capacity exhausted: retryable, so the entry's retry budget is spent before advancing
    path = tmp_path / "groq-flex.sqlite3"
    with Replay(transcript("groq")) as up:
        config = recipe("groq", up, "flex_capacity", backup=True)
        config["reliability"]["provider_retries"] = 1
        with BackgroundGateway(config, ledger_path=str(path)) as gw:
            got = retried(gw, "llama-3.3-70b-versatile")
    assert [a.split()[-1] for a in attempts(got)] == ["retryable", "retryable", "ok"]
    assert [s.path.split("/")[1] for s in up.seen] == ["flex_capacity", "flex_capacity", "backup"]
    got, seen, rows = run("groq", "rate_limited", tmp_path, backup=True)
    failed_over(got, seen, rows, "rate_limited")


# -- vLLM -----------------------------------------------------------------------------------------


def test_vllm_usage_comes_because_relayline_asks_for_it(tmp_path):
    got, seen, rows = run("vllm", "stream", tmp_path, ask=streamed)
    assert got[:2] == ("Local and quick.", "stop")
    assert seen[0].body["stream_options"] == {"include_usage": True} and seen[0].path == "/stream/v1/chat/completions"
    assert rows == [("vllm.local", 21, 5, 1)]


def test_vllm_top_level_errors_are_read(tmp_path):
    got, seen, rows = run("vllm", "context_window", tmp_path, backup=True)
    # an over-long prompt: returned at once for the caller to compact (no other entry is tried)
    assert isinstance(got, openai.BadRequestError) and got.body["code"] == "context_length_exceeded"
    assert [s.path.split("/")[1] for s in seen] == ["context_window"]
    got, seen, rows = run("vllm", "tools_not_enabled", tmp_path)
    assert isinstance(got, openai.BadRequestError)  # the server's own words, not a stand-in
    assert got.body["message"] == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    got, seen, rows = run("vllm", "unknown_model", tmp_path, backup=True)
    failed_over(got, seen, rows, "rejected")


# -- Ollama ---------------------------------------------------------------------------------------


def test_ollama_stream_and_a_model_not_pulled(tmp_path):
    got, seen, rows = run("ollama", "stream", tmp_path, ask=streamed)
    assert got[:2] == ("Hi from a laptop.", "stop") and rows == [("ollama.local", 26, 5, 1)]
    assert seen[0].headers["authorization"] == "Bearer ollama"
    got, seen, rows = run("ollama", "not_pulled", tmp_path, backup=True)
    failed_over(got, seen, rows, "rejected")

"""The shipped example configs load, and route as their comments say."""

from pathlib import Path

import pytest

from relayline.machines.config import parse_config
from relayline.machines.errors import ConfigError
from relayline.machines.plan import build_router, plan_turn

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ENV = {"ANTHROPIC_API_KEY": "x", "OPENAI_API_KEY": "x", "OPENROUTER_API_KEY": "x"}


@pytest.mark.parametrize("name", ["single.toml", "production.toml"])
def test_examples_load_without_warnings(name):
    router = build_router(parse_config((EXAMPLES / name).read_text()), ENV)
    assert router.warnings == ()


def test_production_needs_its_keys():
    with pytest.raises(ConfigError, match="ANTHROPIC_API_KEY"):
        build_router(parse_config((EXAMPLES / "production.toml").read_text()), {})


def test_production_routes_simple_turns_locally_and_complex_ones_to_the_cloud():
    router = build_router(parse_config((EXAMPLES / "production.toml").read_text()), ENV)
    simple = plan_turn(router, text="hi")
    assert simple.domain == "ollama.local" and simple.allowlist == {"ollama.local"}
    hard = plan_turn(router, text="Please analyze and design a refactor of this algorithm and prove its complexity bound")
    assert hard.domain == "anthropic.main"
    assert [e.label for e in hard.entries][:3] == ["anthropic.main/claude-sonnet-4-20250514",
                                                  "anthropic.main/claude-3-5-haiku-20241022", "openai.main/gpt-4o"]

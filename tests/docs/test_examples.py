"""The shipped example configs load, and route as their comments say."""

from pathlib import Path

import pytest

from relayline.machines.config import parse_config
from relayline.machines.errors import ConfigError
from relayline.machines.plan import build_router, plan_turn

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
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


CATALOG_ENV = {"GROQ_API_KEY": "x", "TOGETHER_API_KEY": "x", "FIREWORKS_API_KEY": "x", "DEEPINFRA_API_KEY": "x"}


def catalog_plan_output() -> str:
    import contextlib
    import io
    import os
    from unittest import mock

    from relayline.adapters.cli import main

    out = io.StringIO()
    with mock.patch.dict(os.environ, CATALOG_ENV), contextlib.redirect_stdout(out):
        assert main(["plan", str(EXAMPLES / "catalog.toml"), "--model", "llama-3.3-70b"]) == 0
    return out.getvalue().rstrip()


def test_catalog_example_loads_and_orders_its_hosts_by_price():
    router = build_router(parse_config((EXAMPLES / "catalog.toml").read_text()), CATALOG_ENV)
    assert router.warnings == () and set(router.catalog) == {"llama-3.3-70b", "deepseek-v3"}
    llama = plan_turn(router, model="llama-3.3-70b")
    assert [e.profile for e in llama.entries] == ["deepinfra.main", "groq.main", "together.main"]
    assert [e.profile for e in plan_turn(router, model="deepseek-v3").entries] == ["fireworks.main", "together.main"]


def test_the_manual_shows_the_catalog_examples_plan_as_it_is():
    readme = (EXAMPLES.parent / "docs" / "concepts.md").read_text()
    block = readme.split("<!-- catalog-plan:start")[1].split("<!-- catalog-plan:end -->")[0]
    shown = block.split("```\n", 1)[1].rsplit("\n```", 1)[0]
    assert shown == catalog_plan_output()


def test_production_bills_each_model_at_its_own_price():
    router = build_router(parse_config((EXAMPLES / "production.toml").read_text()), ENV)
    prices = {e.label: (e.price.input_per_mtok, e.price.output_per_mtok) for e in plan_turn(router, model="hint:cloud").entries}
    assert prices["anthropic.main/claude-sonnet-4-20250514"] == (3.0, 15.0)
    assert prices["anthropic.main/claude-3-5-haiku-20241022"] == (0.8, 4.0)
    assert prices["openai.main/gpt-4o"] == (2.5, 10.0)
    assert prices["openai.main/gpt-4o-mini"] == (0.15, 0.6)

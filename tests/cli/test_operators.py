"""Operators' paper cuts: `check` shows every problem in one pass, `plan` needs no key variables
(it sends nothing), and a config file that cannot be read is a ConfigError for an embedder too."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from relayline.adapters.relay import Relay
from relayline.machines.errors import ConfigError

BAD = """active = "a"
[providers.a]
family = "opnai"
base_url = "ftp://example.com"
api_key_env = "RELAYLINE_TEST_UNSET_KEY"
model = "m"
"""

KEYED = """active = "a"
[providers.a]
family = "openai"
api_key_env = "RELAYLINE_TEST_UNSET_KEY"
model = "gpt-4o"
fallbacks = ["b"]
[providers.b]
family = "anthropic"
api_key_env = "RELAYLINE_TEST_UNSET_KEY_2"
model = "claude-sonnet-4"
"""


def run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYLINE_TEST_")}
    return subprocess.run([sys.executable, "-m", "relayline.adapters.cli", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_check_reports_every_problem_in_one_pass(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(BAD)
    done = run("check", str(path))
    assert done.returncode == 1
    assert "providers.a.base_url: must be an http(s) URL" in done.stderr
    assert "providers.a.family: unknown family 'opnai'" in done.stderr
    assert "providers.a.api_key_env: environment variable RELAYLINE_TEST_UNSET_KEY is not set" in done.stderr


def test_plan_needs_no_key_variables_and_notes_the_unset_ones(tmp_path):
    path = tmp_path / "keyed.toml"
    path.write_text(KEYED)
    done = run("plan", str(path))
    assert done.returncode == 0, done.stderr
    assert "a                        gpt-4o" in done.stdout and "b                        claude-sonnet-4" in done.stdout
    assert "RELAYLINE_TEST_UNSET_KEY, RELAYLINE_TEST_UNSET_KEY_2" in done.stderr
    assert run("check", str(path)).returncode == 1  # what serve needs is still checked


def test_from_file_on_a_missing_file_is_a_config_error_naming_it(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="nope.toml: No such file or directory"):
        Relay.from_file(missing)
    bad = tmp_path / "bad.toml"
    bad.write_text("active = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Relay.from_file(bad)


def test_a_short_key_is_masked_as_a_whole_word_and_never_inside_other_words():
    import io
    import logging

    from relayline.adapters.logs import configure
    from relayline.adapters.redact import redact
    from relayline.machines.config import structure_config

    long_key = "sk-live-0123456789abcdef"
    Relay(structure_config({"active": "a", "providers": {"a": {"family": "sim", "model": "m", "api_key": "e", "fallbacks": ["b"]},
                                                         "b": {"family": "sim", "model": "m", "api_key": long_key}}}))
    out, root = io.StringIO(), logging.getLogger()
    saved = root.handlers[:], root.level
    configure("info", "text", stream=out)
    try:
        logging.getLogger("relayline").warning("turn_failed outcome=error requested=relayline/e key=%s other=%s",
                                               "e", long_key + "-suffix")
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    line = out.getvalue()
    assert "turn_failed outcome=error requested=relayline/*** key=*** other=***-suffix" in line
    assert redact("the key e leaked; keep eels") == "the key *** leaked; keep eels"

"""Reply scripts are strict: a key a reply or frame does not define, or a value of the wrong type,
is an error naming the file, the step and the key (a typo must never turn into a different
fault); `{ status = 200, malformed_body = true }` is a malformed 200, not an HTTP error; and the
format is documented in the repository, every key of it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relayline.adapters.cli import main
from relayline.adapters.providers.sim import FRAME_KEYS, REPLY_KEYS
from relayline.adapters.sim.simulate import ScenarioError, check_scenario, load_scenario

DOCS = Path(__file__).resolve().parents[2] / "docs" / "scenario-files.md"

HEAD = """name = "{name}"
[config]
active = "a"
[config.providers.a]
family = "sim"
model = "m1"
[[replies]]
provider = "a"
script = [ {script} ]
[[requests]]
[requests.expect]
outcome = "ok"
"""


def scenario(tmp_path, script: str, name: str = "s") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(HEAD.format(name=name, script=script))
    return path


@pytest.mark.parametrize("script, problem", [
    ('{ text = "ok" }, { stauts = 503 }', "replies[0].script[1]: unknown key 'stauts'"),
    ('{ status = "503" }', "replies[0].script[0].status: expected a whole number, got '503'"),
    ('{ status = 503, retry_after = "soon" }', "replies[0].script[0].retry_after: expected a number"),
    ('{ frames = [ { text = "a" }, { wiat = 1 } ] }', "replies[0].script[0].frames[1]: unknown key 'wiat'"),
    ('{ frames = [ { usage = [1] } ] }', "replies[0].script[0].frames[0].usage: expected [IN, OUT]"),
    ('{ status = 200 }', "replies[0].script[0].status: 200 is no HTTP error"),
    ('{ malformed_body = true }', "replies[0].script[0].malformed_body: goes with status = 200"),
    ('{ text = "x", finish = "done" }', "replies[0].script[0].finish = 'done'"),
])
def test_a_wrong_key_or_type_is_an_error_naming_the_file_step_and_key(tmp_path, capsys, script, problem):
    path = scenario(tmp_path, script)
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    assert str(path) in str(caught.value) and problem in str(caught.value)
    assert main(["simulate", str(path)]) == 1
    assert problem in capsys.readouterr().out


def test_an_unknown_key_of_a_replies_table_is_an_error(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(HEAD.format(name="t", script='{ text = "ok" }').replace('provider = "a"', 'provider = "a"\nmodle = "m1"'))
    with pytest.raises(ScenarioError, match=r"replies\[0\]: unknown key 'modle'"):
        load_scenario(path)


@pytest.mark.parametrize("http", [None, "openai", "anthropic"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_200_fails_as_malformed_and_the_next_reply_serves(tmp_path, http, stream):
    path = scenario(tmp_path, '{ status = 200, malformed_body = true }, { text = "fine" }')
    loaded = load_scenario(path)
    request = {**loaded.requests[0], "stream": stream}
    report = check_scenario(type(loaded)(loaded.name, loaded.source, loaded.config, loaded.replies, (request,)),
                            http=http)
    attempt = report.trace["requests"][0]["attempts"][0]
    assert report.ok, report.failures
    assert attempt["reason"] == "malformed" if stream else attempt["outcome"] == "malformed"
    assert report.trace["requests"][0]["text"] == "fine"


def test_the_format_is_documented_in_the_repository_every_key_of_it(capsys):
    text = DOCS.read_text()
    documented = set(re.findall(r"`\{? ?(\w+) = ", text)) | set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    assert set(REPLY_KEYS) <= documented, set(REPLY_KEYS) - documented
    assert set(FRAME_KEYS) <= documented, set(FRAME_KEYS) - documented
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    help_text = "".join(capsys.readouterr().out.split())  # (argparse wraps its lines, at hyphens too)
    # the page it names is the repository's own, and no other document is named
    assert "docs/scenario-files.md" in help_text and help_text.count(".md") == help_text.count("scenario-files.md")

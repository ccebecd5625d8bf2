"""`relayline check` and `relayline plan` on the shared scenarios' configs, as an operator runs them."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[3] / "shared" / "conformance"
pytestmark = pytest.mark.skipif(not SHARED.exists(), reason="no ../shared beside this checkout")


def _config_file(tmp_path, scenario):
    raw = tomllib.loads((SHARED / scenario).read_text())
    lines = []

    def emit(prefix, table):
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict) and not (isinstance(v, list) and v and isinstance(v[0], dict))}
        if prefix:
            lines.append(f"[{prefix}]")
        for k, v in scalars.items():
            lines.append(f"{json.dumps(k)} = {json.dumps(v)}")
        for k, v in table.items():
            if isinstance(v, dict):
                emit(f"{prefix}.{json.dumps(k)}" if prefix else json.dumps(k), v)
            elif isinstance(v, list) and v and isinstance(v[0], dict):
                for item in v:
                    lines.append(f"[[{json.dumps(k)}]]")
                    lines.extend(f"{json.dumps(a)} = {json.dumps(b)}" for a, b in item.items())

    emit("", raw["config"])
    path = tmp_path / "relayline.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(*args):
    return subprocess.run([sys.executable, "-m", "relayline.adapters.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_plan_json_lists_the_attempt_order_of_scenario_08(tmp_path):
    out = run("plan", _config_file(tmp_path, "08_attempt_order.toml"), "--json", "--model", "requested-model")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert [(e["provider"], e["model"]) for e in plan["entries"]] == [
        ("sim.a", "m1"), ("sim.a", "m2"), ("sim.b", "n1"), ("sim.c", "requested-model"), ("sim.d", "d1")]
    assert plan["domain"] == "sim.a" and plan["allowlist"] is None and plan["effort"] is None
    assert [e["pinned"] for e in plan["entries"]] == [True, True, True, False, True]


def test_check_prints_every_warning_code_of_scenario_09_and_exits_0(tmp_path):
    out = run("check", _config_file(tmp_path, "09_graph_warnings.toml"))
    assert out.returncode == 0
    for code in ("dangling_fallback_ref", "fallback_cycle", "empty_fallback_model", "fallback_model_duplicates_primary"):
        assert code in out.stdout
    assert "sim.ghost" in out.stdout


def test_check_on_scenario_10_exits_1_naming_the_profile(tmp_path):
    out = run("check", _config_file(tmp_path, "10_missing_credential.toml"))
    assert out.returncode == 1 and "openai.backup" in out.stderr


def test_check_names_key_paths_of_bad_values(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('active = "a"\n[providers.a]\nfamily = "sim"\nfallbacks = "b"\n[reliability]\nbackoff_ms = "x"\n')
    out = run("check", path)
    assert out.returncode == 1
    assert "providers.a.fallbacks: expected a list" in out.stderr
    assert "reliability.backoff_ms: expected an integer" in out.stderr


def test_plan_table_shows_effort_and_allowlist(tmp_path):
    out = run("plan", _config_file(tmp_path, "19_effort_allowlist.toml"), "--text", "hi")
    assert out.returncode == 0
    assert "simple -> hint:local" in out.stdout and "no (allowlist)" in out.stdout


def test_check_reads_the_structured_outputs_capability(tmp_path):
    profile = 'active = "a"\n[providers.a]\nfamily = "anthropic"\napi_key = "sk-check-0001"\nprice = {}\n'
    path = tmp_path / "so.toml"
    path.write_text(profile + "capabilities = { structured_outputs = false }\n")
    assert run("check", path).returncode == 0
    path.write_text(profile + 'capabilities = { structured_outputs = "no" }\n')
    out = run("check", path)
    assert out.returncode == 1 and "providers.a.capabilities.structured_outputs: expected a boolean" in out.stderr

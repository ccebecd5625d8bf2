"""Every scenario, shared (../shared/conformance) and the project's own (tests/scenarios), must
pass unchanged through the real core and the real trio driver on virtual time."""

from pathlib import Path

import pytest

from relayline.adapters.sim.simulate import check_scenario, load_scenario

ROOT = Path(__file__).resolve().parents[2]
SHARED = sorted((ROOT.parent / "shared" / "conformance").glob("*.toml"))
OWN = sorted((ROOT / "tests" / "scenarios").glob("*.toml")) + [ROOT / "adapters" / "sim" / "demo.toml"]


def _describe(report):
    return "\n".join(f"requests[{i}] {key}: expected {want!r}, actual {got!r}" for i, key, want, got in report.failures)


@pytest.mark.parametrize("path", SHARED, ids=lambda p: p.stem)
def test_shared_scenario(path):
    report = check_scenario(load_scenario(path))
    assert report.ok, _describe(report)


@pytest.mark.parametrize("path", OWN, ids=lambda p: p.stem)
def test_own_scenario(path):
    report = check_scenario(load_scenario(path))
    assert report.ok, _describe(report)


def test_the_shared_scenarios_are_present_when_shared_is():
    if not (ROOT.parent / "shared").exists():
        pytest.skip("no ../shared beside this checkout")
    assert len(SHARED) >= 22


def _uses_executed_tools(path) -> bool:
    return "executed_tool" in path.read_text()


@pytest.mark.parametrize("shape", ["openai", "anthropic"])
@pytest.mark.parametrize("path", SHARED + OWN, ids=lambda p: p.stem)
def test_scenario_over_real_http(path, shape):
    """The same scenarios with every sim profile served over loopback HTTP in a real protocol's
    shape (SSE bytes, JSON bodies, HTTP errors, refused connections): the adapters, the SSE
    decoder and the driver give the in-process results."""
    if shape == "openai" and _uses_executed_tools(path):
        pytest.skip("the OpenAI shape has no provider-executed tool events")
    report = check_scenario(load_scenario(path), http=shape)
    assert report.ok, _describe(report)

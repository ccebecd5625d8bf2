"""What a user installs: `python -m build` makes an sdist and a wheel without a warning, and the
wheel, installed into a fresh virtualenv outside the checkout, runs `relayline --version`,
`relayline demo` and `relayline simulate` on a scenario the sdist ships, from a folder that has
no checkout in it."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
SCENARIO = "tests/scenarios/k01_catalog_cost_order.toml"


def clean_env() -> dict[str, str]:
    """The environment without this checkout's virtualenv and without the settings that make
    setuptools warn on its own (byte-compiling off)."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONHOME"}}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(ROOT)))
    return env


def run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("dist")
    done = run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], ROOT, 300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    warnings = [line for line in (done.stdout + done.stderr).splitlines() if "warning" in line.lower()]
    assert not warnings, "the build warned:\n" + "\n".join(warnings)
    wheel = out / f"relayline-{VERSION}-py3-none-any.whl"
    sdist = out / f"relayline-{VERSION}.tar.gz"
    assert wheel.is_file() and sdist.is_file(), sorted(p.name for p in out.iterdir())
    return wheel, sdist


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> tuple[Path, Path]:
    """A fresh virtualenv outside the checkout with the wheel (and its dependencies) in it, and
    a working folder beside it."""
    wheel, _ = built
    home = tmp_path_factory.mktemp("user")
    venv = home / "venv"
    done = run([sys.executable, "-m", "venv", str(venv)], home, 120)
    assert done.returncode == 0, done.stderr
    done = run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)], home, 600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    work = home / "work"
    work.mkdir()
    return venv / "bin" / "relayline", work


def test_the_sdist_ships_the_manual_the_examples_and_the_scenarios(built):
    _, sdist = built
    with tarfile.open(sdist) as tar:
        names = {Path(n).relative_to(f"relayline-{VERSION}").as_posix() for n in tar.getnames() if "/" in n}
    assert {"README.md", "CHANGELOG.md", "mkdocs.yml", "docs/index.md", "docs/concepts.md",
            "examples/gateway.toml", "examples/quickstart.toml", SCENARIO} <= names


def test_the_wheel_runs_outside_the_checkout(installed):
    relayline, work = installed
    version = run([str(relayline), "--version"], work, 60)
    assert version.returncode == 0 and version.stdout.strip() == f"relayline {VERSION}", version.stderr

    demo = run([str(relayline), "demo"], work, 180)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "served by openai.backup" in demo.stdout and "persisted; the request is not replayed" in demo.stdout


def test_the_wheel_simulates_a_shipped_scenario(built, installed):
    _, sdist = built
    relayline, work = installed
    with tarfile.open(sdist) as tar:
        member = tar.getmember(f"relayline-{VERSION}/{SCENARIO}")
        (work / "scenario.toml").write_bytes(tar.extractfile(member).read())
    done = run([str(relayline), "simulate", "scenario.toml"], work, 120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("PASS scenario.toml") and "1 of 1 scenarios pass" in done.stdout

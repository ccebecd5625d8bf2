"""The layout installs as one namespace: relayline.machines, relayline.adapters, relayline.specs."""

import subprocess
import sys


def run(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)


def test_the_packages_import_under_relayline_and_ship_their_specs(tmp_path):
    out = run("import relayline.machines, relayline.adapters\n"
              "from importlib import resources\n"
              "print(resources.files('relayline.specs').joinpath('stream.toml').is_file() and "
              "resources.files('relayline.adapters.sim').joinpath('demo.toml').is_file())", tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


def test_no_top_level_machines_or_adapters(tmp_path):
    for name in ("machines", "adapters", "specs"):
        assert run(f"import {name}", tmp_path).returncode != 0

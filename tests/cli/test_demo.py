"""`make demo` runs `relayline demo`: it must exit 0 by itself and show what it promises."""

import subprocess
import sys


def test_the_demo_storyline_runs_and_shows_its_promises():
    out = subprocess.run([sys.executable, "-m", "relayline.adapters.cli", "demo"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "skipped:   anthropic.primary/claude-sonnet-4 breaker" in out.stdout
    assert "partial:   'Streaming a long answer'" in out.stdout
    assert "notice:    Note: openai.backup/gpt-4o-mini answered" in out.stdout
    assert "health (GET /admin/health)" in out.stdout
    # an error is shown whole (its attempts after the semicolon), never cut mid-sentence
    error = next(line for line in out.stdout.splitlines() if line.strip().startswith("error:"))
    assert "; #1 openai.backup/gpt-4o-mini" in error and not error.rstrip().endswith(";")


def test_the_simulated_demo_names_itself_once():
    out = subprocess.run([sys.executable, "-m", "relayline.adapters.cli", "demo", "--simulated"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("relayline demo: ") and "relayline relayline" not in out.stdout

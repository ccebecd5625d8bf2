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

"""The library's snippets, in the README's quickstart and in the manual's library page: every one
runs as written, from the repository root."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import relayline.adapters as public

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
QUICKSTART = README[README.index("## Quickstart: the library"):README.index("## The command line")]
LIBRARY = (ROOT / "docs" / "library.md").read_text()


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


SNIPPETS = python_blocks(QUICKSTART) + python_blocks(LIBRARY)


@pytest.mark.parametrize("text", [QUICKSTART, LIBRARY], ids=["readme", "manual"])
def test_each_shows_the_three_hosts(text):
    snippets = python_blocks(text)
    assert len(snippets) >= 3
    assert any("trio.run(" in s for s in snippets) and any("asyncio.run(" in s for s in snippets)
    assert any("complete_sync(" in s and "stream_sync(" in s for s in snippets)


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_snippet_runs_as_written(snippet):
    done = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "ok" in done.stdout


def test_the_public_surface_exports_what_it_lists_and_every_error_is_a_relayline_error():
    assert sorted(public.__all__) == public.__all__ and all(hasattr(public, n) for n in public.__all__)
    errors = [getattr(public, n) for n in public.__all__
              if isinstance(getattr(public, n), type) and issubclass(getattr(public, n), Exception)]
    assert {e.__name__ for e in errors} == {"ConfigError", "RelaylineError", "StreamInterruptedAfterOutput",
                                            "TurnError", "WireError"}
    assert all(issubclass(e, public.RelaylineError) for e in errors)
    assert public.ErrorReason("context_window") == "context_window"
    assert (ROOT / "adapters" / "py.typed").exists()


def test_run_turn_seams_are_not_public():
    # on an instance, not the class: a seam set in __init__ is on the instance only
    from relayline.adapters.turns import Turns

    with public.Relay.from_file(ROOT / "examples" / "quickstart.toml") as relay:
        names = [n for n in dir(relay) if not n.startswith("_")]
        assert not {"turns", "run_turn", "turn_factory"} & set(names)
        assert not [n for n in names if isinstance(getattr(relay, n), Turns)]

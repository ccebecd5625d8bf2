"""The repository stands on its own: no file of it sends a reader to a document kept outside it
as its authority, and its prose (the README, the manual, the changelog, the examples, the specs,
the Makefile, and every comment and docstring of the code) speaks of the product, not of how the
team that builds it works (no sessions, no lead, no issue numbers a reader cannot look up)."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

# a document that is not in the repository, named as where the truth lives
OUTSIDE = re.compile(r"\b(?:CONFIG|SCENARIOS|DESIGN)\.md\b|contract (?:is )?kept|kept beside the repository",
                     re.IGNORECASE)
# the shared conformance folder is a test input some checkouts have beside them, read by these
SHARED_READERS = {"tests/core/test_conformance.py", "tests/cli/test_cli.py", "Makefile"}
SHARED = re.compile(r"\.\./shared\b")
DIARY = re.compile(r"\bsessions?\b|\bthe lead\b|\bissues? #?\d+|\bengineers?\b|\bthe other helpers\b",
                   re.IGNORECASE)
PROSE_SUFFIXES = {".md", ".toml", ".yml", ".yaml", ".txt", ".cfg", ".mmd", ".dot"}
PROSE_NAMES = {"Makefile", "run", "services", ".gitignore"}
SKIP_PREFIXES = ("bench/results/", "adapters/gateway/static/")


def product_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return sorted(p for p in listed if p != THIS and not p.startswith(SKIP_PREFIXES) and (ROOT / p).is_file())


def python_prose(source: str) -> str:
    """A module's comments and docstrings: what it says in words, not its identifiers or data."""
    parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def prose_of(path: str, text: str) -> str | None:
    name = Path(path)
    if name.suffix == ".py":
        return python_prose(text)
    if name.suffix in PROSE_SUFFIXES or name.name in PROSE_NAMES:
        return text
    return None


def read(path: str) -> str | None:
    try:
        return (ROOT / path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None  # an image or other binary file


def hits(pattern: re.Pattern[str], text: str) -> list[str]:
    return [f"{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in pattern.finditer(text)]


def test_the_scan_sees_the_product():
    files = product_files()
    assert {"README.md", "docs/configuration.md", "machines/walk.py", "adapters/cli.py", "Makefile",
            "specs/walk.toml"} <= set(files)


@pytest.mark.parametrize("pattern,allowed", [(OUTSIDE, set()), (SHARED, SHARED_READERS)], ids=["documents", "shared"])
def test_no_file_names_an_outside_authority(pattern, allowed):
    found = {}
    for path in product_files():
        text = read(path)
        if text is not None and path not in allowed and (where := hits(pattern, text)):
            found[path] = where
    assert not found, f"files that point outside the repository: {found}"


def test_the_prose_speaks_of_the_product_not_of_the_team():
    found = {}
    for path in product_files():
        text = read(path)
        prose = prose_of(path, text) if text is not None else None
        if prose and (where := hits(DIARY, prose)):
            found[path] = where
    assert not found, f"prose that speaks of the team's work, not the product: {found}"


def test_the_checks_catch_what_they_look_for():
    assert hits(OUTSIDE, 'see CONFIG.md "The wire"') and hits(SHARED, "../shared/conformance")
    assert hits(DIARY, "measured in the ninth session") and hits(DIARY, "fixed for issue 17")
    assert hits(DIARY, "the lead's idle run") and not hits(DIARY, "the leading entry")
    assert python_prose('x = "session"  # a note\n\ndef f():\n    """Once a session."""\n') == "# a note\nOnce a session."

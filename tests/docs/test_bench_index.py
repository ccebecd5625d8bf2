"""The benches' paths as the docs give them: a script a doc names exists (a moved or removed
bench leaves no dangling name), and bench/README.md lists every script in bench/ and
bench/probes/ (a new one is described where a reader of the suite looks)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH_PATH = re.compile(r"\bbench/(?:probes/)?[a-z_]+\.py\b")


def _documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "Makefile", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_bench_script_a_doc_names_exists():
    missing = sorted({f"{doc.relative_to(ROOT)}: {path}" for doc in _documents()
                      for path in BENCH_PATH.findall(doc.read_text(encoding="utf-8")) if not (ROOT / path).is_file()})
    assert not missing, "named but absent: " + "; ".join(missing)


def test_the_bench_readme_lists_every_standing_script_and_every_probe():
    readme = (ROOT / "bench" / "README.md").read_text(encoding="utf-8")
    scripts = [*(ROOT / "bench").glob("*.py"), *(ROOT / "bench" / "probes").glob("*.py")]
    assert len(scripts) > 20
    unlisted = sorted(str(path.relative_to(ROOT)) for path in scripts
                      if not re.search(rf"\b{re.escape(path.name)}\b", readme))
    assert not unlisted, "not in bench/README.md: " + ", ".join(unlisted)


def _bench_imports(script: Path, benches: set[str]) -> set[str]:
    """The other benches `script` imports by their bare names (common.py aside)."""
    found = set()
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return (found & benches) - {"common", script.stem}


def test_the_bench_readme_names_every_import_of_one_bench_by_another():
    readme = (ROOT / "bench" / "README.md").read_text(encoding="utf-8")
    table = readme.split("## Imports beside common.py", 1)[1]
    listed: dict[str, set[str]] = {}
    for row in re.findall(r"^\| (?!script|---)(.+?) \| (.+?) \|$", table, re.MULTILINE):
        for script in row[0].split(", "):
            listed[script] = {name.strip() for name in row[1].split(",")}
    benches = {path.stem for path in (ROOT / "bench").glob("*.py")}
    scripts = [*(ROOT / "bench").glob("*.py"), *(ROOT / "bench" / "probes").glob("*.py")]
    actual = {str(path.relative_to(ROOT / "bench")): imports for path in scripts
              if (imports := _bench_imports(path, benches))}
    assert actual == listed

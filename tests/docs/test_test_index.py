"""The tests' paths as the repository gives them: a test path that a document, a comment or a
setting names exists (a moved, merged or removed test file leaves no dangling name), every test
file sits in the folder of a layer, and tests/README.md's map names exactly those folders."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
TEST_PATH = re.compile(r"\btests/[\w/*.-]*?\.py\b")
MAPPED_FOLDER = re.compile(r"^\| `([a-z]+)/` \|", re.MULTILINE)
# where a test path is named: prose, settings, and the code's own comments and docstrings
NAMING = ("*.md", "*.py", "*.toml", "*.txt", "*.json", "Makefile", "run", "services")


def _naming_files() -> list[Path]:
    roots = [ROOT / name for name in ("docs", "examples", "bench", "adapters", "machines", "tests", ".ci")]
    found = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / "mkdocs.yml"]
    for root in roots:
        found += [path for pattern in NAMING for path in root.rglob(pattern)
                  if path.is_file() and "node_modules" not in path.parts]
    return sorted(set(found))


def test_every_test_path_named_in_the_repository_exists():
    files = _naming_files()
    assert len(files) > 100
    missing = sorted({f"{path.relative_to(ROOT)}: {named}" for path in files
                      for named in TEST_PATH.findall(path.read_text(encoding="utf-8", errors="replace"))
                      if not list(ROOT.glob(named))})
    assert not missing, "named but absent: " + "; ".join(missing)


def test_every_test_file_is_in_a_folder_the_map_describes():
    readme = (TESTS / "README.md").read_text(encoding="utf-8")
    mapped = set(MAPPED_FOLDER.findall(readme))
    holding = {path.parent.name for path in TESTS.glob("*/test_*.py")}
    loose = sorted(path.name for path in TESTS.glob("test_*.py"))
    assert not loose, "test files outside a layer's folder (tests/README.md says which): " + ", ".join(loose)
    assert mapped == holding, f"tests/README.md maps {sorted(mapped)}; the folders with tests are {sorted(holding)}"


def test_a_test_file_name_is_unique_across_the_folders():
    # pytest imports each test file by its bare name (no __init__.py): two of one name collide
    names = [path.name for path in TESTS.rglob("test_*.py") if "node_modules" not in path.parts]
    assert len(names) > 80
    assert sorted(names) == sorted(set(names)), "a name used twice: " + ", ".join(
        sorted({name for name in names if names.count(name) > 1}))

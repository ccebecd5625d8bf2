"""No import cycles, in the package or among the benches: each module can be read, tested and
moved with only what it imports, and a layer below never needs one above
(docs/architecture.md; `make lint` checks the layers themselves with import-linter)."""

from __future__ import annotations

import import_graph


def test_the_package_has_no_import_cycle_lazy_imports_included():
    found = import_graph.cycles(import_graph.import_graph(import_graph.package_modules()))
    assert not found, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in found)


def test_no_bench_imports_another_in_a_cycle():
    found = import_graph.cycles(import_graph.import_graph(import_graph.bench_modules()))
    assert not found, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in found)


def test_the_cycle_finder_sees_a_lazy_import_and_a_type_checking_one(tmp_path):
    """The finder itself: a cycle closed by an import inside a function, and one closed under
    TYPE_CHECKING, are both cycles; a one-way import is not."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def later():\n    import a\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from d import x\n")
    (tmp_path / "d.py").write_text("from c import y\n")
    (tmp_path / "e.py").write_text("import a\n")
    modules = {path.stem: path for path in tmp_path.glob("*.py")}
    assert sorted(import_graph.cycles(import_graph.import_graph(modules))) == [("a", "b", "a"), ("c", "d", "c")]

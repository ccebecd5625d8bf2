"""The manual (docs/, built by MkDocs in strict mode): it builds, a dead link or anchor in it fails
the build, it embeds the generated diagrams rather than copies of them, and its behaviour
reference names every scenario file of the repository."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from browser import Chromium, find_chromium

from relayline.machines.engine import SPEC_NAMES

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).parent / "mkdocs"


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(site)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def copy_of_the_manual(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copytree(ROOT / "specs" / "diagrams", root / "specs" / "diagrams")
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    return root


def test_the_manual_builds_in_strict_mode_and_the_readme_links_into_it(tmp_path):
    site = tmp_path / "site"
    done = build(ROOT, site)
    assert done.returncode == 0, done.stderr[-3000:]
    concepts = (site / "concepts" / "index.html").read_text()
    assert concepts.count("stateDiagram-v2") == len(SPEC_NAMES)  # every lifecycle, drawn from specs/diagrams
    links = re.findall(r"\]\(docs/([a-z0-9-]+)\.md(?:#([a-z0-9-]+))?\)", (ROOT / "README.md").read_text())
    assert len(links) >= 10
    for page, anchor in links:
        html = site / ("" if page == "index" else page) / "index.html"
        assert html.is_file(), f"README links to docs/{page}.md, which the manual does not build"
        assert not anchor or f'id="{anchor}"' in html.read_text(), f"README links to docs/{page}.md#{anchor}"


@pytest.mark.parametrize("dead", ["[a page](no-such-page.md)", "[an anchor](concepts.md#no-such-anchor)"])
def test_a_dead_link_fails_the_build(tmp_path, dead):
    root = copy_of_the_manual(tmp_path)
    with (root / "docs" / "trace.md").open("a") as page:
        page.write(f"\n{dead}\n")
    done = build(root, tmp_path / "site")
    assert done.returncode != 0 and dead.split("(")[1].rstrip(")") in done.stderr, done.stderr[-3000:]


def test_a_page_left_out_of_the_navigation_fails_the_build(tmp_path):
    root = copy_of_the_manual(tmp_path)
    (root / "docs" / "orphan.md").write_text("# An orphan\n")
    done = build(root, tmp_path / "site")
    assert done.returncode != 0 and "orphan.md" in done.stderr, done.stderr[-3000:]


def test_the_diagrams_are_embedded_not_copied():
    concepts = (ROOT / "docs" / "concepts.md").read_text()
    for name in SPEC_NAMES:
        assert f'--8<-- "{name}.mmd"' in concepts, name
    assert '--8<-- "walk-decisions.md"' in concepts
    for page in (ROOT / "docs").glob("*.md"):
        assert "generated from specs/" not in page.read_text(), f"{page.name} holds a copy of a generated diagram"


def test_the_behaviour_reference_names_every_scenario():
    reference = (ROOT / "docs" / "behaviour.md").read_text()
    named = set(re.findall(r"`([a-z]\d\d_[a-z0-9_]+\.toml)`", reference))
    files = {p.name for p in (ROOT / "tests" / "scenarios").glob("*.toml")}
    assert files - named == set(), "scenarios the behaviour reference does not name"
    assert named - files == set(), "the behaviour reference names scenarios that do not exist"


def test_the_diagrams_render_offline_in_a_real_browser(tmp_path):
    """The manual's diagrams are drawn by the Mermaid it ships, not one fetched from a CDN: a
    reader without network (or behind a strict proxy) sees every lifecycle drawn, and opening a
    page asks nothing of any host (no fonts either)."""
    if find_chromium() is None:
        pytest.skip("no chromium on PATH: install chromium (`make test` does, as root with apt-get)")
    site = tmp_path / "site"
    done = build(ROOT, site)
    assert done.returncode == 0, done.stderr[-3000:]
    # Material draws each diagram in a closed shadow root: a drawn one has a height
    drawn = ("[...document.querySelectorAll('div.mermaid')]"
             ".filter(d => d.getBoundingClientRect().height > 40).length")
    with Chromium(tmp_path) as browser:
        page = browser.page()
        page.navigate((site / "concepts" / "index.html").as_uri())
        page.wait_for(f"{drawn} === {len(SPEC_NAMES)}", timeout=30)
        fetched = [event["params"]["request"]["url"] for event in page.events
                   if event.get("method") == "Network.requestWillBeSent"]
    assert fetched and all(url.startswith(("file://", "data:")) for url in fetched), fetched

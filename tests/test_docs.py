"""The docs site: generated pages match their declarations, and mkdocs builds it with no warning
(broken links, pages missing from the nav)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_pages_match_the_schema_and_the_capability_table():
    done = subprocess.run([sys.executable, "docs/generate.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_site_builds_strictly(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    done = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "support" / "index.html").is_file()
    page = (tmp_path / "site" / "config-reference" / "index.html").read_text()
    assert "optim.lr" in page
    # the loss formulas typeset by the arithmatex extension, not plain text
    assert 'class="arithmatex"' in (tmp_path / "site" / "preferences" / "index.html").read_text()


def test_the_nav_lists_each_page_once():
    nav = [line.split(":", 1)[1].strip() for line in (ROOT / "mkdocs.yml").read_text().splitlines()
           if line.startswith("  - ") and line.rstrip().endswith(".md")]
    assert nav and len(nav) == len(set(nav)), [page for page in nav if nav.count(page) > 1]


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "./launch.sh" in readme and "./launch.sh test" in readme


def test_the_site_carries_the_screenshots_and_links_its_feature_pages():
    """Issue 33's docs: the pictures the tests' browser takes are on the pages, the home page links
    Preferences, the API and Access, web.md's tabs are sections (not a table of walls of text), the
    API's examples name both ports (the formulas: test_the_site_builds_strictly)."""
    pages = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.md")}
    shown = {(name, img) for name, text in pages.items()
             for img in ("login", "viewer", "configure", "ab-chat", "rewards", "data-preview") if f"(img/{img}.png)" in text}
    assert {img for _, img in shown} == {"login", "viewer", "configure", "ab-chat", "rewards", "data-preview"}, shown
    assert all((ROOT / "docs" / "img" / f"{img}.png").stat().st_size > 10_000 for _, img in shown)
    assert all(f"]({page})" in pages["index.md"] for page in ("preferences.md", "openai-api.md", "access.md"))
    assert all(f"\n## {tab}\n" in pages["web.md"] for tab in ("Configure", "Train", "Chat", "Checkpoints", "Runs"))
    assert "127.0.0.1:7860/v1" in pages["openai-api.md"] and "127.0.0.1:8000/v1" in pages["openai-api.md"]

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


def test_the_nav_lists_each_page_once():
    nav = [line.split(":", 1)[1].strip() for line in (ROOT / "mkdocs.yml").read_text().splitlines()
           if line.startswith("  - ") and line.rstrip().endswith(".md")]
    assert nav and len(nav) == len(set(nav)), [page for page in nav if nav.count(page) > 1]


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "./launch.sh" in readme and "./launch.sh test" in readme

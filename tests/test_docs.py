"""The manual (docs/, mkdocs.yml) builds with `mkdocs build --strict`: a broken link, a page left out of the
navigation, a missing anchor or an API reference to a name that does not exist fails the build, and so this test.
The README's links into the repository resolve too (GitHub renders it; mkdocs does not read it)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_manual_builds_strictly(tmp_path):
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                        "--site-dir", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    api = (site / "api" / "index.html").read_text()
    for name in ("kascade.enable", "kascade.KascadePlan", "kascade.ops.sparse_attention", "kascade.costs.plan_speedup"):
        assert f'id="{name}"' in api, f"the API reference lost {name}"
    results = (site / "results" / "index.html").read_text()
    assert "<table>" in results and "H100" in results and "H200" in results


def _slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) and GitHub give a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not re.match(r"https?://", link)]
    assert local, "the README links nothing of the repository"
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README links {link}: no such file"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"README links {link}: no such heading"


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in sorted((ROOT / "docs").rglob("*.md")):
        assert str(page.relative_to(ROOT / "docs")) in nav, f"{page} is not in mkdocs.yml's nav"

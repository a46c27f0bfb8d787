"""mkdocs.yml's strict build fails on a broken link, anchor or test reference (a small site that inherits it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _build(tmp_path: Path, page: str) -> subprocess.CompletedProcess:
    """Build a one-page site with the project's configuration; its repository is ``tmp_path``."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n## Figures\n")
    (tmp_path / "docs" / "page.md").write_text(page)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_it_holds():\n    pass\n")
    (tmp_path / "mkdocs.yml").write_text(
        f"INHERIT: {ROOT / 'mkdocs.yml'}\ndocs_dir: docs\nnav:\n  - index.md\n  - page.md\n"
        f"hooks:\n  - {ROOT / 'tools' / 'docs' / 'hooks.py'}\n"
    )
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_links_anchors_and_test_references_that_resolve_build(tmp_path):
    page = "# Page\n\n[home](index.md#figures) [proof](../tests/test_x.py) [it](../tests/test_x.py)\n"
    page = page.replace("[it]", "[test_x.py::test_it_holds]")
    result = _build(tmp_path, page)
    assert result.returncode == 0, result.stderr
    assert "test_x.py::test_it_holds" in (tmp_path / "site" / "page" / "index.html").read_text()


def test_a_broken_link_anchor_file_or_test_name_fails_the_build_naming_each(tmp_path):
    page = (
        "# Page\n\n[a](index.md#nowhere) [b](missing.md) [c](../tests/test_gone.py) "
        "[test_x.py::test_renamed](../tests/test_x.py)\n"
    )
    result = _build(tmp_path, page)
    assert result.returncode != 0
    for named in ("#nowhere", "missing.md", "tests/test_gone.py", "test_x.py::test_renamed"):
        assert named in result.stderr, f"{named} not reported:\n{result.stderr}"

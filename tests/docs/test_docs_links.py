"""README.md's relative links: each names a file of the repository, and each #anchor a heading (or id) there.

README.md lies outside the site's docs/ (``mkdocs build --strict`` checks the links of the pages inside it).
Anchors are GitHub's (the site's toc uses the same slugs: mkdocs.yml)."""

from __future__ import annotations

import re
from pathlib import Path

from pymdownx.slugs import slugify

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"(?<!\\)\[(?:[^\]\n]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_slug = slugify(case="lower")


def anchors(path: Path) -> set[str]:
    """The anchors a Markdown file offers: its headings' slugs and any explicit id."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    found = set(re.findall(r"\bid=\"([^\"]+)\"", text)) | set(re.findall(r"\{\s*#([\w-]+)[^}]*\}", text))
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.MULTILINE):
        heading = re.sub(r"\{\s*#[^}]*\}$", "", heading)  # attr_list's explicit id, counted above
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
        found.add(_slug(re.sub(r"[`*]", "", heading).strip(), "-"))
    return found


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file or anchor does not exist, with why."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    problems = []
    for m in LINK.finditer(text):
        target = m.group("target")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            problems.append(f"{target}: no file {file_part}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: {dest.name} has no heading or id '{anchor}'")
    return problems


def test_every_relative_link_of_the_readme_resolves():
    assert broken_links(ROOT / "README.md") == []


def test_a_missing_file_or_anchor_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## The `--max-side N` flag\n\n<a id=\"cache\"></a>\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[ok](docs/guide.md#the---max-side-n-flag) [ok](docs/guide.md#cache) [ok](#readme)\n"
        "[web](https://x.org)\n"
        "# Readme\n\n[gone](docs/missing.md) [bad anchor](docs/guide.md#nowhere)\n\n"
        "```text\n[in code](nope.md)\n```\n"
    )
    assert broken_links(readme) == [
        "docs/missing.md: no file docs/missing.md",
        "docs/guide.md#nowhere: guide.md has no heading or id 'nowhere'",
    ]

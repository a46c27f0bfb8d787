"""MkDocs hook: links from the site's pages to files of the repository outside docs/ (a test, a script).

Such a link is written relative to the page, as GitHub resolves it (``../../tests/train/test_train.py``). The
build checks that the file exists and that every ``::name`` in the link's text is a function or class of
it; a broken one is a warning, which ``mkdocs build --strict`` turns into a failure. On the site the link
points at the file on ``repo_url`` when mkdocs.yml sets one, and is plain text otherwise."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.plugins import get_plugin_logger

log = get_plugin_logger(__name__)

LINK = re.compile(r"\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def repo_target(page_src: Path, target: str, docs_dir: Path, root: Path) -> Path | None:
    """The repository file a relative link points at, when it leaves ``docs_dir``; None for any other link."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
        return None
    path = (page_src.parent / target).resolve()
    if path.is_relative_to(docs_dir.resolve()) or not path.is_relative_to(root.resolve()):
        return None
    return path


def missing_names(path: Path, text: str) -> list[str]:
    """The ``::name`` parts of a link's text that ``path`` does not define (``def name`` or ``class name``)."""
    names = re.findall(r"::(\w+)", text)
    if not names or not path.is_file():
        return []
    source = path.read_text(encoding="utf-8", errors="replace")
    return [n for n in names if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{n}\b", source, re.MULTILINE)]


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs_dir = Path(config["docs_dir"])
    root = Path(config["config_file_path"]).parent
    page_src = docs_dir / page.file.src_path
    repo_url = (config.get("repo_url") or "").rstrip("/")
    fences = [m.span() for m in FENCE.finditer(markdown)]

    def replace(m: re.Match) -> str:
        if any(a <= m.start() < b for a, b in fences):
            return m.group(0)
        path = repo_target(page_src, m.group("target"), docs_dir, root)
        if path is None:
            return m.group(0)
        rel = path.relative_to(root.resolve()).as_posix()
        if not path.exists():
            log.warning("%s links to '%s', which is not in the repository", page.file.src_path, rel)
        for name in missing_names(path, m.group("text")):
            log.warning("%s links to '%s::%s', which %s does not define", page.file.src_path, rel, name, rel)
        if repo_url:
            return f"[{m.group('text')}]({repo_url}/blob/main/{rel}{m.group('anchor') or ''})"
        return m.group("text")

    return LINK.sub(replace, markdown)

"""The generated flag reference (docs/reference/*-flags.md): current with the code, and the same as --help."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools.docs import gen_reference

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {"train-flags.md": "mmfast.cli.train", "prepare-flags.md": "mmfast.cli.prepare"}


def test_the_committed_reference_pages_are_the_generated_ones():
    stale = [p.name for p, text in gen_reference.pages().items() if p.read_text(encoding="utf-8") != text]
    assert not stale, f"{stale} differ from the code's flags: run python tools/docs/gen_reference.py"


def test_the_check_mode_names_a_stale_page(tmp_path, monkeypatch, capsys):
    page = tmp_path / "train-flags.md"
    page.write_text("# Training flags\n\nan edit by hand\n")
    monkeypatch.setattr(gen_reference, "pages", lambda: {page: "# Training flags\n"})
    assert gen_reference.main(["--check"]) == 1
    assert "train-flags.md" in capsys.readouterr().err
    page.write_text("# Training flags\n")
    assert gen_reference.main(["--check"]) == 0


def _help_entries(module: str) -> dict[str, tuple[str, str, str]]:
    """{invocation: (meaning, choices, default)} of ``python -m module --help``, read from its text."""
    env = {**os.environ, "COLUMNS": "100000", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, env=env, timeout=120, check=True
    ).stdout
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln in ("positional arguments:", "options:"))
    entries: dict[str, list[str]] = {}
    current = None
    for ln in lines[start:]:
        if re.match(r"^  \S", ln):  # an action's line: its invocation, and its help after two spaces
            invocation, _, text = ln.strip().partition("  ")
            current = invocation
            entries[current] = [text.strip()]
        elif ln.startswith("   ") and current:  # its help continued on the next lines
            entries[current].append(ln.strip())
        else:
            current = None
    entries.pop("-h, --help", None)
    return {inv: _split(inv, " ".join(t for t in parts if t)) for inv, parts in entries.items()}


def _split(invocation: str, text: str) -> tuple[str, str, str]:
    default = choices = ""
    start = text.rfind("(default: ")  # the last: a meaning may name a default of its own in parentheses
    if start >= 0 and text.endswith(")"):
        text, default = text[:start].rstrip(), text[start + len("(default: ") : -1]
    if m := re.search(r";\s*choices: (.*)$", text):
        text, choices = text[: m.start()], m.group(1)
    elif m := re.search(r"\{([^}]*)\}", invocation):
        choices = m.group(1)
    return text, choices, default


def _page_entries(page: Path) -> dict[str, tuple[str, str, str]]:
    """{invocation: (meaning, choices, default)} of the page's flag tables."""
    entries = {}
    for ln in page.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\| <a id=\"[^\"]+\"></a>`([^`]+)` \| (.*) \|$", ln)
        if m:
            cells = [html.unescape(re.sub(r"\\(.)", r"\1", c)).strip() for c in re.split(r"(?<!\\)\|", m.group(2))]
            assert len(cells) == 3, f"{page.name}: a row without meaning, choices and default: {ln}"
            entries[m.group(1)] = tuple(cells)
    return entries


def _same(a: str, b: str) -> bool:
    return re.sub(r"\s+", "", a) == re.sub(r"\s+", "", b)


@pytest.mark.parametrize("page", sorted(COMMANDS))
def test_every_flag_of_help_is_on_its_page_with_the_same_meaning_choices_and_default(page):
    shown = _help_entries(COMMANDS[page])
    listed = _page_entries(ROOT / "docs" / "reference" / page)
    assert len(shown) > 20, f"--help of {COMMANDS[page]} parsed to only {sorted(shown)}"
    assert sorted(shown) == sorted(listed), f"{page}: flags differ from --help"
    for invocation, (meaning, choices, default) in shown.items():
        p_meaning, p_choices, p_default = listed[invocation]
        assert _same(meaning, p_meaning), f"{page}: {invocation}'s meaning differs from --help"
        assert _same(choices, p_choices), f"{page}: {invocation}'s choices differ from --help"
        assert _same(default, p_default), f"{page}: {invocation}'s default differs from --help"

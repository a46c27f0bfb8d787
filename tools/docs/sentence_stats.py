"""How long the sentences of Markdown files are: the writing rule of docs/contributing.md, measured.

    python tools/docs/sentence_stats.py README.md docs/guides [--json stats.json] [--show-long] [--check]

Counts only prose: fenced and indented code blocks, tables, headings, HTML comments, images and link
targets are left out; an inline code span is one word; a list item or a paragraph ends a sentence even
without a full stop. Prints a table (one row per file, then the total) and writes the same figures as JSON.
``--check`` exits 1 when the total misses the targets (mean <= 25 words, no sentence over 60).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

MEAN_TARGET = 25.0
LONG_WORDS = 60
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "approx.")
_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_LIST_ITEM = re.compile(r"^\s{0,3}([-*+]|\d+[.)])\s+")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")
_WORD = re.compile(r"\w")


@dataclass
class Sentence:
    """One sentence of prose: where it starts and its words."""

    path: str
    line: int
    text: str

    @property
    def words(self) -> int:
        return sum(1 for token in self.text.split() if _WORD.search(token))


def _blocks(markdown: str) -> list[tuple[int, str]]:
    """The prose blocks of a Markdown text: (first line number, text), one per paragraph or list item."""
    blocks: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    in_fence = in_indented_code = in_list = False
    prev_blank = True

    def close() -> None:
        nonlocal current
        if current:
            blocks.append((start, "\n".join(current)))
        current = []

    markdown = re.sub(r"<!--.*?-->", lambda m: "\n" * m.group().count("\n"), markdown, flags=re.S)
    for number, line in enumerate(markdown.splitlines(), 1):
        indented = line.startswith(("    ", "\t"))
        if _FENCE.match(line):
            close()
            in_fence = not in_fence
        elif in_fence:
            continue
        elif not line.strip():
            close()
        elif in_indented_code and indented or prev_blank and indented and not in_list:
            close()  # an indented code block (outside a list, after a blank line)
            in_indented_code = True
        elif line.lstrip().startswith(("|", "#", "<")):
            close()  # a table, a heading or an HTML line
            in_indented_code = False
        else:
            in_indented_code = False
            if _LIST_ITEM.match(line):
                close()
                in_list = True
                line = _LIST_ITEM.sub("", line, count=1)
            elif prev_blank and not line.startswith(" "):
                in_list = False  # a paragraph at the margin ends the list
            if not current:
                start = number
            current.append(line.strip().lstrip("> "))
        prev_blank = not line.strip()
    close()
    return blocks


def _prose(text: str) -> str:
    """The words of a block as a reader reads them: images dropped, links by their text, code as one word."""
    text = re.sub(r"(`+)(.+?)\1", lambda m: "CODE" + "\n" * m.group(2).count("\n"), text, flags=re.S)
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"\[([^\]]*)\]\[[^\]]*\]", r"\1", text)
    text = re.sub(r"<(https?://[^>]+)>", "LINK", text)
    return text.replace("**", "").replace("__", "")


def sentences(markdown: str, path: str = "") -> list[Sentence]:
    """Every sentence of prose in a Markdown text, in order.

    Args:
        markdown: the file's text.
        path: the file's name, carried into each sentence.

    Returns:
        the sentences with at least one word.
    """
    found = []
    for start, block in _blocks(markdown):
        if re.match(r"^\[[^\]]+\]:\s", block):  # a reference-style link definition
            continue
        text = _prose(block)
        for abbreviation in _ABBREVIATIONS:  # a full stop inside an abbreviation ends nothing
            hidden = abbreviation.replace(".", "\x00")
            text = re.sub(r"(?<!\w)" + re.escape(abbreviation), hidden, text, flags=re.I)
        ends = [m.span() for m in _SENTENCE_END.finditer(text)] + [(len(text), len(text))]
        begin = 0
        for end, next_begin in ends:
            piece = " ".join(text[begin:end].replace("\x00", ".").split())
            sentence = Sentence(path, start + text.count("\n", 0, begin), piece)
            begin = next_begin
            if sentence.words:
                found.append(sentence)
    return found


def stats(found: list[Sentence]) -> dict:
    """The figures of a list of sentences: count, words, mean words, sentences over LONG_WORDS, semicolons per
    100 words."""
    words = sum(s.words for s in found)
    semicolons = sum(s.text.count(";") for s in found)
    return {
        "sentences": len(found),
        "words": words,
        "mean_words": round(words / len(found), 1) if found else 0.0,
        f"over_{LONG_WORDS}": sum(1 for s in found if s.words > LONG_WORDS),
        "semicolons_per_100_words": round(100 * semicolons / words, 2) if words else 0.0,
    }


def _files(paths: list[str]) -> list[Path]:
    out = []
    for name in paths:
        p = Path(name)
        if p.is_dir():
            out.extend(sorted(p.rglob("*.md")))
        elif p.is_file():
            out.append(p)
        else:
            raise SystemExit(f"error: {name}: no such file or directory")
    return out


def _table(rows: dict[str, dict]) -> str:
    keys = ["sentences", "words", "mean_words", f"over_{LONG_WORDS}", "semicolons_per_100_words"]
    heads = ["file", "sentences", "words", "mean words", f"over {LONG_WORDS}", "; per 100 words"]
    width = max(len(heads[0]), *(len(name) for name in rows))
    lines = [f"{heads[0]:<{width}}  " + "  ".join(f"{h:>{len(h)}}" for h in heads[1:])]
    for name, row in rows.items():
        cells = (f"{row[k]!s:>{len(h)}}" for k, h in zip(keys, heads[1:], strict=True))
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("paths", nargs="+", help="Markdown files, or folders (their *.md, recursively)")
    parser.add_argument("--json", help="write the figures here as JSON ('-': to stdout, after the table)")
    parser.add_argument("--show-long", action="store_true", help=f"list the sentences over {LONG_WORDS} words")
    parser.add_argument(
        "--check", action="store_true", help=f"exit 1 unless mean <= {MEAN_TARGET:g} and none over {LONG_WORDS}"
    )
    args = parser.parse_args(argv)
    files = _files(args.paths)
    per_file = {str(p): sentences(p.read_text(encoding="utf-8"), str(p)) for p in files}
    rows = {name: stats(found) for name, found in per_file.items()}
    every = [s for found in per_file.values() for s in found]
    rows["total"] = stats(every)
    print(_table(rows))
    if args.show_long:
        for s in every:
            if s.words > LONG_WORDS:
                print(f"{s.path}:{s.line}: {s.words} words: {s.text}")
    if args.json == "-":
        print(json.dumps(rows, indent=2))
    elif args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    total = rows["total"]
    if args.check and (total["mean_words"] > MEAN_TARGET or total[f"over_{LONG_WORDS}"]):
        print(
            f"error: mean {total['mean_words']} words a sentence (target <= {MEAN_TARGET:g}), "
            f"{total[f'over_{LONG_WORDS}']} over {LONG_WORDS} words (target 0)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The rows an input reader returns (``Candidate``, or ``Reject`` with its reason) and the columns it reads them
by, and the reading of a text manifest's lines, shared by the JSONL and CSV readers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MAX_LINE_BYTES = 1 << 20  # a manifest row over 1 MiB is not a caption, it is a mistake
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pnm", ".jp2"}
NO_LABEL = "unlabeled"  # the one label of every row of an input read with Columns(label=None) (--no-labels)


class ManifestError(ValueError):
    """The manifest as a whole cannot be used (unreadable, unparseable, or no usable rows)."""


@dataclass(frozen=True)
class Columns:
    """Which columns of a table hold the image, the text and the label.

    Args:
        image, text, label: column names; ``label=None`` reads an input without labels (every row gets
            ``NO_LABEL``).
        names: the column names of a CSV/TSV without a header line (its first line is then a row).
        text_optional: a row whose text is empty or missing is read, its text "" (for a command that reads no
            caption: ``InputOptions.captions_needed``).
    """

    image: str = "image"
    text: str = "text"
    label: str | None = "label"
    names: tuple[str, ...] | None = None
    text_optional: bool = False

    def required(self) -> list[str]:
        text = None if self.text_optional else self.text
        return [c for c in (self.image, text, self.label) if c is not None]


@dataclass(slots=True)  # no per-object __dict__: preparation holds one per input row
class Candidate:
    """One input row that passed the manifest-level checks; its image is still to be validated."""

    line: int  # 1-based line number in the manifest (or index for an image folder)
    image: str  # absolute path
    text: str
    label: str | int
    source: dict = field(default_factory=dict)  # the row as given, for rejected.jsonl
    file: str = ""  # the input file the row came from, when an input has several (else the source)
    original: str = ""  # the image as given, when ``image`` is a downscaled copy of it (--max-side)
    width: int = 0  # the image's size, once validation decoded it (0: not yet)
    height: int = 0
    decoded: tuple[int, int] | None = None  # (height, width) as DALI decodes it, when validation recorded it


@dataclass
class Reject:
    line: int
    reason: str
    row: dict | str
    file: str = ""  # the input file the row came from, when an input has several (else the source)

    def to_json(self) -> dict:
        out = {"line": self.line, "reason": self.reason, "row": self.row}
        if self.file:
            out["file"] = self.file
        return out


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ManifestError(f"{path}: cannot read the manifest: {e.strerror or e}") from e


def split_lines(raw: bytes) -> list[tuple[int, bytes]]:
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    return [(i + 1, ln.rstrip(b"\r")) for i, ln in enumerate(raw.split(b"\n"))]


def not_utf8(line: int, raw: bytes, e: UnicodeDecodeError) -> Reject:
    return Reject(
        line,
        f"not UTF-8 ({e.reason} at byte {e.start}); re-encode the manifest",
        raw[:200].decode("utf-8", "replace"),
    )

"""The columns of a manifest the user did not name, told from its rows: a JSONL or CSV file whose captions are in
``caption`` (or ``title``, as open_clip's CSVs have them) is read without --text-column, as Parquet is. A
column named by its flag is never second-guessed; the default name wins where any row has it; another name is
taken only when every row has it, with a value of the kind the role needs (an image path or caption string, a
label string or integer), so that a field a few rows carry, or a list of labels, changes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from mmfast.inputs.base import LABEL_NAMES, TEXT_NAMES
from mmfast.inputs.manifest import Columns, ManifestError

log = logging.getLogger(__name__)

IMAGE_NAMES = ("image", "filepath", "file_name", "filename", "image_path", "img", "path", "file")
NAMES = {"image": IMAGE_NAMES, "text": TEXT_NAMES, "label": LABEL_NAMES}


def detect_columns(
    rows: list[tuple[int, dict]], columns: Columns, unnamed: frozenset[str], path: Path, jsonl: bool = False
) -> Columns:
    """``columns``, each role in ``unnamed`` ("image", "text", "label") whose default name no row has replaced by
    the first of its known names that every row has with a value of the role's kind; each choice is said.
    ``jsonl``: rows of JSON objects, where a field no row has is refused here (a CSV's header says it)."""
    present = {k for _, row in rows for k in row}
    if jsonl:
        _refuse_absent(columns, unnamed, present, path, rows)
    taken = {getattr(columns, role) for role in NAMES} - {None}
    chosen = {}
    for role, names in NAMES.items():
        current = getattr(columns, role)
        if role not in unnamed or current is None or current in present or not rows:
            continue
        found = next(
            (n for n in names if n not in taken and all(_fits(role, row.get(n)) for _, row in rows)), None
        )
        if found is not None:
            chosen[role] = found
            taken.add(found)
            log.warning(
                "%s: no '%s' field; the %s read from '%s' (--%s-column chooses another)",
                path.name, current, "captions" if role == "text" else f"{role}s", found, role,
            )  # fmt: skip
    return replace(columns, **chosen) if chosen else columns


def _refuse_absent(columns: Columns, unnamed: frozenset[str], present: set[str], path: Path, rows: list) -> None:
    """A column named by its flag that no row has, or an image or caption field no row has under any usual
    name: one error listing the rows' fields, not a reject per row."""
    if not rows:
        return
    for role in ("image", "text", "label"):
        name = getattr(columns, role)
        if name is None or name in present or (role == "text" and columns.text_optional):
            continue
        if role not in unnamed:
            raise ManifestError(
                f"{path}: no row has the field '{name}' (--{role}-column); the rows have {sorted(present)}"
            )
        if role != "label" and not any(n in present for n in NAMES[role]):  # no labels: a reader's own fallback
            usual = ", ".join(n for n in NAMES[role] if n != name)
            raise ManifestError(
                f"{path}: no row has the field '{name}' or another usual {role} field ({usual}); the rows have "
                f"{sorted(present)}: name yours with --{role}-column"
            )


def _fits(role: str, value) -> bool:
    """Whether ``value`` is of the kind ``role`` reads: a path or caption string, a label string or integer."""
    if role == "label":
        return isinstance(value, str | int) and not isinstance(value, bool)
    return isinstance(value, str)


def cell_name(role: str, given: str | None, row: dict) -> str:
    """The field ``role`` was read from in ``row``: the one named, else the default where the row has it, else
    the first known name it has (what ``detect_columns`` would have taken)."""
    if given:
        return given
    return next((n for n in NAMES[role] if n in row), role)

"""The columns of a manifest the user did not name, told from its rows: a JSONL or CSV file whose captions are in
``caption`` (or ``title``, as open_clip's CSVs have them) is read without --text-column, as Parquet is. A
column named by its flag is never second-guessed, and the default name wins where the rows have it."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from mmfast.inputs.base import LABEL_NAMES, TEXT_NAMES
from mmfast.inputs.manifest import Columns

log = logging.getLogger(__name__)

IMAGE_NAMES = ("image", "filepath", "file_name", "filename", "image_path", "img", "path", "file")
_LOOKED_AT = 100  # the first rows whose fields decide


def detect_columns(rows: list[tuple[int, dict]], columns: Columns, unnamed: frozenset[str], path: Path) -> Columns:
    """``columns``, each role in ``unnamed`` ("image", "text", "label") whose default name no row of the first
    ones has replaced by the first of its known names that they have; each choice is logged."""
    present: list[str] = []
    for _, row in rows[:_LOOKED_AT]:
        present += [k for k in row if isinstance(k, str) and k not in present]
    taken = {getattr(columns, role) for role in ("image", "text", "label")} - {None}
    chosen = {}
    for role, names in (("image", IMAGE_NAMES), ("text", TEXT_NAMES), ("label", LABEL_NAMES)):
        current = getattr(columns, role)
        if role not in unnamed or current is None or current in present:
            continue
        found = next((n for n in names if n in present and n not in taken), None)
        if found is not None:
            chosen[role] = found
            taken.add(found)
            log.info("%s: %s read from the field '%s' (--%s-column names another)", path.name, role, found, role)
    return replace(columns, **chosen) if chosen else columns

"""COCO captions JSON (``captions_*.json``): ``images`` + ``annotations``.

Each annotation ``{"image_id", "caption"}`` is an input row, numbered by its position in ``annotations``
(1-based). Its image is the ``file_name`` of the ``images`` entry with that id, relative to --image-root
(default: the JSON's folder). COCO captions carry no class, so the label is a field the user names
(looked up in the annotation, then in its image entry; an integer that is a ``categories`` id becomes that
category's name) or there is none (--no-labels).
"""

from __future__ import annotations

import json
from pathlib import Path

from mmfast.inputs.base import InputOptions, Reader
from mmfast.inputs.manifest import Candidate, Columns, ManifestError, Reject, check_rows


def read_coco(
    path: Path, opts: InputOptions, confine: bool, image_dir: Path | None = None
) -> tuple[list[Candidate], list[Reject]]:
    """Read a COCO captions file: one row per caption (``opts.coco_captions == "all"``) or per image
    (its first caption in file order)."""
    data = _load(path)
    if not opts.no_labels and not opts.label_column:
        raise ManifestError(
            f"{path}: COCO captions carry no class label; pass --label-column FIELD (a field of the annotations "
            "or of their images, e.g. a category id) or --no-labels"
        )
    images = {im["id"]: im for im in data["images"] if _has_id(im)}
    categories = {c["id"]: c.get("name") for c in data.get("categories") or [] if _has_id(c)}
    root = opts.image_folder(path.parent)
    label_field = opts.label_column
    rows, rejects, seen = [], [], set()
    for line, ann in enumerate(data["annotations"], start=1):
        if not isinstance(ann, dict):
            rejects.append(Reject(line, f"annotation is a JSON {type(ann).__name__}, expected an object", ann))
            continue
        image_id = ann.get("image_id")
        im = images.get(image_id) if isinstance(image_id, int | str) else None
        if im is None:
            rejects.append(Reject(line, f"image_id {image_id!r} is not an id in 'images'", ann))
            continue
        if opts.coco_captions == "first":
            if image_id in seen:
                continue  # not an input row in this mode: the image has its caption
            seen.add(image_id)
        row = {"image": im.get("file_name"), "text": ann.get("caption"), "image_id": image_id, "id": ann.get("id")}
        if label_field is not None:
            value = ann[label_field] if label_field in ann else im.get(label_field)
            if isinstance(value, int) and not isinstance(value, bool) and value in categories:
                value = categories[value]
            row["label"] = value
        rows.append((line, row))
    columns = Columns(label=None if opts.no_labels else "label", text_optional=not opts.captions_needed)
    cands, more = check_rows(rows, root, confine, from_csv=False, columns=columns)
    for r in more:
        if r.reason == "missing field 'label'":
            r.reason = f"missing field '{label_field}' (--label-column) in the annotation and its image"
        elif r.reason == "missing field 'image'":
            r.reason = f"image {r.row['image_id']!r} has no file_name"
        elif r.reason == "missing field 'text'":
            r.reason = "missing field 'caption'"
    return cands, rejects + more


def _has_id(entry: object) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("id"), int | str)


def _load(path: Path) -> dict:
    """The COCO file's object, checked to be a captions file: an ``images`` list and an ``annotations``
    list whose entries carry captions."""
    try:
        data = json.loads(path.read_bytes())
    except OSError as e:
        raise ManifestError(f"{path}: cannot read the COCO file: {e.strerror or e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path}: not a COCO JSON file: {e}") from e
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: a COCO file is an object with an 'images' list and an 'annotations' list")
    for key in ("annotations", "images"):
        if not isinstance(data.get(key), list):
            raise ManifestError(
                f"{path}: a COCO JSON with no {key!r} list; pass a captions_*.json file (it has 'images' and "
                "'annotations' with 'image_id' and 'caption')"
            )
    annotations = data["annotations"]
    if annotations and not any(isinstance(a, dict) and "caption" in a for a in annotations):
        raise ManifestError(
            f"{path}: its annotations have no 'caption' (an instances_*/person_keypoints_* file?); pass a "
            "captions_*.json file"
        )
    return data


# told from a .json file by its content (``mmfast.inputs.detect_kind``)
READER = Reader("coco", read_coco, image_root=True, row_noun="annotation")

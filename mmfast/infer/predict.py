"""Run a model directory on new data: rows in (a user's input read by ``infer.predict_inputs``, or a prepared
split), one prediction (or one error) per row out.

Images go through the same DALI eval pipeline and the texts through the same token cache as the training
run's evaluation (resize + center crop, the model's mean/std, captions truncated to its max_length and
padded to the longest in each batch), so a prepared split gets exactly the classes the engine's evaluation
gave it.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from mmfast.data.dataset import PreparedDataset
from mmfast.data.preprocessing import eval_resize
from mmfast.data.token_cache import TokenCache
from mmfast.data.validate import DALI_FORMATS, DEFAULT_MAX_PIXELS, check_images, image_header, pixel_budget_reason
from mmfast.infer.encode_inputs import BadImageError, check_on_error, pil_transform
from mmfast.infer.model_dir import MmfastModel
from mmfast.loading.arguments import EngineReading
from mmfast.loading.image_loader import ImageLoader
from mmfast.loading.multimodal import MultimodalLoader
from mmfast.remote.errors import redact
from mmfast.remote.objects import fetch_to, is_remote
from mmfast.tasks.classification import confusion_figures
from mmfast.util.fsutil import atomic_write_bytes, atomic_write_jsonl


def rows_loader(
    files: list[str], texts: list[str], model: MmfastModel, tokens_dir: Path, max_pixels: int, **kwargs
) -> MultimodalLoader:
    """MultimodalLoader's eval path over rows that were never prepared: the same DALI graph and host finishing
    (an ImageLoader with the engine's sampling and eval geometry), and a token cache built in ``tokens_dir``
    with the model's tokenizer. Sample ids are row positions."""
    cfg = model.config
    images = ImageLoader(
        files,
        None,
        ids=list(range(len(files))),
        shuffle=False,
        drop_last=False,
        train=False,
        size=cfg["image_size"],
        max_pixels=max_pixels,
        cache_decoded=False,  # one pass: nothing would read the held images again
        reading=EngineReading(),  # the files, in the engine's whole batches
        eval_geometry="dali",
        files_checked=True,  # each row's image was decoded (flag_unreadable): DALI runs whole batches
        **eval_resize(cfg),
        **_norm(cfg),
        **kwargs,
    )
    images.health.prepared = False  # rows checked here: a bad one is not a prepared directory's to re-prepare
    tokens = TokenCache.build(tokens_dir, "predict", texts, model.tokenizer, cfg["max_length"])
    return MultimodalLoader.join(images, tokens, cfg["num_classes"])


def _norm(cfg: dict) -> dict:
    if cfg.get("mean") is None:  # a text-only model: the image branch is not used, any normalization does
        return {}
    return {"mean": tuple(255 * m for m in cfg["mean"]), "std": tuple(255 * s for s in cfg["std"])}


@torch.no_grad()
def predict_rows(
    model: MmfastModel,
    rows: list[dict],
    *,
    batch_size: int | None = None,
    top_k: int = 3,
    device: str | torch.device = "cpu",
    num_workers: int | None = None,
    max_pixels: int | None = None,
    on_error: str = "skip",
) -> list[dict]:
    """Predict every usable row; rows with an "error" (or whose image turns out unreadable) keep it.

    Args:
        rows: {"image", "text", "label" (optional), "path" (optional: the file to read when "image" only names
            it, as ``mmfast.infer.predict_inputs`` gives for images stored as bytes)} or {"error"}.
        max_pixels: decoded-pixel budget per image, read from its header (default: the model's, its data's).
        on_error: what to do with an image training would refuse (missing, not an image, truncated, over
            ``max_pixels``): "skip" (the row gets the reason as its "error") or "raise" (``BadImageError``
            naming the image and why).

    Returns:
        one dict per input row, in order: the row's fields plus "class", "prob", "top_k" [[class, prob], ...]
        and "class_id", or "error" (also when every image is unreadable: no row is predicted then).
    """
    check_on_error(on_error)
    device = torch.device(device)
    out = [dict(r) for r in rows]
    max_pixels = max_pixels or model.config.get("max_pixels") or DEFAULT_MAX_PIXELS
    usable = flag_unreadable(out, max_pixels, num_workers, on_error)
    if not usable:
        return out
    with tempfile.TemporaryDirectory(prefix="mmfast-predict-") as tmp:
        loader = rows_loader(  # a name UTF-8 cannot encode reaches DALI through the loader's own link
            [image_file(rows[i]) for i in usable],
            [rows[i]["text"] for i in usable],
            model,
            Path(tmp),
            max_pixels,
            batch_size=batch_size or model.config.get("eval_batch_size") or 64,
            device=device,
            fp16=device.type == "cuda",
            num_workers=num_workers,
            on_bad_image="skip",
        )
        _predict_batches(model, loader, [out[i] for i in usable], top_k)
        for pos, reason in loader.bad.items():
            bad_image(out[usable[pos]], reason, on_error)
    for row in out:  # anything neither predicted nor flagged (should not happen) is said, not dropped
        if "class" not in row and not row.get("error"):
            row["error"] = "no prediction came back for this row"
    return out


def _predict_batches(model: MmfastModel, loader: MultimodalLoader, targets: list[dict], top_k: int) -> None:
    """Fill in ``targets`` (the loader's rows, by sample id) with the class, its probability and the top-k, or
    the reason a row has none (its logits not finite); the loader's ``bad`` says whose image was unreadable."""
    names = model.class_names
    k = min(top_k, len(names))
    try:
        for batch in loader:
            ids = batch["id"].cpu().numpy()  # note: a sync point per batch (the rows the results belong to)
            logits = model(batch).float()  # (B, C)
            finite = torch.isfinite(logits).all(dim=1).cpu().numpy()  # (B,)
            top_p, top_i = torch.softmax(logits, dim=1).topk(k, dim=1)
            top_p, top_i = top_p.cpu().numpy(), top_i.cpu().numpy()
            for b in np.flatnonzero(ids >= 0):
                row = targets[int(ids[b])]
                if not finite[b]:
                    row["error"] = "the model gave non-finite logits (NaN or inf) for this row"
                    continue
                row.update(
                    class_id=int(top_i[b, 0]),
                    **{"class": names[top_i[b, 0]]},
                    prob=float(top_p[b, 0]),
                    top_k=[[names[c], float(p)] for c, p in zip(top_i[b], top_p[b], strict=True)],
                )
    except ValueError:
        if len(loader.bad) < len(targets):  # the loader stops when every image is bad; anything else is not ours
            raise


def flag_unreadable(
    rows: list[dict], max_pixels: int, workers: int | None = None, on_error: str = "skip"
) -> list[int]:
    """Give each row whose image cannot be read an "error" in words (``bad_image``: or raise, as ``on_error``
    says); returns the positions of the others.

    Each image is checked as preparation checks it, before DALI sees it: its header (``image_problem``), then
    a full decode with PIL in ``workers`` processes and DALI's CPU decoder on the survivors
    (``validate.check_images``). A file with a good header and a cut-off body (a truncated PNG) crashed
    DALI's parser (SIGSEGV) instead of raising, so a header check alone does not do.
    """
    for r in rows:  # said in words, from the file's header; DALI would only skip it
        problem = "" if r.get("error") else image_problem(r, max_pixels)
        if problem:
            bad_image(r, problem, on_error, prefixed=True)
    usable = [i for i, r in enumerate(rows) if not r.get("error")]
    workers = workers or max(1, min(4, os.cpu_count() or 1))
    checks = check_images([image_file(rows[i]) for i in usable], workers, max_pixels=max_pixels)
    for i, check in zip(usable, checks, strict=True):
        if not check.ok:
            bad_image(rows[i], check.reason, on_error)
    return [i for i in usable if not rows[i].get("error")]


def bad_image(row: dict, reason: str, on_error: str, prefixed: bool = False) -> None:
    """A row whose image cannot be used: its "error" says why, or (``on_error="raise"``) a ``BadImageError``
    names the image and says the same. ``prefixed``: the reason already says what kind of fault it is."""
    error = reason if prefixed else f"image unreadable: {reason}"
    if on_error == "raise":
        raise BadImageError(str(row["image"]), error)
    row["error"] = error


def image_problem(row: dict, max_pixels: int) -> str:
    """Why a row's image cannot be predicted, read from its header only (nothing is decoded); "" when it may
    be. A file DALI cannot parse is kept from it: DALI can crash on one instead of raising."""
    from PIL import Image  # PIL: only when an image is opened here

    path = image_file(row)
    if os.path.isdir(path):
        return f"image is a directory, not an image file: {row['image']}"
    if not os.path.isfile(path):
        return f"image not found: {row['image']}"
    if os.path.getsize(path) == 0:  # as mmfast-prepare names it
        return "image unreadable: zero size file"
    try:
        header = image_header(path)  # one open per image; the budget's words only for one over it
    except Image.DecompressionBombError:
        return f"image unreadable: {pixel_budget_reason(path, max_pixels)}"
    if header is not None and header[0] * header[1] > max_pixels:
        return f"image unreadable: {pixel_budget_reason(path, max_pixels)}"
    if header is None:
        return "image unreadable: not an image (unrecognised content); pass a JPEG, PNG, BMP, TIFF or WebP file"
    if header[2] not in DALI_FORMATS:
        return f"image unreadable: unsupported image format {header[2]}; convert it to JPEG or PNG"
    return ""


def image_file(row: dict) -> str:
    """The file a row's image is read from ("path" when "image" only names it for the user)."""
    return row.get("path") or row["image"]


# the columns of a predictions file
PREDICTION_KEYS = ["image", "text", "label", "class", "prob", "top_k", "error"]


def is_predictions_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is what ``write_predictions`` writes (so a new run may replace it): a CSV with its
    header, JSONL whose first row has only its keys, or an empty file."""
    try:
        with open(path, "rb") as f:
            first = f.readline(1 << 16).decode("utf-8", errors="replace").strip()
    except OSError:
        return False
    if not first:
        return True
    if Path(path).suffix.lower() == ".csv":
        return first == ",".join(PREDICTION_KEYS)
    try:
        row = json.loads(first)
    except ValueError:
        return False
    return isinstance(row, dict) and "error" in row and set(row) <= {"id", *PREDICTION_KEYS}


def write_predictions(path: str | os.PathLike, results: list[dict]) -> Path:
    """JSONL (default) or CSV (``.csv``: top-k as a JSON string) of predict_rows' results, written whole or not
    at all (a temp file renamed into place). Text UTF-8 cannot encode (a file name with a Latin-1 byte, held
    as a surrogate escape) is written escaped: ``\\udcXX`` (a JSON escape in JSONL, a backslash escape in CSV).
    """
    path = Path(path)
    keys = PREDICTION_KEYS
    if path.suffix.lower() == ".csv":
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow({**r, "top_k": json.dumps(r.get("top_k"))} if "top_k" in r else r)
        atomic_write_bytes(path, buf.getvalue().encode("utf-8", errors="backslashreplace"))
    else:
        atomic_write_jsonl(path, [{k: r.get(k) for k in ["id", *keys] if k in r or k == "error"} for r in results])
    return path


@torch.no_grad()
def predict_pil(model: MmfastModel, rows: list[dict], batch_size: int = 64) -> list[int]:
    """The plain loop a user would write (PIL decode, torchvision Resize + CenterCrop + Normalize, the tokenizer
    per batch, the model): the baseline predict's throughput is measured against. Returns class ids."""
    from PIL import Image  # PIL: only when an image is opened here

    cfg = model.config
    tf = pil_transform(cfg)
    preds = []
    for s in range(0, len(rows), batch_size):
        chunk = rows[s : s + batch_size]
        images = torch.stack([tf(Image.open(image_file(r)).convert("RGB")) for r in chunk])
        enc = model.tokenizer(
            [r["text"] for r in chunk], truncation=True, max_length=cfg["max_length"], padding=True,
            return_tensors="pt", return_token_type_ids=False,
        )  # fmt: skip
        logits = model({"image": images, "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
        preds.extend(logits.argmax(1).tolist())
    return preds


def prepared_rows(
    data_dir: str | os.PathLike, split: str, work_dir: str | os.PathLike | None = None
) -> list[dict]:
    """The rows of a prepared dataset's split, labels as class names (``id``: the prepared sample id).

    A row whose image lies inside a shard (a dataset prepared from WebDataset shards, local or remote) gets its
    bytes copied out into ``work_dir`` (the file its "path" names; its "image" names it for the user as
    ``<shard>:<member>``, the URL redacted); a remote shard is fetched there first, verified against the size
    and SHA-256 recorded at preparation, and removed once its images are out.

    Raises:
        ValueError: the split has rows inside shards and no ``work_dir`` was given.
        remote_errors.RemoteError: a remote shard cannot be fetched (the message names its URL).
    """
    dataset = PreparedDataset(data_dir)
    names = {i: name for name, i in dataset.labels.items()}
    rows, in_shards = [], {}
    for r in dataset.rows(split):
        rows.append({"id": r["id"], "image": r["image"], "text": r["text"], "label": names[r["label"]]})
        if r.get("tar"):
            in_shards.setdefault(r["tar"], []).append((rows[-1], r))
    if in_shards and work_dir is None:
        raise ValueError(f"{data_dir}: the images of its {split} split are inside shards: give a work folder")
    for tar, members in in_shards.items():
        _copy_out(tar, members, Path(work_dir))
    return rows


def _copy_out(tar: str, members: list[tuple[dict, dict]], work_dir: Path) -> None:
    """Write each (row, prepared row)'s image, read from ``tar`` at its offset, to a file under ``work_dir``."""
    local = Path(tar)
    work_dir.mkdir(parents=True, exist_ok=True)
    if is_remote(tar):
        first = members[0][1]
        local = fetch_to(tar, work_dir / "shard.tar", size=first.get("tar_size"), sha256=first.get("tar_sha256"))
    images = work_dir / "images"
    images.mkdir(parents=True, exist_ok=True)
    try:
        with open(local, "rb") as f:
            for row, r in members:
                f.seek(r["offset"])
                out = images / f"{r['id']}{Path(r['member']).suffix.lower()}"
                out.write_bytes(f.read(r["nbytes"]))
                row.update(image=f"{redact(tar)}:{r['member']}", path=str(out))
    finally:
        if local != Path(tar):
            local.unlink(missing_ok=True)


def score(results: list[dict], class_names: list[str]) -> dict:
    """Accuracy, macro-F1, per-class precision/recall and the confusion matrix of predicted rows with a label.

    Returns:
        ``confusion_figures``' dict plus "confusion" (C x C list, rows = true class), "samples" (scored rows)
        and "errors" (rows not predicted, left out of the figures).
    """
    index = {name: i for i, name in enumerate(class_names)}
    c = len(class_names)
    cm = np.zeros((c, c), dtype=np.int64)
    scored = 0
    for r in results:
        if "class" in r and str(r.get("label")) in index:
            cm[index[str(r["label"])], r["class_id"]] += 1
            scored += 1
    return {
        **confusion_figures(cm, class_names),
        "confusion": cm.tolist(),
        "samples": scored,
        "errors": sum(1 for r in results if r.get("error")),
    }


def plot_confusion(confusion: list[list[int]], class_names: list[str], path: str | os.PathLike) -> Path:
    """A confusion-matrix PNG (rows: true class, columns: predicted), counts written in the cells."""
    import matplotlib  # matplotlib: optional, only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: optional, only for the figure

    cm = np.asarray(confusion)
    n = len(class_names)
    side = max(4.0, 0.5 * n + 2)
    fig, ax = plt.subplots(figsize=(side, side))
    ax.imshow(cm, cmap="Blues")
    ax.set_xticks(range(n), class_names, rotation=90)
    ax.set_yticks(range(n), class_names)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    for i in range(n):
        for j in range(n):
            if cm[i, j]:
                color = "white" if cm[i, j] > cm.max() / 2 else "black"
                ax.text(j, i, str(cm[i, j]), ha="center", va="center", fontsize=8, color=color)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)

"""A dual encoder's model directory on new data: embeddings of rows (``mmfast-predict --embed``) and the
retrieval / zero-shot evaluation of them (``mmfast-evaluate`` on a "clip" model).

Images go through predict's loader (``predict.rows_loader``: the DALI eval pipeline of the training run's
evaluation); texts are tokenized as in training (``MmfastModel.encode_text``). A row whose image or text cannot
be read keeps the reason ("error") and gets no embedding; the others are embedded anyway.
"""

from __future__ import annotations

import functools
import io
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from mmfast.data.validate import DEFAULT_MAX_PIXELS
from mmfast.infer.encode_inputs import check_on_error
from mmfast.infer.model_dir import MmfastModel
from mmfast.infer.predict import bad_image, flag_unreadable, image_file, rows_loader
from mmfast.tasks.retrieval import (
    caption_groups,
    class_ensemble,
    class_prompts,
    known_classes,
    read_templates,
    retrieval_figures,
    zero_shot_figures,
)
from mmfast.util.fsutil import atomic_write_bytes
from mmfast.util.voice import setting

MODALITIES = ("image", "text")


def row_ids(rows: list[dict]) -> list[int]:
    """Each row's id: the prepared sample id ("id", --data), else its position among the input's rows."""
    return [int(r["id"]) if isinstance(r.get("id"), int) else pos for pos, r in enumerate(rows)]


@torch.no_grad()
def embed_rows(
    model: MmfastModel,
    rows: list[dict],
    modality: str,
    *,
    batch_size: int | None = None,
    device: str | torch.device = "cpu",
    num_workers: int | None = None,
    max_pixels: int | None = None,
    on_error: str = "skip",
    zero_shot: bool = False,
) -> tuple[list[dict], np.ndarray, list[int]]:
    """Embed every usable row's image or text.

    Args:
        rows: as ``predict_rows`` takes them ({"image", "text", ...} or {"error"}).
        modality: "image" or "text".
        on_error: as ``predict_rows`` takes it: an image training would refuse is a row "error" ("skip") or a
            ``BadImageError`` ("raise").
        zero_shot: the embeddings zero-shot classification scores (``MmfastModel.encode_image``'s).

    Returns:
        (the rows, each a copy, those not embedded with an "error"; embeddings (N, D) float32 normalized, in row
        order; the positions in ``rows`` of those N rows).

    Raises:
        ValueError: another modality, or a model that is not a dual encoder.
    """
    check_on_error(on_error)
    if modality not in MODALITIES:
        raise ValueError(f"unknown modality '{modality}'; choose from {', '.join(MODALITIES)}")
    if not model.embeds:
        raise ValueError(
            f"a '{model.config['model']}' model gives no embeddings: they need a dual encoder (a model trained "
            f"with {setting('model', value='clip')})"
        )
    device = torch.device(device)
    out = [dict(r) for r in rows]
    batch_size = batch_size or model.config.get("eval_batch_size") or 64
    if modality == "text":
        for r in out:
            if not r.get("error") and not isinstance(r.get("text"), str):
                r["error"] = "no text to embed"
        keep = [i for i, r in enumerate(out) if not r.get("error")]
        texts = [out[i]["text"] for i in keep]
        emb = model.encode_text(texts, batch_size=batch_size, zero_shot=zero_shot).cpu().numpy()
        return out, emb.astype(np.float32, copy=False), keep
    encode = functools.partial(model.encode_image, zero_shot=zero_shot)
    got = _image_embeddings(model, encode, out, batch_size, device, (num_workers, max_pixels), on_error)
    keep = sorted(got)
    emb = np.stack([got[i] for i in keep]) if keep else np.zeros((0, model.embedding_width(zero_shot)), np.float32)
    return out, emb.astype(np.float32, copy=False), keep


def _image_embeddings(
    model: MmfastModel, encode, out: list[dict], batch_size: int, device, reading: tuple, on_error: str
) -> dict[int, np.ndarray]:
    """{row position: its image's embedding (D,) by ``encode`` (a preprocessed batch -> (B, D))}; rows whose
    image cannot be read get an "error" in ``out`` (or raise: ``on_error``). ``reading``: (num_workers,
    max_pixels)."""
    num_workers, max_pixels = reading
    max_pixels = max_pixels or model.config.get("max_pixels") or DEFAULT_MAX_PIXELS
    usable = flag_unreadable(out, max_pixels, num_workers, on_error)
    got: dict[int, np.ndarray] = {}
    if not usable:
        return got
    with tempfile.TemporaryDirectory(prefix="mmfast-embed-") as tmp:
        loader = rows_loader(
            [image_file(out[i]) for i in usable],
            [out[i]["text"] if isinstance(out[i].get("text"), str) else "" for i in usable],
            model,
            Path(tmp),
            max_pixels,
            batch_size=batch_size,
            device=device,
            fp16=device.type == "cuda",
            num_workers=num_workers,
            on_bad_image="skip",
        )
        try:
            for batch in loader:
                ids = batch["id"].cpu().numpy()  # (B,) positions in ``usable``; -1: padding
                emb = encode(batch["image"]).cpu().numpy()  # (B, D)
                for b in np.flatnonzero(ids >= 0):
                    got[usable[int(ids[b])]] = emb[b]
        except ValueError:
            if len(loader.bad) < len(usable):  # it stops when every image is bad; anything else is not ours
                raise
        for pos, reason in loader.bad.items():
            bad_image(out[usable[pos]], reason, on_error)
    for i in usable:
        if i not in got and not out[i].get("error"):
            out[i]["error"] = "no embedding came back for this row"
    return got


def embedding_paths(out: str | os.PathLike, modality: str) -> dict[str, Path]:
    """The files ``write_embeddings`` writes for ``--out OUT``: OUT.npy, OUT.ids.npy, OUT.parquet (OUT's ".npy"
    dropped). OUT a folder (one that exists, or a name ending in "/") holds them, named by the modality:
    OUT/image.npy, OUT/image.ids.npy, OUT/image.parquet."""
    base = Path(out) / modality if _is_folder(out) else Path(out)
    base = base.with_suffix("") if base.suffix.lower() in (".npy", ".parquet") else base
    return {kind: base.parent / f"{base.name}{suffix}" for kind, suffix in _SUFFIXES.items()}


def _is_folder(out: str | os.PathLike) -> bool:
    return Path(out).is_dir() or os.fspath(out).endswith(("/", os.sep))


_SUFFIXES = {"embeddings": ".npy", "ids": ".ids.npy", "parquet": ".parquet"}


def write_embeddings(
    out: str | os.PathLike, embeddings: np.ndarray, ids: list[int], rows: list[dict], modality: str
) -> list[Path]:
    """OUT.npy (N, D) float32, OUT.ids.npy (N,) int64 (row i of the first is the row of id i of the second)
    and, when pyarrow is installed, OUT.parquet (id, image, text, embedding), each written whole or not at all;
    inside OUT when it is a folder (``embedding_paths``: made when its name ends in "/").

    Returns:
        the files written.
    """
    paths = embedding_paths(out, modality)
    if _is_folder(out):
        Path(out).mkdir(exist_ok=True)  # named as a folder: made here (its parent must exist)
    written = []
    for kind, array in (("embeddings", np.asarray(embeddings, np.float32)), ("ids", np.asarray(ids, np.int64))):
        buf = io.BytesIO()
        np.save(buf, array)
        atomic_write_bytes(paths[kind], buf.getvalue())
        written.append(paths[kind])
    try:
        import pyarrow as pa  # optional: the Parquet file only when it is installed
        import pyarrow.parquet as pq
    except ImportError:
        return written
    emb = np.asarray(embeddings, np.float32)
    table = pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "image": [str(r.get("image")) if r.get("image") is not None else None for r in rows],
            "text": [r.get("text") if isinstance(r.get("text"), str) else None for r in rows],
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), emb.shape[1]),
        },
        metadata={"mmfast": json.dumps({"modality": modality, "dim": int(emb.shape[1])})},
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    atomic_write_bytes(paths["parquet"], buf.getvalue())
    return [*written, paths["parquet"]]


def is_embeddings_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is one ``write_embeddings`` writes (so a new run may replace it)."""
    path = Path(path)
    try:
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq  # pyarrow: optional (mmfast[formats]), only for Parquet / Arrow

            return b"mmfast" in (pq.read_schema(path).metadata or {})
        return np.load(path, mmap_mode="r", allow_pickle=False).ndim in (1, 2)
    except Exception:  # not ours: unreadable, another format, pyarrow missing
        return False


def evaluate_retrieval(model: MmfastModel, rows: list[dict], templates: list[str] | None = None, **kwargs) -> dict:
    """Retrieval both ways over the rows (pairs of an image and its caption; rows of one image file are its
    captions), and zero-shot accuracy over the rows with a label.

    Args:
        templates: zero-shot prompts (default: the model's config.json's, else ``DEFAULT_TEMPLATES``).
        **kwargs: ``embed_rows``' loader arguments.

    Returns:
        ``retrieval_figures``' dict, "zero_shot_acc" / "zero_shot_samples" / "zero_shot_classes" when rows have
        labels, "images", "texts", "errors" (rows left out) and "rows" (the rows, with their "error").
    """
    rows = [dict(r) for r in rows]
    for r in rows:
        if not r.get("error") and not isinstance(r.get("text"), str):
            r["error"] = "no text to embed"
    live = [p for p, r in enumerate(rows) if not r.get("error")]
    firsts = [live[k] for k in caption_groups([image_file(rows[p]) for p in live])[0]]  # a row per image
    # one pass: the zero-shot embeddings, which hold the retrieval ones (``_model_part``)
    done, joined, kept = embed_rows(model, [rows[p] for p in firsts], "image", zero_shot=True, **kwargs)
    img = _model_part(model, joined)
    for p, r in zip(firsts, done, strict=True):  # an unreadable image: all its captions are left out
        rows[p] = r
    index = {image_file(rows[firsts[k]]): j for j, k in enumerate(kept)}  # image file -> its row of ``img``
    for r in rows:
        if not r.get("error") and image_file(r) not in index:
            r["error"] = "its image could not be embedded"
    pairs = [p for p, r in enumerate(rows) if not r.get("error")]
    if not pairs:
        raise ValueError("no row could be embedded (reasons in the rows' errors)")
    text = model.encode_text([rows[p]["text"] for p in pairs]).cpu()
    text_image = torch.tensor([index[image_file(rows[p])] for p in pairs])
    captions: dict[str, int] = {}  # a caption repeated on several rows is one candidate (retrieval_figures)
    same = torch.tensor([captions.setdefault(rows[p]["text"], len(captions)) for p in pairs])
    figures = retrieval_figures(torch.from_numpy(img), text, text_image, same)
    labeled = [j for j, k in enumerate(kept) if "label" in rows[firsts[k]]]
    if labeled:
        labels = [str(rows[firsts[kept[j]]]["label"]) for j in labeled]
        figures.update(_zero_shot(model, joined[labeled], labels, templates))
    errors = sum(bool(r.get("error")) for r in rows)
    return {**figures, "images": len(kept), "texts": len(pairs), "errors": errors, "rows": rows}


def _model_part(model: MmfastModel, joined: np.ndarray) -> np.ndarray:
    """The model's own embeddings (N, D) in zero-shot ones (``embed_rows(..., zero_shot=True)``): themselves, or
    with a zero-shot map their first D columns, sqrt(weight) times the model's (``PromptMap.join``), made unit."""
    d = model.config["embed_dim"]
    if joined.shape[1] == d:
        return joined
    own = joined[:, :d]
    return own / np.maximum(np.linalg.norm(own, axis=1, keepdims=True), 1e-12)


def _class_embeddings(model: MmfastModel, classes: list[str], templates) -> torch.Tensor:
    """(C, D) normalized: each class name in the zero-shot prompts (``templates``, else the model's config.json's,
    else ``DEFAULT_TEMPLATES``), ensembled; joined with the start text tower's where the model has a zero-shot
    map (``MmfastModel.encode_text``'s ``zero_shot``)."""
    templates = templates or model.config.get("zero_shot_templates") or read_templates(None)
    prompts = class_prompts(classes, templates)
    flat = model.encode_text([p for per_class in prompts for p in per_class], zero_shot=True).cpu()
    return class_ensemble(model.model, flat.reshape(len(classes), len(templates), -1))


def zero_shot_rows(
    model: MmfastModel,
    rows: list[dict],
    templates: list[str] | None = None,
    top_k: int = 5,
    classes: list[str] | None = None,
    **kwargs,
) -> list[dict]:
    """A dual encoder's predictions among ``classes``, else the classes it was trained with (config.json's
    ``class_names``): each row's image against the class prompts, as ``predict_rows`` gives a classifier's
    ("class", "class_id", "prob", "top_k"; class_id indexes ``classes`` when given). The probability is a
    softmax over the classes of the model's scaled cosines (with a zero-shot map, the joined ones: ``PromptMap``);
    the caption is not used.

    Args:
        **kwargs: ``embed_rows``' loader arguments.

    Raises:
        ValueError: no ``classes`` and the model knows none (trained without labels).
    """
    if not classes and not model.knows_classes:
        raise ValueError(
            "the model was trained without labels: it knows no classes to predict; name them (mmfast-predict "
            "--classes) or embed the images instead (mmfast-predict --embed image)"
        )
    names = list(classes) if classes else model.class_names
    done, img, kept = embed_rows(model, rows, "image", zero_shot=True, **kwargs)
    scale = model.model.scale_and_bias()[0].detach()  # the scale training and evaluation use
    probs = torch.softmax(scale * torch.from_numpy(img) @ _class_embeddings(model, names, templates).T, dim=1)
    top_p, top_i = probs.topk(min(top_k, len(names)), dim=1)
    for j, pos in enumerate(kept):
        done[pos].update(
            class_id=int(top_i[j, 0]),
            **{"class": names[top_i[j, 0]]},
            prob=float(top_p[j, 0]),
            top_k=[[names[c], float(p)] for c, p in zip(top_i[j].tolist(), top_p[j].tolist(), strict=True)],
        )
    return done


def _zero_shot(model: MmfastModel, img: np.ndarray, labels: list[str], templates) -> dict:
    """Zero-shot figures of the images ``img`` (N, D) with these labels: the classes are the model's when it
    knows every label, else the labels found."""
    classes = model.class_names if set(labels) <= set(model.class_names) else sorted(set(labels))
    if not known_classes(classes):  # unlabeled rows (--no-labels: one class)
        return {}
    class_emb = _class_embeddings(model, classes, templates)
    index = {c: i for i, c in enumerate(classes)}
    got = zero_shot_figures(torch.from_numpy(img), torch.tensor([index[x] for x in labels]), class_emb)
    return {**got, "zero_shot_classes": len(classes)}

"""A trained dual encoder and the ridge map in one embedding (``compare_contrastive.py --fuse-ridge W``).

The ridge map keeps the frozen text tower, so it keeps more zero-shot accuracy; the trained recipe finds captions
better. Their embeddings side by side, [sqrt(w) model, sqrt(1 - w) ridge], both unit, score every pair by
w cos_model + (1 - w) cos_ridge: w = 1 is the trained model alone, w = 0 the ridge map alone.
"""

from __future__ import annotations

from pathlib import Path


def _baselines():
    try:
        import tools.experiments.contrastive_baselines as baselines
    except ImportError:  # run as a script from tools/experiments
        import contrastive_baselines as baselines
    return baselines


def model_embeddings(model_dir: Path, data_dir: Path, threads: int | None) -> tuple:
    """A model directory's embeddings of the val split of ``data_dir`` as the run's evaluation sees it (resize +
    centre crop), rows in sample-id order, and of the class prompts (the task's templates, ensembled).

    Returns:
        (images (N, D), texts (N, D), classes (C, D)), normalized.
    """
    from mmfast.infer.model_dir import load_model

    got, classes = loaded_embeddings(load_model(model_dir), data_dir, threads)
    return got["x"], got["t"], classes


def loaded_embeddings(loaded, data_dir: Path, threads: int | None) -> tuple[dict, object]:
    """``model_embeddings`` of a loaded model (``load_model``'s, its weights as they are now): (``embed_split``'s
    dict of the val split, with "label" and "id"; the class prompts' embeddings)."""
    from mmfast.data.dataset import PreparedDataset
    from mmfast.tasks.retrieval import class_embeddings

    baselines, net, dataset = _baselines(), loaded.model.eval(), PreparedDataset(data_dir)
    encoders = (net.encode_image, net.encode_text, (net.image.mean, net.image.std))
    got = baselines.embed_split(dataset, "val", encoders, loaded.config["image_size"], threads)
    return got, class_embeddings(baselines.embed_prompts(dataset, loaded.tokenizer, net.encode_text))


class RidgeMaps:
    """The ridge map of each (set label, pool), fitted once: its val embeddings and the val split they score on,
    for every run on that set to be fused with."""

    def __init__(self):
        self._maps: dict[tuple, tuple] = {}

    def __contains__(self, key: tuple) -> bool:
        return key in self._maps

    def add(self, key: tuple, feats: dict) -> None:
        """Fit the map on ``frozen_features``' output ``feats``; keep only what fusing needs."""
        self._maps[key] = (_baselines().ridge_embeddings(feats), feats["val"])

    def __getitem__(self, key: tuple) -> tuple:
        """(``ridge_embeddings``' tuple, the val split)."""
        return self._maps[key]


def fused_figures(model: tuple, ridge: tuple, weights: list[float]) -> dict[float, dict]:
    """``score``'s figures of the embeddings side by side, for each weight w of the model's cosine.

    Args:
        model: (images, texts, classes) of ``model_embeddings``.
        ridge: ``RidgeMaps``' entry for the same set and pool: (``ridge_embeddings``' tuple, the val split).
    """
    import torch

    score = _baselines().score
    (r_img, r_txt, r_cls, _), split = ridge
    if len(model[0]) != len(r_img) or len(model[1]) != len(r_txt):
        raise ValueError(f"the model embedded {len(model[0])} val rows, the ridge map {len(r_img)}")
    got = {}
    for w in weights:
        a, b = w**0.5, (1 - w) ** 0.5
        img, txt, cls = (torch.cat([a * m, b * r], 1) for m, r in zip(model, (r_img, r_txt, r_cls), strict=True))
        got[w] = score(img, txt, split, cls)
    return got

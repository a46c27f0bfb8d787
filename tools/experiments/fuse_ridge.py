"""A trained dual encoder and the ridge map in one embedding (``compare_contrastive.py --fuse-ridge W``).

The ridge map keeps the frozen text tower, so it keeps more zero-shot accuracy; the trained recipe finds captions
better. Their embeddings side by side, [sqrt(w) model, sqrt(1 - w) ridge], both unit, score every pair by
w cos_model + (1 - w) cos_ridge: w = 1 is the trained model alone, w = 0 the ridge map alone.
"""

from __future__ import annotations

from pathlib import Path


def model_embeddings(model_dir: Path, data_dir: Path, threads: int | None, max_length: int) -> tuple:
    """A model directory's embeddings of the val split of ``data_dir`` as the run's evaluation sees it (resize +
    centre crop), rows in sample-id order, and of the class prompts (the task's templates, ensembled).

    Returns:
        (images (N, D), texts (N, D), classes (C, D)), normalized.
    """
    import torch

    from mmfast.data.dataset import PreparedDataset
    from mmfast.infer.model_dir import load_model
    from mmfast.loading.multimodal import MultimodalLoader
    from mmfast.tasks.retrieval import DEFAULT_TEMPLATES, class_embeddings, class_prompts

    loaded = load_model(model_dir)
    net, dataset = loaded.model.eval(), PreparedDataset(data_dir)
    norm = {"mean": tuple(255 * m for m in net.image.mean), "std": tuple(255 * s for s in net.image.std)}
    loader = MultimodalLoader(
        dataset,
        "val",
        64,
        shuffle=False,
        drop_last=False,
        train=False,
        size=loaded.config["image_size"],
        fp16=False,
        num_workers=threads,
        **norm,
    )
    parts: dict[str, list] = {"img": [], "txt": [], "id": []}
    names = sorted(dataset.labels, key=dataset.labels.get)
    flat = [p for per in class_prompts(names, DEFAULT_TEMPLATES) for p in per]
    enc = loaded.tokenizer(flat, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        for batch in loader:
            keep = batch["id"] >= 0  # padding of the last batch
            parts["img"].append(net.encode_image(batch["image"].float())[keep])
            parts["txt"].append(net.encode_text(batch["input_ids"], batch["attention_mask"])[keep])
            parts["id"].append(batch["id"][keep])
        prompts = net.encode_text(enc["input_ids"], enc["attention_mask"])
    got = {k: torch.cat(v) for k, v in parts.items()}
    order = got["id"].argsort()
    classes = class_embeddings(prompts.reshape(len(names), len(DEFAULT_TEMPLATES), -1))
    return got["img"][order], got["txt"][order], classes


def fused_figures(model: tuple, ridge: tuple, split: dict, weights: list[float]) -> dict[float, dict]:
    """``score``'s figures of the embeddings side by side, for each weight w of the model's cosine.

    Args:
        model: (images, texts, classes) of ``model_embeddings``.
        ridge: the same of ``ridge_embeddings`` (its first three), on the same rows.
        split: the frozen features' val split (its groups and labels).
    """
    import torch

    try:
        from tools.experiments.contrastive_baselines import score
    except ImportError:  # run as a script from tools/experiments
        from contrastive_baselines import score

    if len(model[0]) != len(ridge[0]) or len(model[1]) != len(ridge[1]):
        raise ValueError(f"the model embedded {len(model[0])} val rows, the ridge map {len(ridge[0])}")
    got = {}
    for w in weights:
        a, b = w**0.5, (1 - w) ** 0.5
        img, txt, cls = (torch.cat([a * m, b * r], 1) for m, r in zip(model, ridge[:3], strict=True))
        got[w] = score(img, txt, split, cls)
    return got

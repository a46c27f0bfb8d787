"""The frozen-tower baselines of ``compare_contrastive.py``: the preset's pretrained towers, frozen, their
features computed once per set, and two ways of aligning them, each scored as the dual encoder is (retrieval both
ways and zero-shot accuracy, ``mmfast.tasks.retrieval``'s figures):

- ridge: the image tower's pooled features and the text model's mean-pooled features, L2-normalized: T; the
  closed-form ridge map W = argmin ||X W - T||^2 + lambda ||W||^2 from standardized image features X to T, fitted
  on the train split, lambda picked on a held-out fifth of it. Images are normalize(X W), texts normalize(T); no
  training.
- probe: the same cached features, two bias-free linear projections into --embed-dim trained with the CLIP loss
  (mmfast's, learnable temperature) by Adam; the epoch count is picked on the held-out fifth of train, then the
  projections are trained again on the whole train split.

Zero-shot: each class name put into the task's default templates, embedded by the frozen text model (ridge) or
through the probe's text projection.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

RIDGE_LAMBDAS = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)  # times the number of training samples
PROBE = {"every": 2, "lr": 1e-3, "batch_size": 64}  # the probe's Adam; its epochs checked every "every"
HELD_OUT = 0.2  # share of the train split the baselines choose lambda / epochs on
MAX_LENGTH = 32  # tokens per caption and prompt: TrainConfig's default when a run prepares its own data

# ------------------------------------------------------------------------------------ frozen tower features


def frozen_features(
    data_dir: Path, preset: str, threads: int | None, pool: str | None = None, image: dict | None = None
) -> dict:
    """The preset's pretrained towers, frozen, over both splits as the training run's evaluation sees them (the
    eval loader: resize + center crop at the preset's size, the encoder's mean / std); the image tower's
    features pooled as ``pool`` says (``ImageEncoder``'s; None: the preset's). ``image``: the preset's
    image_backbone and image_size where it names them (compare_contrastive's --image-backbone, --image-size).

    Returns:
        {"train"/"val": {"x": (N, C_img) image features, "t": (N, D_txt) normalized text features, "label",
        "group": (N,) image group (the contrastive task's)}, "prompts": (C, T, D_txt) normalized prompt
        features, "seconds": the time it took}.
    """
    import torch

    from mmfast.data.dataset import PreparedDataset
    from mmfast.data.tokenizer import load_tokenizer
    from mmfast.models import get_preset
    from mmfast.models.encoders import ImageEncoder, TextEncoder
    from mmfast.tasks.contrastive import sample_groups

    t0 = time.perf_counter()
    spec = get_preset(preset)
    spec = dataclasses.replace(spec, **{k: v for k, v in (image or {}).items() if v is not None})
    dataset = PreparedDataset(data_dir)
    image = ImageEncoder(spec.image_backbone, freeze=True, pool=pool or spec.image_pool).eval()
    text = TextEncoder(spec.text_model, freeze=True).eval()
    groups = sample_groups(dataset)[0]

    def encode_text(ids, mask):
        return torch.nn.functional.normalize(text(ids, mask), dim=-1)

    encoders = (lambda pixels: image(pixels)[0], encode_text, (image.mean, image.std))
    out = {split: embed_split(dataset, split, encoders, spec.image_size, threads) for split in ("train", "val")}
    for split in out.values():
        split["group"] = groups[split.pop("id")]
    out["prompts"] = embed_prompts(dataset, load_tokenizer(dataset.tokenizer_dir), encode_text)
    out["seconds"] = time.perf_counter() - t0
    return out


def embed_split(dataset, split: str, encoders: tuple, size: int, threads: int | None) -> dict:
    """Every sample of ``split`` as the training run's evaluation sees it (the eval loader: resize + centre crop
    at ``size``), its image and caption through ``encoders``.

    Args:
        encoders: (encode_image(pixels), encode_text(input_ids, attention_mask), (mean, std) of the image
            encoder's input, on the 0-1 scale).

    Returns:
        {"x": images' rows, "t": captions' rows, "label", "id"}, in sample-id order.
    """
    import torch

    from mmfast.loading.multimodal import MultimodalLoader

    encode_image, encode_text, (mean, std) = encoders
    loader = MultimodalLoader(
        dataset,
        split,
        64,
        shuffle=False,
        drop_last=False,
        train=False,
        size=size,
        fp16=False,
        num_workers=threads,
        mean=tuple(255 * m for m in mean),
        std=tuple(255 * s for s in std),
    )
    parts: dict[str, list] = {"x": [], "t": [], "label": [], "id": []}
    with torch.no_grad():
        for batch in loader:
            keep = batch["id"] >= 0  # padding of the last batch
            parts["x"].append(encode_image(batch["image"].float())[keep])
            parts["t"].append(encode_text(batch["input_ids"], batch["attention_mask"])[keep])
            parts["label"].append(batch["label"][keep])
            parts["id"].append(batch["id"][keep])
    got = {k: torch.cat(v) for k, v in parts.items()}
    order = got["id"].argsort()
    return {k: v[order] for k, v in got.items()}


def embed_prompts(dataset, tokenizer, encode_text):
    """The class prompts (each class name in the task's default templates) through ``encode_text``: (C, T, D),
    classes in label order."""
    import torch

    from mmfast.tasks.retrieval import DEFAULT_TEMPLATES, class_prompts

    names = sorted(dataset.labels, key=dataset.labels.get)
    flat = [p for per in class_prompts(names, DEFAULT_TEMPLATES) for p in per]
    enc = tokenizer(flat, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    with torch.no_grad():
        prompts = encode_text(enc["input_ids"], enc["attention_mask"])
    return prompts.reshape(len(names), len(DEFAULT_TEMPLATES), -1)


def score(img, txt, split: dict, class_emb) -> dict:
    """Retrieval both ways (one entry per distinct image, its captions grouped) and zero-shot accuracy of the
    embeddings of ``split``'s samples (row i: sample i), in the task's own figures."""
    import torch

    from mmfast.tasks.retrieval import caption_groups, retrieval_figures, zero_shot_figures

    img, txt = torch.nn.functional.normalize(img, dim=-1), torch.nn.functional.normalize(txt, dim=-1)
    first, text_image = caption_groups(split["group"].tolist())
    figures = retrieval_figures(img[first], txt, text_image)
    figures |= zero_shot_figures(img[first], split["label"][first], class_emb)
    return {**figures, "images": len(first)}


def _held_out(split: dict, seed: int = 0) -> tuple[dict, dict]:
    """(fit, held-out): the train split cut by image group, HELD_OUT of the groups held out."""
    import torch

    groups = split["group"].unique()
    g = torch.Generator().manual_seed(seed)
    held = set(groups[torch.randperm(len(groups), generator=g)[: max(1, int(HELD_OUT * len(groups)))]].tolist())
    mask = torch.tensor([int(x) in held for x in split["group"]])
    return {k: v[~mask] for k, v in split.items()}, {k: v[mask] for k, v in split.items()}


def _standardize(train_x):
    mean, std = train_x.mean(0), train_x.std(0).clamp(min=1e-6)
    return lambda x: (x - mean) / std


# ----------------------------------------------------------------------------------------------- (a) ridge


def _ridge_fit(x, t, lam: float):
    """W (C, D) and the mean of T: ridge from centered x to centered t, closed form (the dual when N < C)."""
    import torch

    x, t = x.double(), t.double()
    t_mean = t.mean(0)
    tc = t - t_mean
    n, c = x.shape
    if n < c:
        w = x.T @ torch.linalg.solve(x @ x.T + lam * torch.eye(n, dtype=x.dtype), tc)
    else:
        w = torch.linalg.solve(x.T @ x + lam * torch.eye(c, dtype=x.dtype), x.T @ tc)
    return w.float(), t_mean.float()


def ridge_embeddings(feats: dict) -> tuple:
    """(a)'s map fitted on the train split, lambda by held-out mean recall. Returns (val image embeddings,
    val text embeddings, class embeddings, lambda per sample): val's rows in ``feats``'s order, all normalized."""
    import torch

    from mmfast.tasks.retrieval import class_embeddings

    class_emb = class_embeddings(feats["prompts"])
    fit, held = _held_out(feats["train"])
    std = _standardize(fit["x"])
    picks = {}
    for k in RIDGE_LAMBDAS:
        w, t_mean = _ridge_fit(std(fit["x"]), fit["t"], k * len(fit["x"]))
        picks[k] = score(std(held["x"]) @ w + t_mean, held["t"], held, class_emb)["mean_recall"]
    lam = max(picks, key=picks.get)
    train, val = feats["train"], feats["val"]
    std = _standardize(train["x"])
    w, t_mean = _ridge_fit(std(train["x"]), train["t"], lam * len(train["x"]))
    img, txt = (torch.nn.functional.normalize(e, dim=-1) for e in (std(val["x"]) @ w + t_mean, val["t"]))
    return img, txt, class_emb, lam


def ridge(feats: dict) -> dict:
    """(a): image features mapped into the text model's space by ridge, scored on val."""
    t0 = time.perf_counter()
    img, txt, class_emb, lam = ridge_embeddings(feats)
    figures = score(img, txt, feats["val"], class_emb)
    return {**figures, "lambda_per_sample": lam, "train_s": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------- (a') kernel ridge

KERNEL_GRID = {"lambda": (1e-3, 1e-2, 1e-1, 1.0), "gamma": (0.25, 0.5, 1.0, 2.0, 4.0)}


def _kernel_fit(x, t, lam: float, gamma: float):
    """Kernel ridge from x (rows unit-length) to t, RBF kernel exp(-gamma |a - b|^2), centred on t's mean; returns
    the map, z -> predicted t."""
    import torch

    x, t = x.double(), t.double()
    t_mean = t.mean(0)
    k = torch.exp(-gamma * torch.cdist(x, x) ** 2)
    alpha = torch.linalg.solve(k + lam * torch.eye(len(x), dtype=x.dtype), t - t_mean)
    return lambda z: (torch.exp(-gamma * torch.cdist(z.double(), x) ** 2) @ alpha + t_mean).float()


def kernel_ridge_embeddings(feats: dict) -> tuple:
    """(a) with an RBF kernel: each image feature standardized on the train split and made unit-length, mapped
    into the frozen text space by kernel ridge; lambda and gamma picked by held-out mean recall on the train
    split's fifth (``KERNEL_GRID``), as (a) picks its lambda. Returns (val image embeddings, val text embeddings,
    class embeddings, (lambda, gamma)), normalized, val's rows in ``feats``'s order."""
    import torch

    from mmfast.tasks.retrieval import class_embeddings

    unit = torch.nn.functional.normalize
    class_emb = class_embeddings(feats["prompts"])
    fit, held = _held_out(feats["train"])
    std = _standardize(fit["x"])
    picks = {}
    for lam in KERNEL_GRID["lambda"]:
        for gamma in KERNEL_GRID["gamma"]:
            f = _kernel_fit(unit(std(fit["x"]), dim=-1), fit["t"], lam, gamma)
            picks[lam, gamma] = score(f(unit(std(held["x"]), dim=-1)), held["t"], held, class_emb)["mean_recall"]
    lam, gamma = max(picks, key=picks.get)
    train, val = feats["train"], feats["val"]
    std = _standardize(train["x"])
    f = _kernel_fit(unit(std(train["x"]), dim=-1), train["t"], lam, gamma)
    return unit(f(unit(std(val["x"]), dim=-1)), dim=-1), unit(val["t"], dim=-1), class_emb, (lam, gamma)


# ------------------------------------------------------------------------------------ (b) the linear probe


def _probe_train(train: dict, epochs: int, dim: int, seed: int, check=None) -> tuple:
    """Two linear projections trained with mmfast's CLIP loss on cached features; ``check(project)`` is called
    every PROBE["every"] epochs. Returns (project: x, t -> (image emb, text emb), the checks' results)."""
    import math

    import torch

    from mmfast.tasks.contrastive import contrastive_loss

    torch.manual_seed(seed)
    std = _standardize(train["x"])
    x, t, group = std(train["x"]), train["t"], train["group"]
    img_proj = torch.nn.Linear(x.shape[1], dim, bias=False)
    txt_proj = torch.nn.Linear(t.shape[1], dim, bias=False)
    logit_scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    params = [*img_proj.parameters(), *txt_proj.parameters(), logit_scale]
    opt = torch.optim.Adam(params, lr=PROBE["lr"])
    text_group = _caption_groups_of(train)

    def project(xs, ts):
        with torch.no_grad():
            return img_proj(std(xs)), txt_proj(ts)

    results = []
    for epoch in range(1, epochs + 1):
        for idx in torch.randperm(len(x)).split(PROBE["batch_size"]):
            out = {
                "image": torch.nn.functional.normalize(img_proj(x[idx]), dim=-1),
                "text": torch.nn.functional.normalize(txt_proj(t[idx]), dim=-1),
                "logit_scale": logit_scale.clamp(max=math.log(100.0)).exp(),
                "logit_bias": torch.zeros(()),
            }
            ids = torch.arange(len(idx))
            loss = contrastive_loss("clip", out, ids, torch.stack([group[idx], text_group[idx]]))
            opt.zero_grad()
            loss.backward()
            opt.step()
        if check is not None and epoch % PROBE["every"] == 0:
            results.append((epoch, check(project)))
    return project, results


def _caption_groups_of(split: dict):
    """(N,) a group per distinct text feature (identical captions embed identically): not each other's
    negatives, as in the task's loss."""
    import torch

    _, inverse = torch.unique(split["t"], dim=0, return_inverse=True)
    return inverse


def _probe_score(project, split: dict, prompts) -> dict:
    """``score`` of the projected features of ``split``, zero-shot with the projected prompts (C, T, D_txt)."""
    from mmfast.tasks.retrieval import class_embeddings

    img, txt = project(split["x"], split["t"])
    _, cls = project(split["x"][:1], prompts.flatten(0, 1))
    return score(img, txt, split, class_embeddings(cls.reshape(*prompts.shape[:2], -1)))


def probe(feats: dict, dim: int, seed: int, max_epochs: int) -> dict:
    """(b): the linear probe; its epochs by held-out mean recall, then trained again on the whole train split."""
    t0 = time.perf_counter()
    fit, held = _held_out(feats["train"])

    def check(project) -> float:
        return _probe_score(project, held, feats["prompts"])["mean_recall"]

    _, curve = _probe_train(fit, max_epochs, dim, seed, check)
    epochs = max(curve, key=lambda c: c[1])[0]
    project, _ = _probe_train(feats["train"], epochs, dim, seed)
    figures = _probe_score(project, feats["val"], feats["prompts"])
    return {**figures, "epochs": epochs, "seed": seed, "train_s": time.perf_counter() - t0}

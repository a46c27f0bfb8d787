"""Retrieval and zero-shot figures of normalized image and text embeddings (pure torch, no model): recall@k
and median rank both ways, and zero-shot classification from class-name prompts.

Ranks are 1-based and ties count against the query (pessimistic): a candidate that scores exactly as high as
the right one is ranked ahead of it, so a model that gives every pair the same score gets the worst rank, not
the best. An image with several captions is retrieved correctly (image -> text) when any one of them is: its
rank is that of its best-ranked own caption among the other images' captions.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import torch

RECALL_AT = (1, 5, 10)
DEFAULT_TEMPLATES = ("a photo of a {}.", "an image of {}.", "{}", "an icon of {}.")
_CHUNK = 1024  # query rows per similarity block: memory stays at chunk x candidates


def caption_groups(image_keys: list) -> tuple[list[int], torch.Tensor]:
    """Which rows share an image: rows of (image, caption) pairs, several captions of one image on several rows.

    Args:
        image_keys: per row, what identifies its image (its path, its sample id).

    Returns:
        (the first row of each distinct image, in order of appearance; text_image (N,) int64: the index in
        that list of each row's image), what ``retrieval_figures`` takes with the rows' text embeddings.
    """
    index: dict = {}  # image key -> its index among the distinct images
    first_rows, text_image = [], []
    for row, key in enumerate(image_keys):
        if key not in index:
            index[key] = len(first_rows)
            first_rows.append(row)
        text_image.append(index[key])
    return first_rows, torch.tensor(text_image, dtype=torch.long)


def _ranks_t2i(image_emb: torch.Tensor, text_emb: torch.Tensor, text_image: torch.Tensor, owns) -> torch.Tensor:
    """(Nt,) 1-based rank of each text's best-ranked own image among all images: its own image, and with
    ``owns`` every image one of whose captions is this text."""
    ranks = []
    for s in range(0, len(text_emb), _CHUNK):
        sim = text_emb[s : s + _CHUNK] @ image_emb.T  # (c, Ni)
        if owns is None:
            own_score = sim.gather(1, text_image[s : s + _CHUNK, None])  # (c, 1)
            ranks.append((sim >= own_score).sum(1))  # the own image counts once: 1 + the others scoring >= it
            continue
        own = owns.images_of(owns.group[s : s + _CHUNK], len(image_emb))
        best = sim.masked_fill(~own, float("-inf")).max(1, keepdim=True).values  # (c, 1)
        ranks.append(1 + ((sim >= best) & ~own).sum(1))  # the other images scoring >= the best own
    return torch.cat(ranks)


def _ranks_i2t(image_emb: torch.Tensor, text_emb: torch.Tensor, text_image: torch.Tensor, owns) -> torch.Tensor:
    """(Ni,) 1-based rank of each image's best-ranked own caption among all texts; with ``owns``, among the
    distinct captions: a caption repeated on other images counts once, and as the image's own where it is."""
    ranks = []
    for s in range(0, len(image_emb), _CHUNK):
        sim = image_emb[s : s + _CHUNK] @ text_emb.T  # (c, Nt)
        rows = torch.arange(s, s + len(sim), device=sim.device)[:, None]
        if owns is None:
            own = text_image[None, :] == rows  # (c, Nt)
        else:  # each distinct caption's best score, a column per caption group
            group = owns.group[None, :].expand_as(sim)
            sim = sim.new_full((len(sim), owns.groups), float("-inf")).scatter_reduce(1, group, sim, "amax")
            own = owns.groups_of(s, s + len(sim))
        best = sim.masked_fill(~own, float("-inf")).max(1, keepdim=True).values  # (c, 1)
        ranks.append(1 + ((sim >= best) & ~own).sum(1))  # the other captions scoring >= the best own
    return torch.cat(ranks)


class _Owns:
    """Which (image, caption group) pairs a split holds, as masks of the similarity blocks: ``groups_of`` an
    image's, ``images_of`` a caption group's. ``group``: (Nt,) each text's group, 0..G-1. Built once, in
    O(Nt log Nt); each block costs its own size (a lookup of every cell against all pairs was quadratic)."""

    def __init__(self, text_image: torch.Tensor, group: torch.Tensor, groups: int):
        self.group, self.groups, self._text_image = group, groups, text_image
        self._by_image = torch.argsort(text_image, stable=True)  # texts in order of their image
        every = torch.arange(len(text_image) + 1, device=text_image.device)  # >= the images + 1
        self._image_start = torch.searchsorted(text_image[self._by_image], every)
        self._by_group = torch.argsort(group, stable=True)  # texts in order of their group
        each = torch.arange(groups + 1, device=group.device)
        self._group_start = torch.searchsorted(group[self._by_group], each)

    def groups_of(self, first: int, end: int) -> torch.Tensor:
        """(end - first, G) bool: True where image ``first + i`` has a caption of group g."""
        lo, hi = int(self._image_start[first]), int(self._image_start[min(end, len(self._image_start) - 1)])
        texts = self._by_image[lo:hi]  # the texts of images first..end-1, a run of the sorted order
        own = torch.zeros(end - first, self.groups, dtype=torch.bool, device=self.group.device)
        own[self._text_image[texts] - first, self.group[texts]] = True
        return own

    def images_of(self, groups: torch.Tensor, images: int) -> torch.Tensor:
        """(len(groups), images) bool: True where image i has a caption of group ``groups[j]``. Built once per
        distinct group of the block: a caption on half the split, repeated down the block, is expanded once."""
        groups, inverse = torch.unique(groups, return_inverse=True)
        start, end = self._group_start[groups], self._group_start[groups + 1]
        counts = end - start
        rows = torch.repeat_interleave(torch.arange(len(groups), device=groups.device), counts)
        offsets = torch.arange(int(counts.sum()), device=groups.device) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts
        )
        texts = self._by_group[torch.repeat_interleave(start, counts) + offsets]
        own = torch.zeros(len(groups), images, dtype=torch.bool, device=groups.device)
        own[rows, self._text_image[texts]] = True
        return own[inverse]


def _median(ranks: torch.Tensor) -> float:
    """The median as numpy gives it: the mean of the two middle values of an even count."""
    r = ranks.double().sort().values
    n = len(r)
    return float(r[n // 2]) if n % 2 else float((r[n // 2 - 1] + r[n // 2]) / 2)


@torch.no_grad()
def retrieval_figures(
    image_emb: torch.Tensor, text_emb: torch.Tensor, text_image: torch.Tensor, text_groups=None
) -> dict:
    """Image -> text and text -> image recall@1/5/10 and median rank.

    Args:
        image_emb: (Ni, D) normalized image embeddings.
        text_emb: (Nt, D) normalized text embeddings.
        text_image: (Nt,) int64, the index into ``image_emb`` of each text's image; every image has at least
            one text.
        text_groups: (Nt,) int64, one value per distinct caption (texts with one value are the same caption),
            or None: every text its own. A repeated caption is one candidate of image -> text, and the own
            caption of every image it captions; text -> image finds any of those images. As the loss treats
            them: rows that share a caption are not each other's negatives. Captions all distinct: the same
            figures as None.

    Returns:
        {"i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10": percent (0-100), "i2t_median_rank",
        "t2i_median_rank": 1-based, "mean_recall": the mean of the six recalls}. Ties count against the query.

    Raises:
        ValueError: shapes that do not fit, an index out of range, or an image without a text.
    """
    image_emb, text_emb = image_emb.float(), text_emb.float()
    text_image = torch.as_tensor(text_image, dtype=torch.long, device=text_emb.device).reshape(-1)
    ni, nt = len(image_emb), len(text_emb)
    if ni == 0 or nt == 0 or len(text_image) != nt or image_emb.shape[1:] != text_emb.shape[1:]:
        raise ValueError(
            f"retrieval needs image (Ni, D) and text (Nt, D) embeddings and Nt image indices; got "
            f"{tuple(image_emb.shape)}, {tuple(text_emb.shape)} and {len(text_image)}"
        )
    if int(text_image.min()) < 0 or int(text_image.max()) >= ni:
        raise ValueError(f"text_image holds indices outside 0..{ni - 1}")
    captions = torch.bincount(text_image, minlength=ni)
    if bool((captions == 0).any()):
        raise ValueError(f"{int((captions == 0).sum())} image(s) have no text (first: {int(captions.argmin())})")
    owns = None
    if text_groups is not None:
        text_groups = torch.as_tensor(text_groups, dtype=torch.long, device=text_emb.device).reshape(-1)
        if len(text_groups) != nt:
            raise ValueError(f"text_groups has {len(text_groups)} entries for {nt} texts")
        distinct, group = torch.unique(text_groups, return_inverse=True)  # group: 0..G-1
        if len(distinct) < nt:  # a caption repeats: its rows are one candidate
            owns = _Owns(text_image, group, len(distinct))
    ranks = {
        "i2t": _ranks_i2t(image_emb, text_emb, text_image, owns),  # (Ni,)
        "t2i": _ranks_t2i(image_emb, text_emb, text_image, owns),  # (Nt,)
    }
    figures = {
        f"{way}_r{k}": 100.0 * float((r <= k).double().mean()) for way, r in ranks.items() for k in RECALL_AT
    }
    mean_recall = sum(figures.values()) / len(figures)
    figures.update({f"{way}_median_rank": _median(r) for way, r in ranks.items()})
    figures["mean_recall"] = mean_recall
    return figures


def known_classes(names) -> list[str] | None:
    """The class names zero-shot can be scored on, None for fewer than two: a --no-labels input's rows are all of
    one class ('unlabeled'), and one class makes any image "right"."""
    return list(names) if len(names or ()) >= 2 else None


def class_prompts(class_names: list[str], templates: list[str] | tuple[str, ...]) -> list[list[str]]:
    """Per class, its name put into every template ("a photo of a {}." -> "a photo of a cat."): (C, T)."""
    return [[t.format(name) for t in templates] for name in class_names]


def class_embeddings(prompt_emb: torch.Tensor) -> torch.Tensor:
    """The prompt ensemble (CLIP's): per class, the normalized mean of its prompts' normalized embeddings.

    Args:
        prompt_emb: (C, T, D) embeddings of ``class_prompts``.

    Returns:
        (C, D) normalized.
    """
    mean = torch.nn.functional.normalize(prompt_emb.float(), dim=-1).mean(1)
    return torch.nn.functional.normalize(mean, dim=-1)


def class_ensemble(net: torch.nn.Module, prompt_emb: torch.Tensor) -> torch.Tensor:
    """The class embeddings (C, D) of a model's prompt embeddings (C, T, D): its zero-shot map's ensemble where
    it has one (``mmfast.models.prompt_map.PromptMap.ensemble``), else ``class_embeddings``."""
    pmap = getattr(net, "prompt_map", None)
    return class_embeddings(prompt_emb) if pmap is None else pmap.ensemble(prompt_emb)


@torch.no_grad()
def zero_shot_figures(image_emb: torch.Tensor, labels: torch.Tensor, class_text_emb: torch.Tensor) -> dict:
    """Zero-shot accuracy: an image is right when its class's text embedding scores strictly higher than every
    other class's (a tie counts against it).

    Args:
        image_emb: (N, D) normalized image embeddings.
        labels: (N,) int64 class indices into ``class_text_emb``; negative ones (masked samples) are left out.
        class_text_emb: (C, D) normalized class embeddings (``class_embeddings``).

    Returns:
        {"zero_shot_acc": percent (0-100), "zero_shot_samples": the images scored}.
    """
    labels = torch.as_tensor(labels, dtype=torch.long, device=image_emb.device).reshape(-1)
    keep = labels >= 0
    if len(labels) != len(image_emb) or (len(labels) and int(labels.max()) >= len(class_text_emb)):
        raise ValueError(f"zero-shot needs one label in 0..{len(class_text_emb) - 1} per image")
    image_emb, labels = image_emb[keep].float(), labels[keep]
    if len(labels) == 0:
        return {"zero_shot_acc": 0.0, "zero_shot_samples": 0}
    sim = image_emb @ class_text_emb.float().T  # (N, C)
    own = sim.gather(1, labels[:, None])  # (N, 1)
    right = (sim >= own).sum(1) == 1  # only its own class reaches its score
    return {"zero_shot_acc": 100.0 * float(right.double().mean()), "zero_shot_samples": int(len(labels))}


def read_class_names(value: str | os.PathLike) -> list[str]:
    """Zero-shot class names given by the user: a file (one name per line, blank lines and lines starting with
    '#' skipped), else names separated by commas.

    Raises:
        ValueError: fewer than two names (one class is every image's answer), a name given twice, a file named
            that is not there or not UTF-8.
    """
    text = str(value)
    if os.path.isfile(text):  # not Path.is_file(): a long list of names is no file name, not an error
        try:
            lines = Path(text).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(
                f"--classes {text}: cannot read the file ({e}); give UTF-8 text, one name a line"
            ) from None
        names = [n.strip() for n in lines if n.strip() and not n.strip().startswith("#")]
    elif "," not in text and (text.endswith((".txt", ".csv", ".lst")) or os.sep in text):
        raise ValueError(f"--classes {text}: no such file; give a file of names, one a line, or names, a,b,c")
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
    if len(names) < 2:
        raise ValueError(
            f"--classes {text!r}: give at least two class names, separated by commas or one per line in a "
            "file (with one, every image is that class)"
        )
    twice = sorted(n for n, k in Counter(names).items() if k > 1)
    if twice:
        raise ValueError(f"--classes: {', '.join(map(repr, twice))} given more than once; give each class once")
    return names


def read_templates(value: str | os.PathLike | None) -> list[str]:
    """Zero-shot prompt templates: None -> DEFAULT_TEMPLATES; a file (one template per line, blank lines and
    lines starting with '#' skipped); else '|'-separated templates.

    Raises:
        ValueError: no template, or one without the "{}" the class name goes into (naming it and its line).
    """
    if value is None:
        return list(DEFAULT_TEMPLATES)
    path = Path(value)
    if os.path.isfile(path):  # not Path.is_file(): many templates joined by '|' are no file name, not an error
        lines = path.read_text(encoding="utf-8").splitlines()
        where = [(f"{path}:{n}", line.strip()) for n, line in enumerate(lines, 1)]
        where = [(w, t) for w, t in where if t and not t.startswith("#")]
    else:
        where = [(f"template {n}", t.strip()) for n, t in enumerate(str(value).split("|"), 1)]
        where = [(w, t) for w, t in where if t]
    if not where:
        raise ValueError(f"zero-shot templates {str(value)!r}: none given")
    for w, t in where:
        if t.count("{}") != 1 or t.replace("{}", "").count("{") or t.replace("{}", "").count("}"):
            raise ValueError(
                f"zero-shot templates: {w} {t!r} must hold exactly one {{}} (where the class name goes) and no "
                "other braces, e.g. 'a photo of a {}.'"
            )
    return [t for _, t in where]

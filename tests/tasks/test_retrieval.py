"""Retrieval and zero-shot figures (mmfast/tasks/retrieval.py) on embeddings whose ranks are known by hand.

With one-hot image embeddings (``torch.eye``), row t of the text embeddings *is* text t's score for each image,
so every score below is written out; the values are exact in float32, so ties are real ties.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from mmfast.tasks import retrieval
from mmfast.tasks.retrieval import (
    DEFAULT_TEMPLATES,
    caption_groups,
    class_embeddings,
    class_prompts,
    read_templates,
    retrieval_figures,
    zero_shot_figures,
)


@pytest.fixture(params=[1024, 2], ids=["one-block", "blocks-of-2"])
def chunk(request, monkeypatch):
    """Each test twice: in one similarity block, and in blocks of 2 query rows (offsets between blocks)."""
    monkeypatch.setattr(retrieval, "_CHUNK", request.param)
    return request.param


def _figures(scores: list[list[float]], text_image: list[int]) -> dict:
    s = torch.tensor(scores)  # (Nt, Ni): text t's score for image i
    return retrieval_figures(torch.eye(s.shape[1]), s, torch.tensor(text_image))


def test_ranks_are_one_based_and_ties_count_against_the_query(chunk):
    scores = [
        [0.875, 0.125, 0.25, 0.375],  # own image 0 highest: t2i rank 1
        [0.5, 0.375, 0.125, 0.0],  # one image above its own: rank 2
        [0.375, 0.25, 0.125, 0.0],  # two above: rank 3
        [0.75, 0.75, 0.75, 0.75],  # all tied with its own: rank 4 (pessimistic), not 1
    ]
    f = _figures(scores, [0, 1, 2, 3])
    # t2i ranks [1, 2, 3, 4]. i2t, down each column: image 0's text scores 0.875 above 0.5, 0.375, 0.75 -> 1;
    # image 1: 0.375 below text 3's 0.75 -> 2; image 2: 0.125 tied with text 1's, below 0.25 and 0.75 -> 4;
    # image 3: 0.75 above 0.375, 0.0, 0.0 -> 1.
    assert f["t2i_r1"] == 25.0 and f["t2i_r5"] == 100.0 and f["t2i_r10"] == 100.0
    assert f["t2i_median_rank"] == 2.5  # the mean of the middle two of [1, 2, 3, 4]
    assert f["i2t_r1"] == 50.0 and f["i2t_r5"] == 100.0
    assert f["i2t_median_rank"] == 1.5  # of [1, 1, 2, 4]
    assert f["mean_recall"] == pytest.approx((25 + 100 + 100 + 50 + 100 + 100) / 6)


def test_recall_at_5_and_10_count_ranks_up_to_k_inclusive(chunk):
    # 12 images; text t's own image is image t and exactly rank-1 other images score above it
    ranks = [1, 5, 6, 10, 11]
    scores = [[0.25] * 12 for _ in ranks]
    for t, rank in enumerate(ranks):
        scores[t][t] = 0.5
        for other in [i for i in range(12) if i != t][: rank - 1]:
            scores[t][other] = 0.75
    # images 5..11 need a caption each: give them texts that retrieve them first
    extra = [[1.0 if i == j else 0.0 for i in range(12)] for j in range(5, 12)]
    f = _figures(scores + extra, list(range(12)))
    t2i = ranks + [1] * 7
    assert f["t2i_r1"] == pytest.approx(100 * sum(r <= 1 for r in t2i) / 12)
    assert f["t2i_r5"] == pytest.approx(100 * sum(r <= 5 for r in t2i) / 12)  # rank 5 counts, 6 does not
    assert f["t2i_r10"] == pytest.approx(100 * sum(r <= 10 for r in t2i) / 12)  # rank 10 counts, 11 does not
    assert f["t2i_median_rank"] == 1.0


def test_a_tie_at_the_boundary_is_pessimistic(chunk):
    # text 0 ties with 4 other images: rank 5 (in R@5, not in R@1); with 5 others it is rank 6 (out of R@5)
    scores = [[0.5] * 5 + [0.0] * 3, [0.5] * 6 + [0.0] * 2] + [
        [1.0 if i == j else 0.0 for i in range(8)] for j in range(2, 8)
    ]
    f = _figures(scores, list(range(8)))
    assert f["t2i_r1"] == pytest.approx(100 * 6 / 8)
    assert f["t2i_r5"] == pytest.approx(100 * 7 / 8)
    assert f["t2i_r10"] == 100.0


def test_an_image_with_several_captions_ranks_by_its_best_one(chunk):
    # image 0's captions are texts 0 and 1, image 1's texts 2 and 3; columns are each image's text scores
    scores = [
        [0.25, 0.75],
        [0.75, 0.5],
        [0.5, 0.25],
        [0.125, 0.5],
    ]
    f = _figures(scores, [0, 0, 1, 1])
    # i2t: image 0's best own caption (text 1, 0.75) is above every other caption -> rank 1 (its first caption
    # alone, 0.25, would rank 3); image 1's best own (text 3, 0.5) ties with text 1's 0.5, below text 0's 0.75
    # -> rank 3, its other own caption not counted against it.
    assert f["i2t_r1"] == 50.0 and f["i2t_r5"] == 100.0 and f["i2t_median_rank"] == 2.0
    # t2i: text 0 ranks image 0 below image 1 (2), text 1 first (1), text 2 second (2), text 3 first (1)
    assert f["t2i_r1"] == 50.0 and f["t2i_median_rank"] == 1.5


def test_matching_embeddings_retrieve_perfectly_and_a_constant_model_scores_worst(chunk):
    g = torch.Generator().manual_seed(0)
    emb = torch.nn.functional.normalize(torch.randn(7, 16, generator=g), dim=1)
    f = retrieval_figures(emb, emb.clone(), torch.arange(7))
    assert all(f[f"{w}_r{k}"] == 100.0 for w in ("i2t", "t2i") for k in (1, 5, 10))
    assert f["i2t_median_rank"] == f["t2i_median_rank"] == 1.0 and f["mean_recall"] == 100.0
    same = torch.ones(7, 16) / 4
    worst = retrieval_figures(same, same, torch.arange(7))  # every score tied: every rank is the last one
    assert worst["t2i_median_rank"] == worst["i2t_median_rank"] == 7.0 and worst["i2t_r5"] == 0.0


def test_a_repeated_caption_is_one_candidate_and_every_image_it_captions_is_its_own(chunk):
    # images 0 and 1 are both captioned "cat" (texts 0 and 1, group 7), image 2 "dog" (text 2), image 3 "dog"
    # too (text 3) and "puppy" (text 4)
    scores = [
        [0.5, 0.75, 0.25, 0.0],  # "cat" (image 0's row): image 1 scores highest, and it is a cat too -> 1
        [0.5, 0.75, 0.25, 0.0],  # the same caption on image 1's row, the same scores -> 1
        [0.625, 0.125, 0.375, 0.25],  # "dog": image 0 (a cat) above both dogs -> 2
        [0.625, 0.125, 0.375, 0.25],
        [0.0, 0.875, 0.125, 0.5],  # "puppy": image 1 above image 3 -> 2 ("dog" is not "puppy")
    ]
    groups = torch.tensor([7, 7, 3, 3, 9])
    f = retrieval_figures(torch.eye(4), torch.tensor(scores), torch.tensor([0, 1, 2, 3, 3]), groups)
    assert f["t2i_r1"] == 40.0 and f["t2i_median_rank"] == 2.0  # ranks [1, 1, 2, 2, 2]
    # i2t, the distinct captions' best scores per image (cat, dog, puppy): image 0 (0.5, 0.625, 0.0): its cat
    # below dog -> 2; image 1 (0.75, 0.125, 0.875): 2; image 2 (0.25, 0.375, 0.125): dog first -> 1; image 3
    # (0.0, 0.25, 0.5): puppy, its own -> 1. Without groups, image 0's "cat" would also lose to image 1's.
    assert f["i2t_r1"] == 50.0 and f["i2t_median_rank"] == 1.5


def test_captions_all_distinct_give_the_figures_of_no_groups(chunk):
    g = torch.Generator().manual_seed(1)
    img = torch.nn.functional.normalize(torch.randn(9, 8, generator=g), dim=1)
    txt = torch.nn.functional.normalize(torch.randn(12, 8, generator=g), dim=1)
    text_image = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 3, 3])
    plain = retrieval_figures(img, txt, text_image)
    assert retrieval_figures(img, txt, text_image, torch.arange(100, 112)) == plain
    assert retrieval_figures(img, txt, text_image, torch.arange(11, -1, -1)) == plain


def test_repeated_captions_in_random_splits_rank_as_the_definition_says(chunk):
    """Random images with one to three captions drawn from a few distinct ones, texts in shuffled order: each
    rank equals the one counted out by the module doc's definition, pair by pair."""
    g = torch.Generator().manual_seed(3)
    ni, vocab = 23, 9
    text_image = torch.cat([torch.arange(ni), torch.randint(0, ni, (19,), generator=g)])
    text_image = text_image[torch.randperm(len(text_image), generator=g)]
    groups = torch.randint(0, vocab, (len(text_image),), generator=g) * 5 + 2  # any values, a few repeated
    img = torch.nn.functional.normalize(torch.randn(ni, 4, generator=g), dim=1)
    word = torch.nn.functional.normalize(torch.randn(vocab * 5 + 3, 4, generator=g), dim=1)
    txt = word[groups]  # one caption, one embedding
    owned = {(int(i), int(c)) for i, c in zip(text_image, groups, strict=True)}
    sim = img @ txt.T
    i2t, t2i = [], []
    for i in range(ni):
        best = {int(c): float(sim[i, t]) for t, c in enumerate(groups)}  # a caption's score, once per caption
        own = max(v for c, v in best.items() if (i, c) in owned)
        i2t.append(1 + sum(v >= own for c, v in best.items() if (i, c) not in owned))
    for t, c in enumerate(groups.tolist()):
        own = max(float(sim[i, t]) for i in range(ni) if (i, c) in owned)
        t2i.append(1 + sum(float(sim[i, t]) >= own for i in range(ni) if (i, c) not in owned))
    f = retrieval_figures(img, txt, text_image, groups)
    for way, ranks in (("i2t", i2t), ("t2i", t2i)):
        for k in (1, 5, 10):
            assert f[f"{way}_r{k}"] == pytest.approx(100.0 * sum(r <= k for r in ranks) / len(ranks))
        assert f[f"{way}_median_rank"] == float(np.median(ranks))


def test_class_names_as_captions_retrieve_their_class():
    """A folder of classes with the class name as every caption: a model that puts each image on its class's
    caption retrieves perfectly; counting the other images' identical captions against it scored 0 R@1."""
    g = torch.Generator().manual_seed(2)
    classes = torch.eye(3, 16)  # one-hot: an image's score for a caption is one of its entries, exact on any BLAS
    label = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    img = torch.nn.functional.normalize(classes[label] + 0.01 * torch.randn(7, 16, generator=g), dim=1)
    txt = classes[label]  # image i's caption: its class name
    assert retrieval_figures(img, txt, torch.arange(7))["i2t_r1"] == 0.0  # every image ties with its kin
    f = retrieval_figures(img, txt, torch.arange(7), label)
    assert f["i2t_r1"] == f["t2i_r1"] == 100.0


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="have no text"):
        retrieval_figures(torch.eye(3), torch.eye(3)[:2], torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="outside 0..2"):
        retrieval_figures(torch.eye(3), torch.eye(3), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="embeddings"):
        retrieval_figures(torch.eye(3), torch.eye(4), torch.tensor([0, 1, 2, 2]))
    with pytest.raises(ValueError, match="text_groups has 2 entries for 3 texts"):
        retrieval_figures(torch.eye(3), torch.eye(3), torch.arange(3), torch.tensor([0, 0]))


def test_caption_groups():
    first, text_image = caption_groups(["a.jpg", "b.jpg", "a.jpg", "c.jpg", "b.jpg"])
    assert first == [0, 1, 3] and text_image.tolist() == [0, 1, 0, 2, 1]


def test_zero_shot_accuracy_is_strict_and_skips_masked_samples():
    classes = torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 0.5, 1.0]])  # (C=2, D=4)
    images = torch.eye(4)  # image n's score for class c is classes[c, n]: [1, 0], [0, 1], [0.5, 0.5], [0, 1]
    f = zero_shot_figures(images, torch.tensor([0, 1, 0, -100]), classes)
    assert f == {"zero_shot_acc": pytest.approx(100 * 2 / 3), "zero_shot_samples": 3}  # the tie counts as wrong
    assert zero_shot_figures(images[:2], torch.tensor([1, 0]), classes)["zero_shot_acc"] == 0.0
    with pytest.raises(ValueError, match="one label in 0..1"):
        zero_shot_figures(images, torch.tensor([0, 1, 2, 0]), classes)


def test_class_prompts_and_their_ensemble():
    assert class_prompts(["cat", "red circle"], ["a photo of a {}.", "{}"]) == [
        ["a photo of a cat.", "cat"],
        ["a photo of a red circle.", "red circle"],
    ]
    # each prompt normalized before the mean: [2, 0] weighs as much as [0, 1]
    emb = class_embeddings(torch.tensor([[[2.0, 0.0], [0.0, 1.0]], [[0.0, 3.0], [0.0, 1.0]]]))
    torch.testing.assert_close(emb, torch.tensor([[2**-0.5, 2**-0.5], [0.0, 1.0]]))


def test_read_templates(tmp_path):
    assert read_templates(None) == list(DEFAULT_TEMPLATES) and all("{}" in t for t in DEFAULT_TEMPLATES)
    assert read_templates("a photo of a {}.| {} ||art of {}") == ["a photo of a {}.", "{}", "art of {}"]
    path = tmp_path / "templates.txt"
    path.write_text("# prompts\na sketch of a {}.\n\n  a {} in the wild  \n")
    assert read_templates(str(path)) == ["a sketch of a {}.", "a {} in the wild"]
    with pytest.raises(ValueError, match=r"template 2 'a photo' must hold exactly one \{\}"):
        read_templates("a {}|a photo")
    with pytest.raises(ValueError, match="exactly one"):
        read_templates("{} and {}")
    with pytest.raises(ValueError, match="no other braces"):
        read_templates("a {0} photo of {}")
    path.write_text("a {}\nno braces here\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2 'no braces here'")):
        read_templates(str(path))
    with pytest.raises(ValueError, match="none given"):
        read_templates(" | ")

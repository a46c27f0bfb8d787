"""The contrastive task (mmfast/tasks/contrastive.py, global_batch.py): CLIP and SigLIP losses with same-image /
same-caption pairs left out of the negatives, the global batch of two processes (gloo), exact gradient
accumulation by cached features, the evaluation's de-duplication, datasets without labels, and the real loop.

The model here is a test double of the dual encoder's output contract (``mmfast.models.dual``): {"image", "text":
(B, D) normalized, "logit_scale", "logit_bias": 0-dim}, from linear layers over tiny images and mean token
embeddings.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mmfast.tasks import build_task, global_batch
from mmfast.tasks.classification import ClassificationTask
from mmfast.tasks.contrastive import ContrastiveTask, contrastive_loss
from mmfast.tasks.retrieval import class_embeddings, class_prompts, retrieval_figures, zero_shot_figures
from tests.conftest import spawn_two

TOL = {"rtol": 1e-5, "atol": 1e-6}  # float32: the same sums in another order
VOCAB, LENGTH, SIDE = 30, 6, 4


class TinyDual(nn.Module):
    """The dual encoder's contract over linear layers; ``calls`` counts training forwards (a buffer, as batch
    norm's statistics are)."""

    def __init__(self, dim: int = 8, dropout: float = 0.0, vocab: int = VOCAB):
        super().__init__()
        self.img = nn.Linear(3 * SIDE * SIDE, dim)
        self.emb = nn.Embedding(vocab, 12)
        self.txt = nn.Linear(12, dim)
        self.drop = nn.Dropout(dropout)
        self.t = nn.Parameter(torch.tensor(math.log(10.0)))
        self.b = nn.Parameter(torch.tensor(-2.0))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def encode_image(self, images):
        return F.normalize(self.img(self.drop(images.flatten(1))), dim=-1)

    def encode_text(self, input_ids, attention_mask):
        m = attention_mask[..., None].float()
        pooled = (self.emb(input_ids) * m).sum(1) / m.sum(1).clamp(min=1)
        return F.normalize(self.txt(self.drop(pooled)), dim=-1)

    def forward(self, batch):
        if self.training:
            self.calls += 1
        return {
            "image": self.encode_image(batch["image"]),
            "text": self.encode_text(batch["input_ids"], batch["attention_mask"]),
            "logit_scale": self.t.exp().clamp(max=100),
            "logit_bias": self.b,
        }


class Rows:
    """A stand-in of PreparedDataset: what the task reads of one (rows, labels, the tokenizer's directory)."""

    def __init__(self, train: list[dict], val: list[dict] = (), labels=None, tokenizer_dir=None):
        self.root = Path("rows")
        self.splits = {"train": list(train), "val": list(val)}
        self.labels = labels or {"unlabeled": 0}
        self.tokenizer_dir = tokenizer_dir

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def split_size(self, split):
        return len(self.splits[split])

    def iter_rows(self, split):
        return iter(self.splits[split])


def _rows(spec: list[tuple[str, str]], first_id: int = 0, label=lambda i: 0) -> list[dict]:
    return [{"id": first_id + i, "image": im, "text": t, "label": label(i)} for i, (im, t) in enumerate(spec)]


def _batch(ids: list[int], seed: int, labels: list[int] | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = len(ids)
    mask = torch.ones(n, LENGTH, dtype=torch.int64)
    mask[:, LENGTH - 2 :] = torch.randint(0, 2, (n, 2), generator=g)
    return {
        "image": torch.randn(n, 3, SIDE, SIDE, generator=g),
        "input_ids": torch.randint(1, VOCAB, (n, LENGTH), generator=g),
        "attention_mask": mask,
        "label": torch.tensor(labels if labels is not None else [0] * n),
        "id": torch.tensor(ids),
    }


def _grads(model) -> dict:
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()
    }


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _close(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[k], b[k], **TOL) for k in a)


# --- same image / same caption --------------------------------------------------------------------------------

# ids 0, 1: two captions of one image; ids 2, 3: one caption of two images; 4, 5: nothing shared
MASKING_ROWS = _rows([("a.jpg", "a cat"), ("a.jpg", "a grey cat"), ("b.jpg", "a dog"), ("c.jpg", "a dog")])
MASKING_ROWS += _rows([("d.jpg", "a bird"), ("e.jpg", "a fish")], first_id=4)
NOT_NEGATIVES = {(0, 1), (1, 0), (2, 3), (3, 2)}


def _by_hand(kind: str, out: dict, n: int, skip: set) -> float:
    """The loss of samples 0..n-1 written out pair by pair in float64; ``skip``: pairs that are no negatives."""
    s = (out["logit_scale"] * out["image"] @ out["text"].T).detach().double()[:n, :n]
    b = out["logit_bias"].item()
    total = 0.0
    for i in range(n):
        cols = [j for j in range(n) if (i, j) not in skip]
        if kind == "clip":
            i2t = -s[i, i] + torch.logsumexp(s[i, cols], 0)
            t2i = -s[i, i] + torch.logsumexp(s[cols, i], 0)
            total += (i2t + t2i).item() / 2
        else:
            total -= sum(float(F.logsigmoid((1.0 if j == i else -1.0) * (s[i, j] + b))) for j in cols)
    return total / n


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_captions_of_one_image_and_identical_captions_are_no_negatives(kind):
    """A batch holds two captions of one image and one caption of two images, plus a padding sample: the loss
    is the hand-written one with those pairs left out (and without the padding), not the unmasked one."""
    torch.manual_seed(0)
    task = ContrastiveTask(Rows(MASKING_ROWS), loss=kind)
    model = TinyDual()
    batch = _batch([0, 1, 2, 3, 4, 5, -1], seed=1)
    out = model(batch)
    loss = task.loss(out, task.targets(batch)).item()
    masked, unmasked = _by_hand(kind, out, 6, NOT_NEGATIVES), _by_hand(kind, out, 6, set())
    assert loss == pytest.approx(masked, rel=1e-5)
    assert abs(masked - unmasked) > 1e-3  # the batch tells the two apart
    distinct = ContrastiveTask(Rows(_rows([(f"{i}.jpg", f"caption {i}") for i in range(6)])), loss=kind)
    assert distinct.loss(out, batch["id"]).item() == pytest.approx(unmasked, rel=1e-5)


def test_image_groups_follow_the_file_and_its_sha():
    rows = _rows([("a.jpg", "x"), ("b.jpg", "y"), ("c.jpg", "z")])
    rows[1]["sha256"] = rows[2]["sha256"] = "same bytes"
    groups = ContrastiveTask(Rows(rows)).groups(torch.tensor([0, 1, 2]))
    assert groups[0, 1] == groups[0, 2] != groups[0, 0]
    assert len(set(groups[1].tolist())) == 3


# --- the global batch of two processes ---------------------------------------------------------------------------

# 8 samples over 2 ranks; ids 0 and 1 (one image) land on different ranks, and rank 1 holds a padding sample
GLOBAL_IDS = [0, 2, 4, 6, 1, 3, 5, -1]
GLOBAL_ROWS = _rows([("a.jpg", "c0"), ("a.jpg", "c1")] + [(f"{i}.jpg", f"c{i}") for i in range(2, 7)])


def _plain_gather(x, sizes):
    """all_gather without a gradient: the other ranks' columns are constants (what must not pass)."""
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def _global_case(kind: str, gather=None, window: int = 1, rank: int = 0, world: int = 1) -> tuple[float, dict]:
    """(loss, gradients) of this rank's share of the global batch, ``window`` micro-batches of it."""
    torch.manual_seed(0)
    model = TinyDual()
    task = ContrastiveTask(Rows(GLOBAL_ROWS), loss=kind)
    full = _batch(GLOBAL_IDS, seed=3)
    n = len(GLOBAL_IDS) // world
    mine = {k: v[rank * n : (rank + 1) * n] for k, v in full.items()}
    if window > 1:
        step = n // window
        batches = [{k: v[i : i + step] for k, v in mine.items()} for i in range(0, n, step)]
        acc = SimpleNamespace(device=torch.device("cpu"), backward=lambda loss: loss.backward())
        loss = float(task.backward_window(acc, model, batches, contextlib.nullcontext))
    else:
        out = model(mine)
        loss_t = contrastive_loss(
            kind, out, mine["id"], task.groups(mine["id"]), gather or global_batch.gather_features
        )
        loss_t.backward()
        loss = loss_t.item()
    return loss, _grads(model)


def _worker(rank: int, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        results = {}
        for kind in ("clip", "siglip"):
            cases = {"with_grad": {}, "plain": {"gather": _plain_gather}, "window": {"window": 2}}
            for name, kw in cases.items():
                loss, grads = _global_case(kind, rank=rank, world=2, **kw)
                flat = torch.cat([torch.tensor([loss])] + [g.flatten() for g in grads.values()])
                dist.all_reduce(flat)  # the mean over ranks: DDP's mean of the gradients
                flat /= 2
                results[kind, name] = flat
        if rank == 0:
            torch.save(results, Path(out_dir) / "results.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_two_processes_train_on_the_global_batch(tmp_path):
    """Two gloo processes, each its half: the mean loss and every gradient (averaged over ranks, as DDP does)
    equal one process on the whole batch, also when each rank accumulates two micro-batches; a gather
    without gradient does not (the test tells them apart)."""
    spawn_two(_worker, (f"file://{tmp_path / 'pg'}", str(tmp_path)), 60)
    results = torch.load(tmp_path / "results.pt")
    for kind in ("clip", "siglip"):
        loss, grads = _global_case(kind)
        ref = torch.cat([torch.tensor([loss])] + [g.flatten() for g in grads.values()])
        for name in ("with_grad", "window"):
            diff = float((results[kind, name] - ref).abs().max())
            assert torch.allclose(results[kind, name], ref, **TOL), (kind, name, diff)
        assert results[kind, "plain"][0] == pytest.approx(float(ref[0]), rel=1e-5)  # the same loss ...
        assert not torch.allclose(results[kind, "plain"][1:], ref[1:], **TOL), kind  # ... the wrong gradient


# --- exact gradient accumulation --------------------------------------------------------------------------------

ACCUM_ROWS = _rows([(f"{i // 2}.jpg", f"caption {i}") for i in range(64)])  # two captions an image
ACCUM_IDS = torch.randperm(64, generator=torch.Generator().manual_seed(5)).tolist()


def _accum_setup(kind: str, dropout: float):
    torch.manual_seed(0)
    model = TinyDual(dropout=dropout)
    task = ContrastiveTask(Rows(ACCUM_ROWS), loss=kind)
    full = _batch(ACCUM_IDS, seed=7)
    micro = [{k: v[i : i + 16] for k, v in full.items()} for i in range(0, 64, 16)]
    return model, task, full, micro


def _cached(model, task, micro) -> tuple[float, dict]:
    torch.manual_seed(11)
    acc = SimpleNamespace(device=torch.device("cpu"), backward=lambda loss: loss.backward())
    loss = float(task.backward_window(acc, model, micro, contextlib.nullcontext))
    return loss, _grads(model)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_accumulating_4x16_by_cached_features_equals_one_batch_of_64(kind):
    """Without dropout: ``backward_window`` over four micro-batches of 16 gives the loss and every gradient of
    one forward and backward of the 64; accumulating the four micro-batch losses (each with its own negatives
    only) does not. Each micro-batch's forward counts once in the buffers."""
    model, task, full, micro = _accum_setup(kind, dropout=0.0)
    ref = task.loss(model(full), full["id"])
    ref.backward()
    ref_grads = _grads(model)
    model.zero_grad()
    model.calls.zero_()
    loss, grads = _cached(model, task, micro)
    assert loss == pytest.approx(ref.item(), rel=1e-6)
    assert _close(grads, ref_grads), _max_diff(grads, ref_grads)
    assert int(model.calls) == 4  # the no-grad pass's buffer updates are put back
    model.zero_grad()
    naive = 0.0
    for mb in micro:
        part = task.loss(model(mb), mb["id"]) / 4
        part.backward()
        naive += part.item()
    assert not _close(_grads(model), ref_grads)
    assert abs(naive - ref.item()) > 1e-3


def test_cached_accumulation_replays_each_micro_batchs_dropout(monkeypatch):
    """With dropout: the cached window equals the whole window's graph kept in memory (each micro-batch's
    forward from the same RNG state); without putting the RNG state back it does not."""
    model, task, _, micro = _accum_setup("clip", dropout=0.3)
    torch.manual_seed(11)
    outs = [model(mb) for mb in micro]
    whole = {k: torch.cat([o[k] for o in outs]) for k in ("image", "text")}
    whole |= {k: outs[0][k] for k in ("logit_scale", "logit_bias")}
    ref = task.loss(whole, torch.cat([mb["id"] for mb in micro]))
    ref.backward()
    ref_grads = _grads(model)
    model.zero_grad()
    loss, grads = _cached(model, task, micro)
    assert loss == pytest.approx(ref.item(), rel=1e-6)
    assert _close(grads, ref_grads), _max_diff(grads, ref_grads)
    model.zero_grad()
    monkeypatch.setattr(global_batch, "_set_rng_state", lambda state, device: None)
    _, unreplayed = _cached(model, task, micro)
    assert not _close(unreplayed, ref_grads)


# --- evaluation and datasets without labels ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from mmfast.data.tokenizer import train_wordpiece

    out = tmp_path_factory.mktemp("tokenizer")
    train_wordpiece(
        ["a photo of a cat", "an image of a dog", "an icon of a bird"], vocab_size=VOCAB
    ).save_pretrained(out)
    return out


def test_evaluation_counts_each_sample_once_and_each_image_once(tokenizer_dir):
    """Val batches with a padding sample and a repeated id (as a padded last batch has): the figures are the
    retrieval figures of the distinct samples, two captions of one image as one image, and zero-shot over the
    distinct images with the class prompts."""
    labels = {"cat": 0, "dog": 1}
    val = _rows(
        [("a.jpg", "c0"), ("a.jpg", "c1"), ("b.jpg", "c2"), ("c.jpg", "c3"), ("d.jpg", "c4")],
        first_id=10,
        label=lambda i: i % 2,
    )
    task = ContrastiveTask(Rows([], val, labels, tokenizer_dir), zero_shot_templates="a photo of a {}|{}")
    from mmfast.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    torch.manual_seed(0)
    model = TinyDual(vocab=len(tok))
    loader = [
        _batch([13, 10, 14], seed=1, labels=[1, 0, 0]),
        _batch([11, 12, -1, 13], seed=2, labels=[1, 0, -100, 1]),
    ]
    acc = SimpleNamespace(device=torch.device("cpu"), unwrap_model=lambda m: m, autocast=contextlib.nullcontext)
    figures = task.evaluate(acc, model, loader)
    assert model.training
    model.eval()
    with torch.no_grad():
        img, txt = {}, {}
        for b in loader:  # each id's first sighting; id 13's second one (other pixels) must not count
            for pos, i in enumerate(b["id"].tolist()):
                if i >= 0 and i not in img:
                    out = model({n: v[pos : pos + 1] for n, v in b.items()})
                    img[i], txt[i] = out["image"][0], out["text"][0]
        images = torch.stack([img[10], img[12], img[13], img[14]])  # 10 and 11 are one image
        want = retrieval_figures(
            images, torch.stack([txt[i] for i in range(10, 15)]), torch.tensor([0, 0, 1, 2, 3])
        )
        prompts = [p for c in class_prompts(["cat", "dog"], ["a photo of a {}", "{}"]) for p in c]
        enc = tok(prompts, padding="max_length", truncation=True, max_length=LENGTH, return_tensors="pt")
        class_emb = class_embeddings(model.encode_text(enc["input_ids"], enc["attention_mask"]).reshape(2, 2, -1))
        want |= zero_shot_figures(images, torch.tensor([0, 0, 1, 0]), class_emb)
    assert figures.pop("val_samples") == 5 and figures.pop("val_images") == 4
    assert figures == pytest.approx({f"val_{k}": v for k, v in want.items()})
    assert task.tracked == ("val_mean_recall", "val_i2t_r1", "val_t2i_r1", "val_zero_shot_acc")


def test_a_dataset_without_labels_trains_contrastively_but_not_as_a_classifier():
    """A --no-labels preparation (one class): the contrastive task takes it (no zero-shot figure), classification
    refuses it; build_task passes the config fields the task declares."""
    dataset = Rows(MASKING_ROWS)
    task = build_task("contrastive", dataset, SimpleNamespace(loss="siglip", zero_shot_templates="{}", lr=1.0))
    assert task.kind == "siglip" and task.class_names is None
    assert "val_zero_shot_acc" not in task.tracked
    with pytest.raises(ValueError, match="one class"):
        ClassificationTask(dataset)
    with pytest.raises(ValueError, match="unknown loss 'infonce'"):
        ContrastiveTask(dataset, loss="infonce")
    state = task.best_figures({})
    assert task.improves({"val_mean_recall": 1.0}, state) and not task.improves({}, state)
    summary = task.summary({"val_mean_recall": 2.0, "val_i2t_r1": 1.0, "val_t2i_r1": 3.0}, state)
    assert summary == {
        "val_mean_recall": 2.0,
        "val_i2t_r1": 1.0,
        "val_t2i_r1": 3.0,
        "best_mean_recall": 0.0,
        "best_i2t_r1": None,
        "best_t2i_r1": None,
    }


# --- the real loop ----------------------------------------------------------------------------------------------


def test_the_loop_hands_each_window_to_the_task(prepared, tmp_path, monkeypatch):
    """--model clip with --grad-accum 2 through the real loop: the task gets each window's two micro-batches
    at once, and the run's metrics and summary hold the retrieval figures."""
    from mmfast.train import parse_config, train

    windows = []
    real = ContrastiveTask.backward_window

    def spy(self, accelerator, model, batches, no_sync):
        windows.append(len(batches))
        return real(self, accelerator, model, batches, no_sync)

    monkeypatch.setattr(ContrastiveTask, "backward_window", spy)
    out = tmp_path / "run"
    flags = ["--data", str(prepared), "--out", str(out), "--model", "clip", "--preset", "clip-lite0-minilm"]
    flags += ["--loss", "siglip"]
    flags += [
        "--image-backbone",
        "resnet10",
        "--text-model",
        "bert-tiny",
        "--embed-dim",
        "16",
        "--image-size",
        "32",
    ]
    flags += ["--batch-size", "8", "--grad-accum", "2", "--max-steps", "2", "--no-progress", "--no-checkpoints"]
    flags += ["--init-proj", "random"]  # the preset's ridge start is a pass over the train split: not tested here
    summary = train(parse_config(flags))
    assert windows == [2, 2] and summary["global_step"] == 2
    (m,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    assert 0 <= m["val_mean_recall"] <= 100 and math.isfinite(m["train_loss"])
    assert summary["best_mean_recall"] == m["val_mean_recall"] and summary["best_epoch"] == 0
    # the evaluation ran under the run's autocast: the metrics say so (mmfast-evaluate runs in fp32)
    assert m["eval_precision"] == {"no": "fp32"}.get(summary["mixed_precision"], summary["mixed_precision"])


# --- runs that cannot learn --------------------------------------------------------------------------------------


def test_a_split_where_no_pair_can_be_a_negative_is_refused_at_the_boundary():
    """A pair is a negative only when it shares neither image nor caption: one caption (or one image) for every
    row of the train split leaves none, and is refused naming the split and what to do; two captions and two
    images are the least that trains. A val split of two rows or more that shares one caption is refused too
    (retrieval over it ranks nothing); a val split of one row is not."""
    one_caption = _rows([(f"{i}.jpg", "cat") for i in range(5)])
    with pytest.raises(ValueError, match=r"train split has one caption for all its 5 rows.*caption file"):
        ContrastiveTask(Rows(one_caption))
    one_image = _rows([("a.jpg", f"caption {i}") for i in range(4)])
    with pytest.raises(ValueError, match="train split has one image for all its 4 rows"):
        ContrastiveTask(Rows(one_image))
    two = _rows([("a.jpg", "cat"), ("b.jpg", "cat"), ("c.jpg", "dog")])
    ContrastiveTask(Rows(two))  # the boundary: (a or b) with c is a negative pair
    val_dupes = _rows([("v1.jpg", "same"), ("v2.jpg", "same")], first_id=3)
    with pytest.raises(ValueError, match="val split has one caption for all its 2 rows.*cannot rank"):
        ContrastiveTask(Rows(two, val_dupes))
    ContrastiveTask(Rows(two, val_dupes[:1]))


def test_a_step_of_one_sample_is_refused_and_few_captions_are_noted():
    """One sample per optimizer step (all processes and micro-batches) has no negative: refused naming the flags;
    two is the boundary. A split with fewer distinct captions than a step's samples gets a note."""
    task = ContrastiveTask(Rows(_rows([("a.jpg", "cat"), ("b.jpg", "cat"), ("c.jpg", "dog")])))
    with pytest.raises(ValueError, match=r"1 sample per optimizer step.*--batch-size"):
        task.check_step_samples(1)
    assert task.check_step_samples(2) is None  # two distinct captions: a step of two may hold both
    said = task.check_step_samples(16)
    assert "3 rows have 2 distinct captions, fewer than the 16 samples" in said and "--model concat" in said
    distinct = ContrastiveTask(Rows(_rows([("a.jpg", "cat"), ("b.jpg", "dog")])))
    assert distinct.check_step_samples(16) is None  # a step larger than the split: no caption is shared


def test_an_epoch_without_a_single_negative_stops_the_run(cpu_accelerator):
    """The loss counts, on the device, the samples whose step held a negative; ``epoch_figures`` reads the share
    without one and raises when the whole epoch had none (every step was one image's or one caption's pairs)."""
    rows = _rows([("a.jpg", "x"), ("a.jpg", "y"), ("b.jpg", "z"), ("c.jpg", "z"), ("d.jpg", "w")])
    task = ContrastiveTask(Rows(rows))
    model = TinyDual()
    for ids in ([0, 1], [2, 3]):  # one image's two captions; one caption's two images: no negative
        batch = _batch(ids, seed=0)
        assert task.loss(model(batch), task.targets(batch)).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="none of the epoch's 4 samples had a negative"):
        task.epoch_figures(cpu_accelerator)
    for ids in ([0, 1, -1], [0, 4]):  # then a step where 0 and 4 are each other's negative
        batch = _batch(ids, seed=0)
        task.loss(model(batch), task.targets(batch))
    assert task.epoch_figures(cpu_accelerator) == {"no_negative_frac": 0.5}
    assert task.epoch_figures(cpu_accelerator) == {}  # read and started again


def test_mmfast_train_refuses_a_contrastive_run_that_cannot_learn(prepared, tmp_path, capsys):
    """Through mmfast-train: --batch-size 1 is refused before training (exit 2, nothing left in --out), while
    --batch-size 1 --grad-accum 2 (a window of two micro-batches is one batch of two) trains with a loss that is
    not zero; an image folder of one class without caption files (every caption the class name) is refused."""
    from conftest import save_image

    from tools import train as train_tool

    flags = ["--model", "clip", "--preset", "clip-lite0-minilm", "--image-backbone", "resnet10"]
    flags += ["--text-model", "bert-tiny", "--embed-dim", "16"]
    flags += ["--image-size", "32", "--no-progress", "--no-checkpoints", "--max-steps", "2"]
    flags += ["--eval-batch-size", "32"]  # the ridge start's pass and the evaluation: not one sample at a time
    out = tmp_path / "one"
    assert train_tool.main(["--data", str(prepared), "--out", str(out), *flags, "--batch-size", "1"]) == 2
    assert "1 sample per optimizer step has no negative" in capsys.readouterr().err
    assert not (out / "summary.json").exists() and not (out / "model").exists()
    out = tmp_path / "two"
    argv = ["--data", str(prepared), "--out", str(out), *flags, "--batch-size", "1", "--grad-accum", "2"]
    assert train_tool.main(argv) == 0
    (m,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    assert m["train_loss"] > 0.1 and m["no_negative_frac"] == 0.0
    folder = tmp_path / "photos"
    for i in range(12):
        save_image(folder / "cat" / f"{i}.png", seed=i)
    out = tmp_path / "folder"
    assert train_tool.main(["--data", str(folder), "--out", str(out), *flags, "--batch-size", "4"]) == 2
    assert "train split has one caption for all its" in capsys.readouterr().err
    assert not (out / "model").exists()

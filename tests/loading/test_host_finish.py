"""The host finishing: threads split a batch without changing a pixel; batch memory is reused only when free."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from PIL import Image

from mmfast.data.preprocessing import IMAGENET_MEAN, IMAGENET_STD
from mmfast.loading.host_finish import BatchBuffers, HostFinisher
from mmfast.loading.image_loader import ImageLoader


def _crops(photos, n: int = 13, seed: int = 0) -> list[torch.Tensor]:
    """n random crops of real photos, of different sizes (uint8 HWC)."""
    rng = np.random.default_rng(seed)
    arrays = [np.asarray(Image.open(p).convert("RGB")) for p in photos]
    out = []
    for _ in range(n):
        a = arrays[int(rng.integers(len(arrays)))]
        h, w = int(rng.integers(20, a.shape[0])), int(rng.integers(20, a.shape[1]))
        out.append(torch.from_numpy(a[:h, :w].copy()))
    return out


@pytest.mark.parametrize("resize_shorter", [None, 73])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_threads_split_the_batch_without_changing_a_pixel(photos, resize_shorter, dtype):
    crops = _crops(photos)
    flips = np.arange(len(crops)) % 3 == 0
    outputs = []
    for threads in (1, 2, 5):
        f = HostFinisher(64, IMAGENET_MEAN, IMAGENET_STD, resize_shorter=resize_shorter, threads=threads)
        f.dtype = dtype
        outputs.append(f(crops, flips).clone())
    assert outputs[0].shape == (13, 3, 64, 64) and outputs[0].dtype == dtype
    for other in outputs[1:]:
        assert torch.equal(outputs[0], other)
    # and the pixels are the right ones: image 3 (flipped) against a float reference of the same steps
    x = crops[3].permute(2, 0, 1).unsqueeze(0)
    f = HostFinisher(64, IMAGENET_MEAN, IMAGENET_STD, resize_shorter=resize_shorter)
    ref = f._resize(x)[0].flip(-1).float()
    ref = (ref - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(IMAGENET_STD).view(3, 1, 1)
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]  # one rounding
    assert (outputs[0][3].float() - ref).abs().max() <= tolerance


def test_a_batch_anybody_holds_is_never_rewritten():
    buffers = BatchBuffers(keep=2)
    a = buffers.take((4, 3), torch.float32)
    a.fill_(1)
    view, array = a[1:], a.numpy()
    del a
    b = buffers.take((4, 3), torch.float32)  # a view and a numpy array still hold the first block
    b.fill_(2)
    assert (view == 1).all() and (array == 1).all()
    first = view.data_ptr() - 3 * 4
    del view
    c = buffers.take((4, 3), torch.float32)
    assert c.data_ptr() != first  # the numpy array still holds it
    del array, c
    gc.collect()
    d = buffers.take((4, 3), torch.float32)
    assert d.data_ptr() == first  # released by all: reused, no new allocation
    e, f = buffers.take((4, 3), torch.float32), buffers.take((4, 3), torch.float32)
    assert len({d.data_ptr(), e.data_ptr(), f.data_ptr()}) == 3  # none lent twice, beyond `keep` too


def test_loader_batches_kept_by_the_user_stay_intact_and_released_ones_are_reused(photos):
    files = [str(p) for p in photos] * 4
    loader = ImageLoader(files, batch_size=4, shuffle=True, size=32, finish_threads=2)
    kept = [(batch.images, batch.images.clone()) for batch in loader]  # the user keeps every batch
    assert len(kept) == len(loader) > 2
    assert all(torch.equal(held, copy) for held, copy in kept)
    assert len({held.data_ptr() for held, _ in kept}) == len(kept)
    del kept
    gc.collect()
    pointers = [batch.images.data_ptr() for batch in loader]  # each batch dropped before the next
    assert len(set(pointers)) <= 2

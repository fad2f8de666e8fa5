"""Training-image augmentation (model.cnn.augment): drawn from the seed and each image's place in the
training stream, so it repeats for a seed, resumes bitwise from the loader's state, does not depend on
the batch size or the number of processes, and a state saved with another augmentation is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runyard.data.image_augment import NONE, Augment, augment_batch, uniforms
from runyard.data.image_loader import ImageLoader
from runyard.data.image_prep import prepare_images
from runyard.errors import DataError
from runyard.spec.job import parse_spec

AUG = Augment(shift=0.15, rotate=12.0, scale=0.1)


@pytest.fixture()
def prepared(tmp_path):
    rng = np.random.default_rng(3)
    np.savez(tmp_path / "d.npz", x=rng.integers(0, 256, size=(60, 9, 9), dtype=np.uint8), y=np.arange(60) % 3)
    spec = parse_spec({"task": "image_classification", "name": "a", "data": {
        "heldout_fraction": 0.2, "sources": [{"path": str(tmp_path / "d.npz"), "format": "npz"}]}})
    return prepare_images(spec.data, 0, tmp_path / "cache")


def test_augmentation_repeats_for_a_seed_and_changes_with_it(prepared):
    a = [ImageLoader(prepared, "train", 8, seed=5, augment=AUG).next_batch()[0] for _ in range(2)]
    assert torch.equal(a[0], a[1])
    plain = ImageLoader(prepared, "train", 8, seed=5).next_batch()[0]
    assert not torch.equal(a[0], plain)  # the images are warped ...
    assert a[0].min() >= 0 and a[0].max() <= 1 and a[0].shape == plain.shape  # ... within [0, 1]
    # Another seed draws other warps.
    assert not np.array_equal(uniforms(5, np.arange(8)), uniforms(6, np.arange(8)))


def test_augmentation_resumes_bitwise_and_ignores_the_world_size(prepared):
    a = ImageLoader(prepared, "train", 8, seed=5, augment=AUG)
    expected = [a.next_batch() for _ in range(9)]  # crosses an epoch boundary
    b = ImageLoader(prepared, "train", 8, seed=5, augment=AUG)
    for _ in range(4):
        b.next_batch()
    state = b.state_dict()
    assert state["augment"] == AUG.to_dict()  # recorded in every checkpoint
    c = ImageLoader(prepared, "train", 8, seed=5, augment=AUG)
    c.load_state_dict(state)
    for want in expected[4:]:
        got = c.next_batch()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # Two processes of 4 images each see exactly the warped images one process of 8 sees.
    halves = [ImageLoader(prepared, "train", 4, seed=5, rank=r, world_size=2, augment=AUG).next_batch()[0]
              for r in (0, 1)]
    assert torch.equal(torch.cat(halves), expected[0][0])


def test_a_state_saved_with_another_augmentation_is_refused(prepared):
    saved = ImageLoader(prepared, "train", 8, seed=5, augment=AUG).state_dict()
    with pytest.raises(DataError, match="augmentation.*model.cnn.augment"):
        ImageLoader(prepared, "train", 8, seed=5, augment=NONE).load_state_dict(saved)
    old = {k: v for k, v in saved.items() if k != "augment"}  # a version 1 state: no augmentation
    ImageLoader(prepared, "train", 8, seed=5).load_state_dict(old)
    with pytest.raises(DataError, match="augmentation"):
        ImageLoader(prepared, "train", 8, seed=5, augment=AUG).load_state_dict(old)


def test_a_flip_alone_mirrors_or_keeps_each_image_and_nothing_is_identity():
    x = torch.rand(16, 1, 5, 7, generator=torch.Generator().manual_seed(0))
    assert augment_batch(x, np.arange(16), 1, NONE) is x
    out = augment_batch(x, np.arange(16), 1, Augment(horizontal_flip=True))
    mirrored = [torch.allclose(o, i.flip(-1), atol=1e-6) for o, i in zip(out, x, strict=True)]
    kept = [torch.allclose(o, i, atol=1e-6) for o, i in zip(out, x, strict=True)]
    assert all(m or k for m, k in zip(mirrored, kept, strict=True)) and any(mirrored) and any(kept)

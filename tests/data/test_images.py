"""The image data stage on real files: a folder per class (PNG and JPEG through Pillow), .npz arrays, and
every bad input refused before training with an error naming the file or field; cleaning counted, the
split stratified, the prepared arrays cached under their fingerprint."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from runyard.data.image_loader import ImageLoader, image_eval_sample
from runyard.data.image_prep import prepare_images
from runyard.data.images import read_images
from runyard.errors import DataError
from runyard.spec.job import parse_spec


def spec_for(sources: list[dict], images: dict | None = None, heldout: float = 0.2):
    data = {"heldout_fraction": heldout, "sources": sources}
    if images is not None:
        data["images"] = images
    return parse_spec({"task": "image_classification", "name": "i", "data": data})


def write_folder(root, classes: dict[str, int], size=(6, 5), mode="L", fmt="PNG", seed=0):
    rng = np.random.default_rng(seed)
    for name, count in classes.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            shape = (size[1], size[0]) if mode == "L" else (size[1], size[0], 3)
            Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8)).save(
                root / name / f"{i}.{fmt.lower()}", fmt)
    return root


def test_a_folder_per_class_reads_png_and_jpeg_as_grey_or_rgb(tmp_path):
    write_folder(tmp_path / "imgs", {"cat": 5, "dog": 4}, mode="L")
    write_folder(tmp_path / "imgs", {"cat": 1}, mode="RGB", fmt="JPEG", seed=1)  # one colour JPEG among grey PNGs
    images = read_images(spec_for([{"path": str(tmp_path / "imgs"), "format": "image_folder"}]).data)
    assert images.class_names == ["cat", "dog"]
    assert images.pixels.shape == (10, 3, 5, 6)  # any colour image makes the set RGB; [N, C, H, W]
    assert images.pixels.min() >= 0 and images.pixels.max() <= 1
    assert sorted(images.labels.tolist()) == [0] * 6 + [1] * 4
    grey = read_images(spec_for([{"path": str(tmp_path / "imgs"), "format": "image_folder"}], {"channels": 1}).data)
    assert grey.pixels.shape == (10, 1, 5, 6)
    # Pixel values are the PNG's bytes / 255.
    first = np.asarray(Image.open(tmp_path / "imgs" / "cat" / "0.png"), dtype=np.float32) / 255
    row = grey.origins.index(str(tmp_path / "imgs" / "cat" / "0.png"))
    assert np.allclose(grey.pixels[row, 0], first)


def test_an_image_that_does_not_decode_names_the_file(tmp_path):
    write_folder(tmp_path / "imgs", {"a": 2, "b": 2})
    (tmp_path / "imgs" / "b" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    with pytest.raises(DataError, match=r"imgs/b/broken.png does not decode as an image"):
        read_images(spec_for([{"path": str(tmp_path / "imgs"), "format": "image_folder"}]).data)


def test_an_empty_class_folder_names_the_folder(tmp_path):
    write_folder(tmp_path / "imgs", {"a": 2, "b": 2})
    (tmp_path / "imgs" / "c").mkdir()
    with pytest.raises(DataError, match=r"class folder .*imgs/c is empty"):
        read_images(spec_for([{"path": str(tmp_path / "imgs"), "format": "image_folder"}]).data)


def test_images_of_different_sizes_need_a_resize_policy(tmp_path):
    write_folder(tmp_path / "imgs", {"a": 2, "b": 2}, size=(6, 5))
    write_folder(tmp_path / "imgs", {"b": 1}, size=(9, 9), seed=3)  # overwrites b/0.png with a 9x9 image
    with pytest.raises(DataError, match=r"imgs/b/0.png is 9x9 \(width x height\) but .* is 6x5: .*data.images.resize"):
        read_images(spec_for([{"path": str(tmp_path / "imgs"), "format": "image_folder"}]).data)
    resized = read_images(spec_for([{"path": str(tmp_path / "imgs"), "format": "image_folder"}], {"resize": [4, 4]}).data)
    assert resized.pixels.shape == (4, 1, 4, 4)


def test_npz_arrays_with_their_named_keys_and_bad_ones(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", pics=rng.integers(0, 256, size=(30, 7, 7), dtype=np.uint8),
             labels=np.array([0, 1, 2] * 10), other=np.zeros(3))
    spec = spec_for([{"path": str(tmp_path / "d.npz"), "format": "npz"}],
                    {"npz_images": "pics", "npz_labels": "labels", "class_names": ["x", "y", "z"]})
    images = read_images(spec.data)
    assert images.pixels.shape == (30, 1, 7, 7) and images.class_names == ["x", "y", "z"]
    bad = spec_for([{"path": str(tmp_path / "d.npz"), "format": "npz"}])
    with pytest.raises(DataError, match=r"d.npz: no array 'x' \(data.images.npz_images\); its arrays are \['pics', 'labels', 'other'\]"):
        read_images(bad.data)
    np.savez(tmp_path / "f.npz", x=rng.normal(size=(10, 4, 4)) * 50, y=np.arange(10) % 2)
    with pytest.raises(DataError, match=r"f.npz: pixel values of type float64 range .*; set data.images.max_value"):
        read_images(spec_for([{"path": str(tmp_path / "f.npz"), "format": "npz"}]).data)


def test_prepare_counts_duplicates_and_missing_labels_stratifies_and_caches(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, size=(120, 5, 5), dtype=np.uint8)
    y = np.array([0, 1, 2] * 40)
    x[100:110], y[100:110] = x[0:10], y[0:10]  # ten exact duplicates
    y[110:115] = -1  # five without a label
    np.savez(tmp_path / "d.npz", x=x, y=y)
    spec = spec_for([{"path": str(tmp_path / "d.npz"), "format": "npz"}])
    prepared = prepare_images(spec.data, seed=3, cache_root=tmp_path / "cache")
    assert prepared.stats["removed"] == {"missing_label": 5, "duplicate_images": 10}
    assert prepared.stats["images_used"] == 105 and sum(prepared.stats["split"]["counts"].values()) == 105
    for balance in prepared.stats["class_balance"].values():
        assert max(balance.values()) - min(balance.values()) <= 1  # 35 per class, cut the same way
    again = prepare_images(spec.data, seed=3, cache_root=tmp_path / "cache")
    assert again.directory == prepared.directory and again.fingerprint == prepared.fingerprint
    train_x, train_y = prepared.arrays("train")
    assert np.allclose(prepared.mean, [np.asarray(train_x).mean()], atol=1e-6)


def test_the_image_loader_is_deterministic_and_resumes_at_its_position(tmp_path):
    rng = np.random.default_rng(2)
    np.savez(tmp_path / "d.npz", x=rng.integers(0, 256, size=(50, 4, 4), dtype=np.uint8), y=np.arange(50) % 2)
    prepared = prepare_images(spec_for([{"path": str(tmp_path / "d.npz"), "format": "npz"}]).data, 0, tmp_path / "c")
    a = ImageLoader(prepared, "train", batch_size=8, seed=5)
    batches = [a.next_batch() for _ in range(9)]  # crosses an epoch boundary
    b = ImageLoader(prepared, "train", batch_size=8, seed=5)
    for _ in range(4):
        b.next_batch()
    c = ImageLoader(prepared, "train", batch_size=8, seed=5)
    c.load_state_dict(b.state_dict())
    for expected in batches[4:]:
        got = c.next_batch()
        assert torch_equal(got[0], expected[0]) and torch_equal(got[1], expected[1])
    # Two ranks of world size 2 read disjoint halves of the same global batch.
    r0 = ImageLoader(prepared, "train", batch_size=4, seed=5, rank=0, world_size=2).image_ids(0)
    r1 = ImageLoader(prepared, "train", batch_size=4, seed=5, rank=1, world_size=2).image_ids(0)
    assert not set(r0) & set(r1) and sorted([*r0, *r1]) == sorted(a.image_ids(0))
    sample = image_eval_sample(prepared, "validation", 3, 100, seed=1)
    assert sample.sequences == sample.split_sequences == sum(len(y) for _, y in sample.batches)


def torch_equal(a, b) -> bool:
    return bool((a == b).all())

"""The data stage of `image_classification`: read (data/images.py), clean, split, store.

Cleaning removes images without a label and exact duplicates (same pixels and label), each counted. The
split is stratified by class (data/row_split.py). The three splits are stored as .npy arrays in a
content-addressed directory of the data cache, `<cache>/images/<fingerprint>/`, written under a temporary
name and renamed into place, so a second run (or another process of the same run) reads them at once and
a killed preparation never leaves a half-written dataset that reads as good.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runyard.data.images import ImageSet, read_images
from runyard.data.row_split import SPLIT_NAMES, TEST, TRAIN, VALID, Split, check_split, stratified_split
from runyard.errors import DataError
from runyard.spec.data import DataSpec
from runyard.spec.data_predictive import ImagesSpec
from runyard.system.files import atomic_write_json, fsync_dir, make_temp_dir

PIPELINE_VERSION = 1
PREPARED_FILE = "prepared.json"
SPLIT_FILES = {TRAIN: "train", VALID: "validation", TEST: "test"}


@dataclass(frozen=True)
class PreparedImages:
    """A prepared image dataset: where its split arrays are and what they hold."""

    directory: Path
    shape: tuple[int, int, int]  # channels, height, width
    class_names: list[str]
    mean: list[float]  # per channel, over the training split
    std: list[float]
    fingerprint: str
    input_fingerprints: dict[str, str]
    stats: dict[str, Any] = field(default_factory=dict)

    def arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(pixels [N, C, H, W] float32, memory-mapped; labels [N] int64) of `split` (train/validation/test)."""
        x = np.load(self.directory / f"{split}_x.npy", mmap_mode="r", allow_pickle=False)
        y = np.load(self.directory / f"{split}_y.npy", allow_pickle=False)
        return x, y

    @property
    def n_classes(self) -> int:
        return len(self.class_names)


def _fingerprint(data: DataSpec, seed: int, inputs: dict[str, str]) -> str:
    settings = {"sources": [s.model_dump(mode="json") for s in data.sources],
                "images": (data.images or ImagesSpec()).model_dump(mode="json"),
                "heldout_fraction": data.heldout_fraction}
    blob = json.dumps({"v": PIPELINE_VERSION, "seed": seed, "settings": settings, "inputs": inputs}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _load(directory: Path) -> PreparedImages:
    meta = json.loads((directory / PREPARED_FILE).read_text())
    return PreparedImages(directory, tuple(meta["shape"]), meta["class_names"], meta["mean"], meta["std"],
                          meta["fingerprint"], meta["input_fingerprints"], meta["stats"])


def _clean(pixels: np.ndarray, labels: np.ndarray, cfg: ImagesSpec, counts: dict[str, int]) -> np.ndarray:
    keep = labels >= 0
    counts["missing_label"] = int((~keep).sum())
    if cfg.drop_duplicates:
        seen: set[bytes] = set()
        duplicate = np.zeros(len(labels), dtype=bool)
        for i in np.flatnonzero(keep):
            key = hashlib.blake2b(pixels[i].tobytes() + int(labels[i]).to_bytes(8, "little"), digest_size=16).digest()
            duplicate[i] = key in seen
            seen.add(key)
        counts["duplicate_images"] = int(duplicate.sum())
        keep &= ~duplicate
    return keep


@dataclass(frozen=True)
class CheckedImages:
    """Images cleaned and split, nothing written: what preparation stores, and what `runyard plan` and the
    run's pre-flight check (runyard.plan.datacheck) before any work."""

    pixels: np.ndarray  # the images kept
    labels: np.ndarray
    split: Split
    removed: dict[str, int]


def check_images(images: ImageSet, data: DataSpec, seed: int) -> CheckedImages:
    """Clean (missing labels, duplicates) and split `images`; DataError for fewer than two classes left or
    a split that leaves a part empty."""
    cfg = data.images or ImagesSpec()
    counts: dict[str, int] = {}
    keep = _clean(images.pixels, images.labels, cfg, counts)
    pixels, labels = images.pixels[keep], images.labels[keep]
    present = np.unique(labels)
    if len(present) < 2:
        raise DataError(f"the images hold {len(present)} class{'es' if len(present) != 1 else ''} after cleaning "
                        f"({[images.class_names[i] for i in present]}): a classifier needs at least two")
    split = stratified_split(labels, seed, data.heldout_fraction, cfg.validation_fraction)
    check_split(split, f"the images ({len(labels)} after cleaning)")
    return CheckedImages(pixels, labels, split, counts)


def prepare_images(data: DataSpec, seed: int, cache_root: Path, write: bool = True) -> PreparedImages:
    """Read, clean, split and store the spec's images (see the module's docstring); a dataset already in
    the cache under the same fingerprint is returned as it is. `write=False` (another process of the run)
    only reads the cache."""
    images = read_images(data)
    fingerprint = _fingerprint(data, seed, images.input_fingerprints)
    directory = Path(cache_root) / "images" / fingerprint
    if (directory / PREPARED_FILE).is_file():
        return _load(directory)
    if not write:
        raise DataError(f"prepared images {directory} are missing: the first process should have written them")
    checked = check_images(images, data, seed)
    pixels, labels, split, counts = checked.pixels, checked.labels, checked.split, checked.removed
    train = pixels[split.assignment == TRAIN]
    mean = train.mean(axis=(0, 2, 3)).astype(np.float64)
    std = np.maximum(train.std(axis=(0, 2, 3)).astype(np.float64), 1e-6)
    balance = {SPLIT_NAMES[w]: {name: int((labels[split.assignment == w] == i).sum())
                                for i, name in enumerate(images.class_names)} for w in (TRAIN, VALID, TEST)}
    stats = {
        "images_read": len(images.labels),
        "images_used": int(len(labels)),
        "removed": counts,
        "shape": list(pixels.shape[1:]),
        "class_names": images.class_names,
        "class_balance": balance,
        "split": {"method": split.method, "counts": split.counts(), "seed": seed},
        "pixel_mean": mean.tolist(),
        "pixel_std": std.tolist(),
        "inputs": images.input_fingerprints,
    }
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(directory.parent, f".{fingerprint[:16]}.tmp-")
    try:
        for which, name in SPLIT_FILES.items():
            rows = split.assignment == which
            np.save(tmp / f"{name}_x.npy", np.ascontiguousarray(pixels[rows]), allow_pickle=False)
            np.save(tmp / f"{name}_y.npy", labels[rows], allow_pickle=False)
        for f in tmp.iterdir():
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
        atomic_write_json(tmp / PREPARED_FILE, {
            "shape": list(pixels.shape[1:]), "class_names": images.class_names, "mean": mean.tolist(),
            "std": std.tolist(), "fingerprint": fingerprint, "input_fingerprints": images.input_fingerprints,
            "stats": stats,
        })
        try:
            os.replace(tmp, directory)
        except OSError:
            if not (directory / PREPARED_FILE).is_file():  # another process won the race with the same result
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        fsync_dir(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _load(directory)

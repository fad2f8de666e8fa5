"""Reading images for `image_classification`: a folder per class (PNG/JPEG, decoded by Pillow), `.npz`
arrays, or scikit-learn's bundled digits, into one float32 array [N, C, H, W] in [0, 1] with labels.

An `image_folder` source is a folder with one subfolder of images per class, or a glob of image files
(`imgs/*/*.png`) whose class is each file's folder name; `class_folders` lists either, and `runyard plan`
lists the files through it too.

Every problem is a DataError naming the file or field, before training: an image that does not decode,
an empty class folder, images of different sizes without `data.images.resize`, an .npz without the named
arrays, pixel values outside the range `max_value` says.
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, UnidentifiedImageError

from runyard.data.sklearn_sets import load_bundled
from runyard.data.sources import InputFile, expand_path_template, local_identity
from runyard.errors import DataError
from runyard.spec.data import DataSpec, SourceSpec
from runyard.spec.data_predictive import ImagesSpec

GREY_MODES = {"1", "L", "LA", "I", "I;16", "F"}


@dataclass
class ImageSet:
    pixels: np.ndarray  # float32 [N, C, H, W] in [0, 1]
    labels: np.ndarray  # int64 [N]; -1 is a missing target
    class_names: list[str]
    origins: list[str]  # per image: its file (and index for arrays)
    input_fingerprints: dict[str, str] = field(default_factory=dict)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def class_folders(root: str, index: int) -> list[tuple[str, list[str]]]:
    """(class name, its image files) of an image_folder source, classes sorted by name: the subfolders of
    a folder, or the files a glob matches grouped by their folder's name. DataError naming the path for
    a folder that is not there or has no classes, a glob that matches nothing, and an empty class folder."""
    if glob.has_magic(root):
        by_class: dict[str, list[str]] = {}
        for path in sorted(glob.glob(root, recursive=True)):
            if os.path.isfile(path) and not os.path.basename(path).startswith("."):
                by_class.setdefault(os.path.basename(os.path.dirname(os.path.abspath(path))), []).append(path)
        if not by_class:
            raise DataError(f"data.sources[{index}].path {root!r}: the glob matches no image files (an image_folder "
                            "source is a folder with one subfolder of images per class, or a glob of image files "
                            "whose folder names are their classes)")
        return sorted(by_class.items())
    if not os.path.isdir(root):
        raise DataError(f"data.sources[{index}].path {root!r}: not a folder (an image_folder source is a folder "
                        "with one subfolder of images per class)")
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith("."))
    if not classes:
        raise DataError(f"data.sources[{index}].path {root!r}: no class subfolders in it")
    out = []
    for name in classes:
        folder = os.path.join(root, name)
        files = sorted(os.path.join(folder, f) for f in os.listdir(folder)
                       if not f.startswith(".") and os.path.isfile(os.path.join(folder, f)))
        if not files:
            raise DataError(f"class folder {folder} is empty: every class needs at least one image (remove the folder "
                            "or add images)")
        out.append((name, files))
    return out


def image_folder_files(source: SourceSpec, index: int) -> list[InputFile]:
    """Every image file of an image_folder source (class_folders' files), as the source lister lists a
    glob's: sorted by path, with their sizes and identities."""
    out = []
    for _name, files in class_folders(expand_path_template(source.path), index):
        for path in files:
            st = os.stat(path)
            out.append(InputFile(index, os.path.abspath(path), st.st_size, local_identity(st)))
    return sorted(out, key=lambda f: f.path)


def _decode(path: str) -> Image.Image:
    try:
        with Image.open(path) as img:
            img.load()
            return img.copy()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"{path} does not decode as an image (PNG or JPEG): {exc}") from None


def _read_folder(root: str, index: int, cfg: ImagesSpec, fingerprints: dict[str, str]):
    decoded, names, labels, origins = [], [], [], []
    for label, (name, files) in enumerate(class_folders(root, index)):
        names.append(name)
        for path in files:
            decoded.append(_decode(path))
            labels.append(label)
            origins.append(path)
            where = path if glob.has_magic(root) else os.path.relpath(path, root)  # a glob's matches as matched
            fingerprints[f"sources[{index}] {where}"] = _sha256(path)
    channels = cfg.channels or (1 if all(img.mode in GREY_MODES for img in decoded) else 3)
    mode = "L" if channels == 1 else "RGB"
    arrays = []
    first = None
    for img, path in zip(decoded, origins, strict=True):
        img = img.convert(mode)
        if cfg.resize is not None:
            img = img.resize((cfg.resize[1], cfg.resize[0]), Image.Resampling.BILINEAR)
        elif first is None:
            first = (img.size, path)
        elif img.size != first[0]:
            raise DataError(f"{path} is {img.size[0]}x{img.size[1]} (width x height) but {first[1]} is "
                            f"{first[0][0]}x{first[0][1]}: images of different sizes need data.images.resize "
                            "[height, width]")
        array = np.asarray(img, dtype=np.float32)
        arrays.append(array[None] if array.ndim == 2 else array.transpose(2, 0, 1))
    scale = cfg.max_value or 255.0
    return np.stack(arrays) / np.float32(scale), np.asarray(labels, dtype=np.int64), names, origins


def _to_nchw(x: np.ndarray, path: str, field_name: str) -> np.ndarray:
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4 and x.shape[-1] in (1, 3):
        return x.transpose(0, 3, 1, 2)
    raise DataError(f"{path}: array {field_name!r} has shape {x.shape}; expected [N, H, W] or [N, H, W, C] with C 1 or 3")


def _scale(x: np.ndarray, cfg: ImagesSpec, default: float | None, what: str) -> np.ndarray:
    if cfg.max_value is not None:
        scale = cfg.max_value
    elif default is not None:
        scale = default
    elif x.dtype == np.uint8:
        scale = 255.0
    elif np.issubdtype(x.dtype, np.floating) and (x.size == 0 or (x.min() >= 0 and x.max() <= 1)):
        scale = 1.0
    else:
        raise DataError(f"{what}: pixel values of type {x.dtype} range {x.min()}..{x.max()}; set data.images.max_value "
                        "(the value that means full intensity)")
    out = x.astype(np.float32) / np.float32(scale)
    if out.size and (out.min() < 0 or out.max() > 1):
        raise DataError(f"{what}: pixel values divided by {scale} range {out.min():.3g}..{out.max():.3g}, outside [0, 1]; "
                        "set data.images.max_value")
    return out


def _resize_array(x: np.ndarray, size: list[int]) -> np.ndarray:
    if tuple(x.shape[2:]) == tuple(size):
        return x
    out = np.empty((x.shape[0], x.shape[1], size[0], size[1]), dtype=np.float32)
    for i in range(x.shape[0]):
        for c in range(x.shape[1]):
            img = Image.fromarray(np.ascontiguousarray(x[i, c], dtype=np.float32))  # mode F
            out[i, c] = np.asarray(img.resize((size[1], size[0]), Image.Resampling.BILINEAR))
    return np.clip(out, 0.0, 1.0)


def _read_arrays(source: SourceSpec, index: int, cfg: ImagesSpec, fingerprints: dict[str, str]):
    if source.format == "sklearn":
        bundled = load_bundled(source.path)
        if bundled.images is None:
            raise DataError(f"data.sources[{index}]: sklearn:{source.path} has no images")
        x = _scale(_to_nchw(bundled.images, f"sklearn:{source.path}", "images"), cfg, 16.0, f"sklearn:{source.path}")
        names = sorted({str(t) for t in bundled.target}, key=float)
        labels = np.asarray([names.index(str(t)) for t in bundled.target], dtype=np.int64)
        fingerprints[f"sources[{index}] sklearn:{source.path}"] = f"scikit-learn {bundled.version}"
        return x, labels, names, [f"sklearn:{source.path}[{i}]" for i in range(len(x))]
    path = expand_path_template(source.path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            keys = list(npz.keys())
            for key, field_name in ((cfg.npz_images, "npz_images"), (cfg.npz_labels, "npz_labels")):
                if key not in keys:
                    raise DataError(f"{path}: no array {key!r} (data.images.{field_name}); its arrays are {keys}")
            raw, y = npz[cfg.npz_images], npz[cfg.npz_labels]
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read it as .npz: {exc}") from None
    x = _scale(_to_nchw(raw, path, cfg.npz_images), cfg, None, path)
    if y.ndim != 1 or len(y) != len(x) or not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{path}: {cfg.npz_labels!r} must be one integer label per image ({len(x)}), got {y.dtype} {y.shape}")
    top = int(y.max()) if len(y) else -1
    names = list(cfg.class_names) if cfg.class_names else [str(i) for i in range(top + 1)]
    if top >= len(names):
        raise DataError(f"{path}: label {top} has no name in data.images.class_names ({len(names)} names)")
    fingerprints[f"sources[{index}] {path}"] = _sha256(path)
    return x, y.astype(np.int64), names, [f"{path}[{i}]" for i in range(len(x))]


def read_images(data: DataSpec) -> ImageSet:
    """Every source's images, converted to the spec's channels and size, labels mapped by class name."""
    cfg = data.images or ImagesSpec()
    fingerprints: dict[str, str] = {}
    parts = []
    for i, source in enumerate(data.sources):
        if source.format == "image_folder":
            parts.append(_read_folder(expand_path_template(source.path), i, cfg, fingerprints))
        else:
            parts.append(_read_arrays(source, i, cfg, fingerprints))
    names = sorted({n for _, _, part_names, _ in parts for n in part_names})
    if all(n.isdigit() for n in names):
        names = sorted(names, key=int)
    xs, ys, origins = [], [], []
    for x, y, part_names, part_origins in parts:
        if cfg.resize is not None:
            x = _resize_array(x, cfg.resize)
        channels = cfg.channels or x.shape[1]
        if x.shape[1] != channels:  # arrays whose channels differ from the spec's: grey <-> RGB
            x = x.mean(axis=1, keepdims=True) if channels == 1 else np.repeat(x, 3, axis=1)
        mapping = np.asarray([names.index(n) for n in part_names], dtype=np.int64)
        ys.append(np.where(y >= 0, mapping[np.clip(y, 0, None)] if len(mapping) else y, -1))
        xs.append(x.astype(np.float32))
        origins += part_origins
    shapes = {x.shape[1:] for x in xs}
    if len(shapes) > 1:
        raise DataError(f"data.sources: images of different shapes across sources {sorted(shapes)}; set data.images.resize "
                        "and data.images.channels")
    return ImageSet(np.concatenate(xs), np.concatenate(ys), names, origins, fingerprints)

"""Parsing and checking a predict request's inputs against the export's schema.

Tables: `{"rows": [{feature: value, ...}, ...]}`, each row validated and encoded by the feature schema
(data/table_schema.py): a missing or mistyped feature, or an unknown one, is a problem naming the row and
the feature. Images: `{"images": [...]}` as nested lists of pixel values in [0, 1] ([H, W] for one
channel, or [C, H, W]), or `{"images_base64": [...]}` as PNG or JPEG bytes, converted to the model's
channels and, when the training data was resized, to its size. Problems come back as a list (all of them,
not the first), which the server answers with 422.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from runyard.errors import RunyardError

MAX_ITEMS = 10_000  # rows or images in one request


class InputProblems(RunyardError):
    """The request's inputs do not fit the schema; `problems` name each one."""

    def __init__(self, message: str, problems: list[dict[str, Any]], param: str | None = None):
        super().__init__(message)
        self.message, self.problems, self.param = message, problems, param


def _items(body: Any, key: str) -> list[Any]:
    if not isinstance(body, dict):
        raise InputProblems("the request body must be a JSON object", [], None)
    items = body.get(key)
    if not isinstance(items, list) or not items:
        raise InputProblems(f"'{key}' must be a non-empty list", [], key)
    if len(items) > MAX_ITEMS:
        raise InputProblems(f"at most {MAX_ITEMS} items per request, got {len(items)}", [], key)
    return items


def table_rows(body: Any) -> list[Any]:
    if isinstance(body, dict) and set(body) - {"rows", "model"}:
        unknown = sorted(set(body) - {"rows", "model"})
        raise InputProblems(f"unknown fields {unknown}; a table model takes 'rows'", [], unknown[0])
    return _items(body, "rows")


def _decode_image(text: Any, index: int, mode: str, shape: list[int], resize: list[int] | None) -> np.ndarray:
    where = f"images_base64[{index}]"
    if not isinstance(text, str):
        raise ValueError(f"{where}: expected base64 text")
    try:
        raw = base64.b64decode(text, validate=True)
        with Image.open(io.BytesIO(raw)) as img:
            img = img.convert(mode)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{where}: not base64 ({exc})") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"{where}: does not decode as an image ({exc})") from None
    height, width = shape[1], shape[2]
    if img.size != (width, height):
        if resize is None:
            raise ValueError(f"{where}: {img.size[0]}x{img.size[1]} (width x height); the model takes {width}x{height} "
                             "and was trained without resizing")
        img = img.resize((width, height), Image.Resampling.BILINEAR)
    array = np.asarray(img, dtype=np.float32) / np.float32(255.0)
    return array[None] if array.ndim == 2 else array.transpose(2, 0, 1)


def _pixel_array(value: Any, index: int, shape: list[int]) -> np.ndarray:
    where = f"images[{index}]"
    try:
        array = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected nested lists of numbers") from None
    if array.ndim == 2 and shape[0] == 1:
        array = array[None]
    if list(array.shape) != list(shape):
        raise ValueError(f"{where}: shape {list(array.shape)}; the model takes {shape} (channels, height, width)"
                         + (" or [height, width]" if shape[0] == 1 else ""))
    if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
        raise ValueError(f"{where}: pixel values must be finite and in [0, 1] (the data stage's scale)")
    return array


def image_batch(body: Any, schema: dict[str, Any]) -> np.ndarray:
    """The request's images as [n, C, H, W] float32 in [0, 1]; InputProblems listing every bad image."""
    if not isinstance(body, dict):
        raise InputProblems("the request body must be a JSON object", [], None)
    keys = [k for k in ("images", "images_base64") if k in body]
    unknown = sorted(set(body) - {"images", "images_base64", "model"})
    if unknown or len(keys) != 1:
        raise InputProblems("an image model takes exactly one of 'images' (pixel arrays) or 'images_base64' "
                            f"(PNG/JPEG){f'; unknown fields {unknown}' if unknown else ''}", [], unknown[0] if unknown else None)
    items = _items(body, keys[0])
    shape = schema["shape"]
    mode = "L" if shape[0] == 1 else "RGB"
    arrays, problems = [], []
    for i, item in enumerate(items):
        try:
            if keys[0] == "images":
                arrays.append(_pixel_array(item, i, shape))
            else:
                arrays.append(_decode_image(item, i, mode, shape, schema.get("resize")))
        except ValueError as exc:
            problems.append({"item": i, "problem": str(exc)})
    if problems:
        raise InputProblems(f"{len(problems)} of {len(items)} images do not fit the model: {problems[0]['problem']}",
                            problems, keys[0])
    return np.stack(arrays)

"""Weights of a Hugging Face model directory: one `model.safetensors`, or shards listed by
`model.safetensors.index.json`. Read through the safetensors library, written the way transformers'
`save_pretrained` writes them.

Every file's header is read and checked before any tensor is (`read_headers`): its length against the
file's size, the JSON it holds, and each tensor's byte range against the data the file holds, so a
truncated or damaged file is named before any work (`runyard plan`, the start of `runyard run`), from a
few kilobytes per file.

Loading streams: the model is built first, then each tensor is read and copied straight into its
place, one at a time, so at most one tensor exists twice. Each tensor is read through its own
`safe_open`, because a file kept open stays mapped, and every page read from it would count in the
process's memory until the end (a whole second copy of the model, measured in
tests/model/test_hf_memory.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from runyard.model.hf.errors import ModelDirectoryError
from runyard.model.hf.names import IGNORED_SUFFIXES

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3  # shards of at most 2 GiB: the memory one shard costs to write
LOADABLE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# Bytes per element of safetensors' dtypes, to check each tensor's byte range against its shape.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit


class TensorInfo:
    """Where one tensor lives, and what its header says about it (nothing of its data is read)."""

    __slots__ = ("dtype", "file", "shape")

    def __init__(self, file: Path, shape: tuple[int, ...], dtype: str):
        self.file, self.shape, self.dtype = file, shape, dtype


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of `directory`: model.safetensors, or the shards its index lists.
    ModelDirectoryError when neither is there, or the index names a file outside the directory."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        return sorted(set(_index_map(index).values()))
    if (directory / WEIGHTS_FILE).is_file():
        return [directory / WEIGHTS_FILE]
    pickled = sorted(p for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")) \
        if directory.is_dir() else []
    if pickled:
        raise ModelDirectoryError(pickled[0], f"holds the weights as a pickle, which runyard does not load (it "
                                  f"runs no code from a model file), and {directory} has no {WEIGHTS_FILE} nor "
                                  f"{INDEX_FILE}: convert it to safetensors, e.g. with transformers: "
                                  "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir)")
    raise ModelDirectoryError(directory, f"has neither {WEIGHTS_FILE} nor {INDEX_FILE}")


def _index_map(index: Path) -> dict[str, Path]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelDirectoryError(index, f"is not readable JSON: {exc}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelDirectoryError(index, "has no weight_map naming each tensor's file", "weight_map")
    out = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise ModelDirectoryError(index, f"maps {name!r} to {file!r}, not a file of this directory",
                                      "weight_map")
        path = index.parent / file
        if not path.is_file():
            raise ModelDirectoryError(path, f"is missing (the index lists it for {name!r})")
        out[name] = path
    return out


def read_headers(directory: Path) -> dict[str, TensorInfo]:
    """Every tensor of the directory's weights: its file, shape and dtype, from the headers alone (each
    checked as `read_header` says). With an index, every tensor must sit in the file the index names."""
    directory = Path(directory)
    expected = _index_map(directory / INDEX_FILE) if (directory / INDEX_FILE).is_file() else None
    out: dict[str, TensorInfo] = {}
    for path in weight_files(directory):
        for name, info in read_header(path).items():
            if name in out:
                raise ModelDirectoryError(path, f"holds tensor {name!r} again (also in {out[name].file.name})")
            out[name] = info
    if expected is not None:
        for name, path in expected.items():
            if name not in out or out[name].file != path:
                raise ModelDirectoryError(directory / INDEX_FILE, f"lists {name!r} in {path.name}, which does not "
                                          "hold it", "weight_map")
    return {name: info for name, info in out.items() if not name.endswith(IGNORED_SUFFIXES)}


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors one safetensors file holds, from its header (an 8-byte length, then that many bytes of
    JSON), checked against the file's size: ModelDirectoryError naming the file when the header is longer
    than the file, is not the JSON safetensors writes, or a tensor's bytes lie beyond the end of the file
    (a truncated download or copy) or do not match its shape."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else None
            raw = f.read(length) if length is not None and length <= min(size - 8, MAX_HEADER_BYTES) else b""
    except OSError as exc:
        raise ModelDirectoryError(path, f"cannot be read: {exc}") from None
    if length is None:
        raise ModelDirectoryError(path, f"is truncated: {size} bytes, too short for a safetensors header")
    if length > MAX_HEADER_BYTES:
        raise ModelDirectoryError(path, f"is not a readable safetensors file: its first 8 bytes give a header "
                                  f"length of {length:,} bytes, more than the format allows")
    if length > size - 8:
        raise ModelDirectoryError(path, f"is truncated: its header says it is {length:,} bytes long, and the "
                                  f"file holds {size - 8:,} bytes after the length")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelDirectoryError(path, f"is not a readable safetensors file: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ModelDirectoryError(path, "is not a readable safetensors file: its header is not a JSON object")
    data_bytes = size - 8 - length
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            valid = (isinstance(dtype, str) and all(isinstance(n, int) and n >= 0 for n in (*shape, start, end))
                     and start <= end)
        except (TypeError, KeyError, ValueError):
            valid = False
        if not valid:
            raise ModelDirectoryError(path, f"is not a readable safetensors file: its header describes tensor {name!r} as {entry!r}")
        if end > data_bytes:
            raise ModelDirectoryError(path, f"is truncated: tensor {name!r} ends at byte {end:,} of the data, and "
                                      f"the file holds {data_bytes:,} bytes of data")
        if dtype in DTYPE_BYTES and end - start != DTYPE_BYTES[dtype] * math.prod(shape):
            raise ModelDirectoryError(path, f"is not a readable safetensors file: its header gives tensor {name!r} "
                                      f"of shape {list(shape)} ({dtype}) {end - start:,} bytes")
        out[name] = TensorInfo(path, shape, dtype)
    return out


def read_tensor(info: TensorInfo, name: str) -> torch.Tensor:
    """One tensor, read through its own safe_open (see the module docstring)."""
    try:
        with safe_open(str(info.file), framework="pt") as f:
            return f.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise ModelDirectoryError(info.file, f"tensor {name!r} cannot be read: {exc}") from None


def check_tensor(info: TensorInfo, name: str, shape: tuple[int, ...]) -> None:
    if info.dtype not in LOADABLE_DTYPES:
        raise ModelDirectoryError(info.file, f"tensor {name!r} is {info.dtype}; runyard loads "
                                  f"{sorted(LOADABLE_DTYPES)} weights")
    if info.shape != shape:
        raise ModelDirectoryError(info.file, f"tensor {name!r} has shape {info.shape}, config.json implies {shape}")


def save_shards(
    tensors: Iterable[tuple[str, torch.Tensor]], directory: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> list[str]:
    """Write (name, tensor) pairs as model.safetensors, or, past `max_shard_bytes`, as
    model-0000i-of-0000n.safetensors shards with model.safetensors.index.json. Tensors are copied to
    the CPU one shard at a time. Returns the file names written."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = total = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += nbytes
        total += nbytes
    if len(shards) == 1:
        names = [WEIGHTS_FILE]
    else:
        width = max(5, len(str(len(shards))))
        names = [f"model-{i + 1:0{width}d}-of-{len(shards):0{width}d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards, strict=True):
        save_file({n: t.detach().to("cpu").contiguous() for n, t in shard}, str(Path(directory) / file),
                  metadata={"format": "pt"})
        weight_map.update({n: file for n, _ in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (Path(directory) / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        names.append(INDEX_FILE)
    return names

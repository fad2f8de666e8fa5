"""Tensor files in the safetensors layout, written straight from the tensors' memory.

`write_tensors` writes what `safetensors.torch.load_file` reads: an 8-byte header length, a JSON header
(dtype, shape and byte range of each tensor, plus string metadata), then the tensors' bytes back to
back. The safetensors library's own `save_file` first builds the whole file as one bytes object (a copy
of every tensor); here each tensor's memory goes to the file as it is, checksummed on the way
(checksums.HashingFile), so a save costs one pass over the data plus the write itself.

`write_state` / `read_state` store a whole nested state dict (an optimizer's, an RNG's) this way: its
tensors in the data section, its structure (tree.py) as JSON in the metadata. Reading never unpickles.

Reading parses the header here and `readinto`s each tensor's bytes straight into its final tensor (one
the caller already holds, such as a live parameter, or a fresh one): no mmap, no intermediate copy. The
file's checksum is taken over the same slices while they are still in the CPU cache, so verifying
against the manifest costs no second read.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from runyard.errors import CheckpointCorrupt
from runyard.train.checkpoint import tree
from runyard.train.checkpoint.checksums import HASHERS, BackgroundHasher, FileEntry, HashingFile

SUFFIX = ".safetensors"
STRUCTURE_KEY = "runyard.structure"
FORMAT_KEY = "format"
FORMAT = "pt"  # what safetensors' torch helpers write, so transformers and others read these files

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_FROM_CODE = {code: dtype for dtype, code in _DTYPES.items()}
_MAX_HEADER = 100 << 20  # the safetensors library's own limit
_READ_SLICE = 1 << 20  # read and hash in slices that stay in the CPU cache between the two
_BACKGROUND_HASH = 16 << 20  # files from this size on are hashed on a second thread while they are read


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is already contiguous."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> FileEntry:
    """Write `tensors` to `path` in the safetensors layout, fsync it, and return its manifest entry.
    Tensors on an accelerator are copied to CPU one at a time."""
    header: dict[str, Any] = {"__metadata__": {FORMAT_KEY: FORMAT, **(metadata or {})}}
    # Widest elements first: with the header padded to 8 bytes, every tensor starts aligned.
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise tree.UnstorableState(f"tensor {name}: dtype {t.dtype} has no safetensors code")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with HashingFile(path) as out:
        out.write(struct.pack("<Q", len(head)))
        out.write(head)
        for name in order:
            t = tensors[name]
            out.write(tensor_bytes(t if t.device.type == "cpu" else t.to("cpu")))
        return out.close()


def read_tensors(path: Path, device: str | torch.device = "cpu", into: dict[str, torch.Tensor] | None = None,
                 expected: FileEntry | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; a malformed one is CheckpointCorrupt.

    A tensor of `into` with the stored name, dtype and shape (contiguous, on the CPU) receives the bytes
    in place and is returned itself; others are read into fresh tensors. With `expected` (the file's
    manifest entry) the file is checksummed while read and a mismatch is CheckpointCorrupt, raised after
    the bytes have landed: whoever passes `into` must treat its tensors as lost on that error."""
    into = into or {}
    algorithm = next((a for a in HASHERS if a in expected), None) if expected is not None else None
    if expected is not None and algorithm is None:
        raise CheckpointCorrupt(f"{path}: its manifest entry has no known checksum")
    hasher = HASHERS[algorithm]() if algorithm else None
    if hasher is not None and expected["bytes"] >= _BACKGROUND_HASH:
        # Hashed on a thread of its own, a slice or two behind the reads (still in the CPU cache): with a
        # second core free, verifying costs the longer of the read and the hash, not their sum.
        hasher = BackgroundHasher(hasher)
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if expected is not None and size != expected["bytes"]:
                raise CheckpointCorrupt(f"{path} has {size} bytes, its manifest says {expected['bytes']}")
            prefix = _read_exactly(f, 8, path, hasher)
            (head_len,) = struct.unpack("<Q", prefix)
            if head_len > min(_MAX_HEADER, size - 8):
                raise CheckpointCorrupt(f"{path}: header length {head_len} does not fit a {size}-byte file")
            header = _parse_header(bytes(_read_exactly(f, head_len, path, hasher)), path)
            metadata = header.pop("__metadata__", None) or {}
            position = 0  # within the data section: the tensors must tile it exactly, as safetensors requires
            tensors: dict[str, torch.Tensor] = {}
            for name, (dtype, shape, start, end) in sorted(header.items(), key=lambda kv: kv[1][2]):
                if start != position:
                    raise CheckpointCorrupt(f"{path}: tensor {name} starts at byte {start}, expected {position}")
                dest = into.get(name)
                if not (isinstance(dest, torch.Tensor) and dest.dtype == dtype and tuple(dest.shape) == shape
                        and dest.device.type == "cpu" and dest.is_contiguous()):
                    dest = torch.empty(shape, dtype=dtype)
                dest = dest.detach()
                if dest.numel() * dest.element_size() != end - start:
                    raise CheckpointCorrupt(f"{path}: tensor {name} holds {end - start} bytes, its shape and dtype "
                                            f"need {dest.numel() * dest.element_size()}")
                if end > start:
                    _read_exactly(f, end - start, path, hasher, memoryview(dest.reshape(-1).view(torch.uint8).numpy()))
                tensors[name] = dest
                position = end
            if 8 + head_len + position != size:
                raise CheckpointCorrupt(f"{path}: {size - 8 - head_len - position} bytes after the last tensor")
        if hasher is not None and hasher.hexdigest() != expected[algorithm]:
            raise CheckpointCorrupt(f"{path} fails its {algorithm} checksum")
    except OSError as exc:
        raise CheckpointCorrupt(f"{path} is not a readable safetensors file: {exc}") from None
    finally:
        if isinstance(hasher, BackgroundHasher):
            hasher.close()
    if torch.device(device).type != "cpu":
        tensors = {k: v.to(device) for k, v in tensors.items()}
    return tensors, metadata


def _read_exactly(f, nbytes: int, path: Path, hasher, view: memoryview | None = None) -> memoryview:
    """Fill `view` (or a new buffer) with the next `nbytes` of `f`, hashing each slice as it arrives."""
    view = view if view is not None else memoryview(bytearray(nbytes))
    for start in range(0, nbytes, _READ_SLICE):
        piece = view[start : start + _READ_SLICE]
        got = 0
        while got < len(piece):
            n = f.readinto(piece[got:])
            if not n:
                raise CheckpointCorrupt(f"{path} ends early: {start + got} of {nbytes} bytes of a section read")
            got += n
        if hasher is not None:
            hasher.update(piece)
    return view


def _parse_header(raw: bytes, path: Path) -> dict[str, Any]:
    """The header as {name: (dtype, shape, start, end)} plus `__metadata__` (strings)."""
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        out: dict[str, Any] = {}
        for name, info in header.items():
            if name == "__metadata__":
                if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                    raise ValueError("__metadata__ is not a mapping of strings")
                out[name] = info
                continue
            dtype = _FROM_CODE.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name}: unknown dtype {info['dtype']!r}")
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(o) for o in info["data_offsets"])
            if min(shape, default=0) < 0 or not 0 <= start <= end:
                raise ValueError(f"tensor {name}: shape {shape} or offsets {[start, end]} are invalid")
            out[name] = (dtype, shape, start, end)
        return out
    except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointCorrupt(f"{path} is not a readable safetensors file: {exc}") from None


def write_state(path: Path, state: Any) -> FileEntry:
    """Write a nested state dict (tensors and plain data) to one safetensors file."""
    tensors, skeleton = tree.flatten(state)
    return write_tensors(path, tensors, {STRUCTURE_KEY: json.dumps(skeleton)})


def read_state(path: Path, device: str | torch.device = "cpu", into: Any = None,
               expected: FileEntry | None = None) -> Any:
    """The nested state dict `write_state` wrote. A plain safetensors file (no structure recorded)
    reads as its flat dict of tensors. `into`: a state dict of the same structure whose tensors receive
    the stored ones in place where they match (read_tensors); `expected`: the manifest entry to verify."""
    tensors, metadata = read_tensors(path, device, tree.flatten(into)[0] if into is not None else None, expected)
    if STRUCTURE_KEY not in metadata:
        return tensors
    try:
        skeleton = json.loads(metadata[STRUCTURE_KEY])
    except json.JSONDecodeError as exc:
        raise CheckpointCorrupt(f"{path}: its recorded structure is not JSON ({exc})") from None
    return tree.unflatten(skeleton, tensors, where=str(path))

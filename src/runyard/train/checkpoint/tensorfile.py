"""Tensor files in the safetensors layout, written straight from the tensors' memory.

`write_tensors` writes what `safetensors.torch.load_file` reads: an 8-byte header length, a JSON header
(dtype, shape and byte range of each tensor, plus string metadata), then the tensors' bytes back to
back. The safetensors library's own `save_file` first builds the whole file as one bytes object (a copy
of every tensor); here each tensor's memory goes to the file as it is, checksummed on the way
(checksums.HashingFile), so a save costs one pass over the data plus the write itself.

`write_state` / `read_state` store a whole nested state dict (an optimizer's, an RNG's) this way: its
tensors in the data section, its structure (tree.py) as JSON in the metadata. Reading never unpickles.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from runyard.errors import CheckpointCorrupt
from runyard.train.checkpoint import tree
from runyard.train.checkpoint.checksums import FileEntry, HashingFile

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


def read_tensors(path: Path, device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; a malformed one is CheckpointCorrupt."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        return load_file(str(path), device=str(device)), metadata
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointCorrupt(f"{path} is not a readable safetensors file: {exc}") from None


def write_state(path: Path, state: Any) -> FileEntry:
    """Write a nested state dict (tensors and plain data) to one safetensors file."""
    tensors, skeleton = tree.flatten(state)
    return write_tensors(path, tensors, {STRUCTURE_KEY: json.dumps(skeleton)})


def read_state(path: Path, device: str | torch.device = "cpu") -> Any:
    """The nested state dict `write_state` wrote. A plain safetensors file (no structure recorded)
    reads as its flat dict of tensors."""
    tensors, metadata = read_tensors(path, device)
    if STRUCTURE_KEY not in metadata:
        return tensors
    try:
        skeleton = json.loads(metadata[STRUCTURE_KEY])
    except json.JSONDecodeError as exc:
        raise CheckpointCorrupt(f"{path}: its recorded structure is not JSON ({exc})") from None
    return tree.unflatten(skeleton, tensors, where=str(path))

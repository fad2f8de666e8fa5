"""Tensor files in the safetensors layout, written straight from the tensors' memory.

`write_tensors` writes what `safetensors.torch.load_file` reads: an 8-byte header length, a JSON header
(dtype, shape and byte range of each tensor, plus string metadata), then the tensors' bytes back to
back. The safetensors library's own `save_file` first builds the whole file as one bytes object (a copy
of every tensor); here each tensor's memory goes to the file as it is, checksummed on the way
(checksums.HashingFile), so a save costs one pass over the data plus the write itself.

`write_state` / `read_state` store a whole nested state dict (an optimizer's, an RNG's) this way: its
tensors in the data section, its structure (tree.py) as JSON in the metadata. Reading never unpickles.

Reading parses the header here and reads each tensor's bytes straight into its final tensor (one the
caller already holds, such as a live parameter, or a fresh one): no mmap, no intermediate copy. The
reads run on a pool of threads, piece by piece of the checksum, each slice hashed while it is still in
the CPU cache (parallel_read.py), so verifying against the manifest costs no second read.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from runyard.errors import CheckpointCorrupt
from runyard.train.checkpoint import parallel_read, tree
from runyard.train.checkpoint.checksums import FileEntry, HashingFile, algorithm_of

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


class TensorRead:
    """A tensor file being read (`start_read`): its tensors, already placed, fill on the pool's threads."""

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str], pending: parallel_read.PendingRead):
        self._tensors, self.metadata, self._pending = tensors, metadata, pending

    def tensors(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Wait for every byte; CheckpointCorrupt if the file ends early or fails its checksum."""
        try:
            self._pending.result()
        except OSError as exc:
            raise CheckpointCorrupt(f"{self._pending.path} is not a readable safetensors file: {exc}") from None
        if torch.device(device).type != "cpu":
            return {k: v.to(device) for k, v in self._tensors.items()}
        return self._tensors

    def state(self, device: str | torch.device = "cpu") -> Any:
        """The nested state dict `write_state` wrote (a plain safetensors file: its flat dict of tensors)."""
        tensors = self.tensors(device)
        if STRUCTURE_KEY not in self.metadata:
            return tensors
        try:
            skeleton = json.loads(self.metadata[STRUCTURE_KEY])
        except json.JSONDecodeError as exc:
            raise CheckpointCorrupt(f"{self._pending.path}: its recorded structure is not JSON ({exc})") from None
        return tree.unflatten(skeleton, tensors, where=str(self._pending.path))

    def close(self) -> None:
        """Wait for the reads in flight and close the file, without checking it (the way out on an error)."""
        self._pending.close()


def start_read(path: Path, pool: ThreadPoolExecutor, into: dict[str, torch.Tensor] | None = None,
               expected: FileEntry | None = None) -> TensorRead:
    """Parse a safetensors file's header, place its tensors, and start reading their bytes on `pool`.

    A tensor of `into` with the stored name, dtype and shape (contiguous, on the CPU) receives the bytes
    in place and is returned itself; others are read into fresh tensors. With `expected` (the file's
    manifest entry) the file is checksummed while read and a mismatch is CheckpointCorrupt, raised after
    the bytes have landed: whoever passes `into` must treat its tensors as lost on that error. A malformed
    header is CheckpointCorrupt here; a short file or a checksum that differs, from the read's `tensors()`."""
    into = into or {}
    algorithm = algorithm_of(expected, str(path)) if expected is not None else None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise CheckpointCorrupt(f"{path} is not a readable safetensors file: {exc}") from None
    try:
        size = os.fstat(fd).st_size
        if expected is not None and size != expected["bytes"]:
            raise CheckpointCorrupt(f"{path} has {size} bytes, its manifest says {expected['bytes']}")
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise CheckpointCorrupt(f"{path} ends early: {len(prefix)} bytes, not even a header length")
        (head_len,) = struct.unpack("<Q", prefix)
        if head_len > min(_MAX_HEADER, size - 8):
            raise CheckpointCorrupt(f"{path}: header length {head_len} does not fit a {size}-byte file")
        head = os.pread(fd, head_len, 8)
        if len(head) < head_len:
            raise CheckpointCorrupt(f"{path} ends early: {len(head)} of its {head_len} header bytes")
        header = _parse_header(head, path)
        metadata = header.pop("__metadata__", None) or {}
        data_start = 8 + head_len
        spans = [parallel_read.Span(0, memoryview(prefix + head), read=False)]
        position = 0  # within the data section: the tensors must tile it exactly, as safetensors requires
        tensors: dict[str, torch.Tensor] = {}
        for name, (dtype, shape, begin, end) in sorted(header.items(), key=lambda kv: kv[1][2]):
            if begin != position:
                raise CheckpointCorrupt(f"{path}: tensor {name} starts at byte {begin}, expected {position}")
            dest = into.get(name)
            if not (isinstance(dest, torch.Tensor) and dest.dtype == dtype and tuple(dest.shape) == shape
                    and dest.device.type == "cpu" and dest.is_contiguous()):
                dest = torch.empty(shape, dtype=dtype)
            dest = dest.detach()
            if dest.numel() * dest.element_size() != end - begin:
                raise CheckpointCorrupt(f"{path}: tensor {name} holds {end - begin} bytes, its shape and dtype "
                                        f"need {dest.numel() * dest.element_size()}")
            if end > begin:
                spans.append(parallel_read.Span(data_start + begin, tensor_bytes(dest)))
            tensors[name] = dest
            position = end
        if data_start + position > size:
            raise CheckpointCorrupt(f"{path} ends early: its tensors end at byte {data_start + position}, "
                                    f"the file at {size}")
        if data_start + position < size:
            raise CheckpointCorrupt(f"{path}: {size - data_start - position} bytes after the last tensor")
        pending = parallel_read.start(fd, path, spans, pool, algorithm,
                                      expected[algorithm] if algorithm is not None else None)
    except OSError as exc:
        os.close(fd)
        raise CheckpointCorrupt(f"{path} is not a readable safetensors file: {exc}") from None
    except BaseException:
        os.close(fd)
        raise
    return TensorRead(tensors, metadata, pending)


def read_tensors(path: Path, device: str | torch.device = "cpu", into: dict[str, torch.Tensor] | None = None,
                 expected: FileEntry | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, read on a pool of threads (start_read says how);
    a malformed or (with `expected`) corrupt one is CheckpointCorrupt."""
    with parallel_read.reading_pool() as pool:
        reading = start_read(path, pool, into, expected)
        try:
            tensors = reading.tensors(device)
        finally:
            reading.close()
    return tensors, reading.metadata


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
    the stored ones in place where they match (start_read); `expected`: the manifest entry to verify."""
    with parallel_read.reading_pool() as pool:
        reading = start_read(path, pool, tree.flatten(into)[0] if into is not None else None, expected)
        try:
            return reading.state(device)
        finally:
            reading.close()

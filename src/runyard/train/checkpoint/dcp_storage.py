"""A storage layer for torch.distributed.checkpoint that writes tensors' memory as it is.

DCP's stock `FileSystemWriter` serialises every tensor chunk with `torch.save` (a zip archive with a
pickle and a CRC pass per chunk) and runyard then read every file back to checksum it. This writer keeps
DCP's planning, resharding and `.metadata` unchanged and changes only the bytes: a tensor chunk is its
raw memory (the safetensors convention: C order, little-endian), written once and checksummed on the
way (checksums.HashingFile), each file fsynced once. A non-tensor value (an optimizer group's learning
rate, betas...) is written as JSON (tree.py's tagged skeleton, so tuples stay tuples) instead of DCP's
`torch.save` archive, a zip file to open for each value, and an optimizer has a dozen per parameter;
a value JSON cannot hold keeps DCP's encoding.

Raw chunks and JSON values are marked in the metadata with the transform descriptors `raw@runyard/1` and
`json@runyard/1`, so DCP's stock reader refuses them ("Unknown extension") instead of misreading them;
`RawFileSystemReader` reads both and stock ones (checkpoints written before this layer).

Each rank's writer attaches its files' checksums to its write results; DCP gathers those to the
coordinator, whose `finish` collects them (`files`) and writes plain results into `.metadata`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed.checkpoint as dcp  # noqa: F401  (sharded.py saves and loads through this module)
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _split_by_size_and_type, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401  (for sharded.py)
from torch.distributed.checkpoint.state_dict import (  # noqa: F401  (get_ and set_state_dict: for sharded.py)
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from runyard.errors import CheckpointCorrupt
from runyard.train.checkpoint import dcp_metadata, tree
from runyard.train.checkpoint.checksums import FileEntry, HashingFile
from runyard.train.checkpoint.parallel_read import pread_exactly
from runyard.train.checkpoint.tensorfile import tensor_bytes

RAW = "raw@runyard/1"
JSON = "json@runyard/1"
_GAP = 64 << 10  # JSON values this close together are read in one call
# The optimizer's state and hyperparameters keyed by parameter name ("optim.param_groups.<name>.lr"), as
# torchtitan saves them: a rank holding part of the model (a pipeline stage) writes its parameters' groups
# itself, so any layout restores them.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner unpickles non-tensor values with weights_only=False; ours refuses code objects."""

    def load_bytes(self, read_item, value) -> None:
        self.load_object(read_item, torch.load(value, weights_only=True))

    def load_object(self, read_item, obj) -> None:
        """Place a non-tensor value already decoded (a JSON one)."""
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


@dataclasses.dataclass
class _WrittenChunk(_StorageInfo):
    """Where a chunk went, plus (on one chunk per file) the file's manifest entry, which travels to
    the coordinator with the write results."""

    file_entry: FileEntry | None = None


class TensorSource(Protocol):
    """Where the writer gets each tensor it writes (deferred_copies.DeferredCopies): `take` gives the
    tensor to write in place of the state dict's, `done` says it is written."""

    def take(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def done(self, tensor: torch.Tensor) -> None: ...


def _write_file(path: Path, items: list[WriteItem], planner: SavePlanner,
                source: TensorSource | None = None) -> list[WriteResult]:
    results = []
    with HashingFile(path) as out:
        # DCP's order: non-tensor values first, then tensors.
        for item in sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO):
            offset = out.tell()
            encoded = _as_json(planner, item) if item.type == WriteItemType.BYTE_IO else None
            if encoded is not None:
                out.write(encoded)
                descriptors = [JSON]
            elif item.type == WriteItemType.BYTE_IO:
                out.write(planner.resolve_data(item).getbuffer())
                descriptors = None
            else:
                data = planner.resolve_data(item)
                tensor = (data if source is None else source.take(data)).detach()
                try:
                    out.write(tensor_bytes(tensor if tensor.device.type == "cpu" else tensor.to("cpu")))
                finally:
                    if source is not None:
                        source.done(data)
                descriptors = [RAW]
            info = _WrittenChunk(path.name, offset, out.tell() - offset, descriptors)
            results.append(WriteResult(index=item.index, size_in_bytes=info.length, storage_data=info))
        file_entry = out.close()
    if results:
        results[0].storage_data.file_entry = file_entry
    return results


def _as_json(planner: SavePlanner, item: WriteItem) -> bytes | None:
    """A non-tensor value as JSON, or None when JSON cannot hold it (it then keeps DCP's encoding)."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        return None
    try:
        tensors, skeleton = tree.flatten(lookup(item.index))
    except tree.UnstorableState:
        return None
    return None if tensors else json.dumps(skeleton, allow_nan=True).encode()


class RawFileSystemWriter(FileSystemWriter):
    """DCP's file system writer with raw tensor chunks; `files` holds, on the coordinator after the
    save, the manifest entry (checksum, size) of every rank's data file, keyed by file name."""

    def __init__(self, path: str | Path, thread_count: int = 1, before_write: Callable[[], None] | None = None,
                 source: TensorSource | None = None):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=thread_count,
                         overwrite=True)
        self.files: dict[str, FileEntry] = {}
        self._before_write = before_write  # this rank's other files of the checkpoint (in the background)
        self._source = source

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._before_write is not None:
            self._before_write()
        prefix = plan.storage_data.prefix
        buckets = _split_by_size_and_type(self.thread_count, plan.items)
        paths = [Path(self.path) / f"{prefix}{i}{DEFAULT_SUFFIX}" for i in range(len(buckets))]
        if len(buckets) == 1:
            results = _write_file(paths[0], buckets[0], planner, self._source)
        else:
            with ThreadPoolExecutor(len(buckets), thread_name_prefix="runyard-ckpt-write") as pool:
                results = [r for rs in pool.map(_write_file, paths, buckets, [planner] * len(buckets),
                                                [self._source] * len(buckets)) for r in rs]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        plain = []
        for rank_results in results:
            for r in rank_results:
                info = r.storage_data
                if getattr(info, "file_entry", None) is not None:
                    self.files[info.relative_path] = info.file_entry
                stored = _StorageInfo(info.relative_path, info.offset, info.length, info.transform_descriptors)
                plain.append(WriteResult(index=r.index, size_in_bytes=r.size_in_bytes, storage_data=stored))
        super().finish(metadata, [plain])


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset != 0 or length != t.shape[dim]:
            t = t.narrow(dim, offset, length)
    return t


class RawFileSystemReader(FileSystemReader):
    """Reads what `RawFileSystemWriter` writes (and DCP's stock files): a raw chunk is read straight
    into its destination when it covers it whole, else into a buffer and narrowed. `.metadata` is read
    once, without running what its pickle may name (dcp_metadata.py)."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        self._metadata: dict[int | None, Metadata] = {}

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        if rank not in self._metadata:
            metadata = dcp_metadata.read_metadata(Path(self._get_metadata_path(rank)))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._metadata[rank] = metadata
        return self._metadata[rank]

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        raw: dict[str, list[ReadItem]] = {}
        stock = []
        for item in plan.items:
            descriptors = self.storage_data[item.storage_index].transform_descriptors or ()
            if (item.type == LoadItemType.TENSOR and RAW in descriptors) or JSON in descriptors:
                raw.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            else:
                stock.append(item)
        if stock:
            super().read_data(dataclasses.replace(plan, items=stock), planner).wait()
        for rel, items in raw.items():
            with open(Path(self.path) / rel, "rb", buffering=0) as f:
                values = [i for i in items if i.type != LoadItemType.TENSOR]
                for item, encoded in zip(values, self._read_together(f, values, rel), strict=True):
                    self._place_json(encoded, item, planner, rel)
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    if item.type == LoadItemType.TENSOR:
                        self._read_raw(f, item, planner, rel)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _chunk(self, index: MetadataIndex):
        chunks = self._tensors[index.fqn].chunks
        if index.index is not None and index.index < len(chunks) and chunks[index.index].offsets == index.offset:
            return chunks[index.index]
        return next(c for c in chunks if c.offsets == index.offset)

    def _read_together(self, f, items: list[ReadItem], rel: str) -> list[memoryview]:
        """The bytes of each of `items` (a file's JSON values: hundreds of small ones, written one after
        another at its start), one read per run of values with at most `_GAP` bytes between them."""
        infos = [self.storage_data[i.storage_index] for i in items]
        runs: list[list[int]] = []
        for k in sorted(range(len(items)), key=lambda k: infos[k].offset):
            last = infos[runs[-1][-1]] if runs else None
            if last is None or infos[k].offset - (last.offset + last.length) > _GAP:
                runs.append([k])
            else:
                runs[-1].append(k)
        encoded: list[memoryview] = [memoryview(b"")] * len(items)
        for run in runs:
            start = infos[run[0]].offset
            span = memoryview(bytearray(max(infos[k].offset + infos[k].length for k in run) - start))
            pread_exactly(f.fileno(), span, start, f"{rel}: {len(run)} values from byte {start}")
            for k in run:
                encoded[k] = span[infos[k].offset - start : infos[k].offset - start + infos[k].length]
        return encoded

    def _place_json(self, encoded: memoryview, item: ReadItem, planner: LoadPlanner, rel: str) -> None:
        where = f"{rel}: {item.storage_index.fqn}"
        try:
            value = tree.unflatten(json.loads(bytes(encoded)), {}, where=where)
        except (ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise CheckpointCorrupt(f"{where} is not the JSON value it is marked as ({exc})") from None
        if not isinstance(planner, SafeLoadPlanner):
            raise CheckpointCorrupt(f"{where}: a JSON value needs runyard's load planner, not {type(planner).__name__}")
        planner.load_object(item, value)

    def _read_raw(self, f, item: ReadItem, planner: LoadPlanner, rel: str) -> None:
        info = self.storage_data[item.storage_index]
        dtype = self._tensors[item.storage_index.fqn].properties.dtype
        sizes = self._chunk(item.storage_index).sizes
        where = f"{rel}: {item.storage_index.fqn}"
        expected = sizes.numel() * dtype.itemsize
        if info.length != expected:
            raise CheckpointCorrupt(f"{where} holds {info.length} bytes, its shape needs {expected}")
        target = planner.resolve_tensor(item).detach()
        whole = tuple(item.lengths) == tuple(sizes)
        if whole and target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous() \
                and tuple(target.shape) == tuple(sizes):
            pread_exactly(f.fileno(), tensor_bytes(target), info.offset, where)
        else:
            chunk = torch.empty(sizes, dtype=dtype)
            pread_exactly(f.fileno(), tensor_bytes(chunk), info.offset, where)
            target.copy_(_narrow(chunk, item.storage_offsets, item.lengths))
        planner.commit_tensor(item, target)

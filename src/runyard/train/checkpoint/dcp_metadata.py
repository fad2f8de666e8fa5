"""DCP's `.metadata` file read without running what a pickle may name.

torch.distributed.checkpoint stores a checkpoint's metadata (tensor shapes, chunks, where each lies) as a
pickle and reads it back with `pickle.load`, which calls whatever a crafted file names: a checkpoint
handed over by someone else (a provider's machine, a shared directory) could run code on load. This
reader's unpickler builds only what DCP's metadata holds: its dataclasses, torch sizes, dtypes and
layouts, and paths; any other name is CheckpointCorrupt.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata

from runyard.errors import CheckpointCorrupt

_ALLOWED = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a layout by its name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
    ("pathlib", "PosixPath"): Path,  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"): Path,
    ("collections", "OrderedDict"): dict,
}
_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == "torch" and name in _DTYPES:
            return getattr(torch, name)
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)  # Metadata, TensorStorageMetadata, ChunkStorageMetadata...
        raise CheckpointCorrupt(f"{self.where} names {module}.{name}, which DCP's metadata never holds; "
                                "it was not unpickled")


def read_metadata(path: Path) -> Metadata:
    """The Metadata in the file at `path` (a checkpoint's `dcp/.metadata`)."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, str(path)).load()
    except (CheckpointCorrupt, FileNotFoundError):
        raise
    except Exception as exc:  # a truncated or garbled pickle raises any of several errors
        raise CheckpointCorrupt(f"{path} is not DCP metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointCorrupt(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata

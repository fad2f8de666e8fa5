"""The one-process checkpoint format: one safetensors-layout file per stateful part, and state.json.

    step_00000123/
      model.safetensors       the model's state dict (an ordinary safetensors file: tied weights once)
      optimizer.safetensors   the optimizer's state dict (tensors, with its structure in the metadata)
      rng.safetensors         this process's RNG states
      state.json              step, loader position and the loop's own values
      MANIFEST.json           checksum and size of every other file, written last

Every file is checksummed while it is written and fsynced once (tensorfile.py); store.commit writes the
manifest and renames the directory into place. Reading verifies the manifest first and never unpickles:
checkpoints of format 1 (torch.save files, `*.pt`) are still read, with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from runyard.errors import CheckpointCorrupt
from runyard.system.diskspace import nbytes_of, writing
from runyard.train.checkpoint import parallel_read, store, tensorfile, tree
from runyard.train.checkpoint.checksums import FileEntry

LEGACY_SUFFIX = ".pt"


def write_checkpoint(root: Path, step: int, parts: dict[str, Any], state: dict[str, Any]) -> Path:
    """Write a checkpoint for `step` atomically under `root` and return its final path.

    `parts` maps file stems to state dicts (tensors and plain data, nested as an optimizer's are);
    `state` holds plain values for state.json. A failure leaves nothing under the final name."""
    tmp = store.staging_dir(root, step)
    try:
        written: dict[str, FileEntry] = {}
        with writing(f"checkpoint {store.step_dir_name(step)}", root, needed=nbytes_of(parts)):
            for stem, part in parts.items():
                name = f"{stem}{tensorfile.SUFFIX}"
                written[name] = tensorfile.write_state(tmp / name, part)
            written[store.STATE] = store.write_state_json(tmp, step, state)
        return store.commit(tmp, root / store.step_dir_name(step), step, written)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_parts(path: Path, manifest: dict[str, Any], map_location: str | torch.device = "cpu",
               into: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state dicts of a one-process checkpoint's top-level files, by stem, each file checked against
    its manifest entry while it is read. `into` maps stems to live state dicts whose tensors receive the
    stored ones in place (tensorfile.start_read). Every file's pieces are read on one pool of threads."""
    into = into or {}
    files: dict[str, str] = {}
    for rel in sorted(manifest["files"]):
        if "/" in rel or not rel.endswith((tensorfile.SUFFIX, LEGACY_SUFFIX)):
            continue
        stem = rel.rsplit(".", 1)[0]
        if stem in files:
            raise CheckpointCorrupt(f"checkpoint {path}: two files hold {stem!r}")
        files[stem] = rel

    parts: dict[str, Any] = {}
    reads: dict[str, tensorfile.TensorRead] = {}
    with parallel_read.reading_pool() as pool:
        try:
            for stem, rel in files.items():
                if rel.endswith(LEGACY_SUFFIX):
                    parts[stem] = torch.load(path / rel, map_location=map_location, weights_only=True)
                else:
                    flat_into = tree.flatten(into[stem])[0] if stem in into else None
                    reads[stem] = tensorfile.start_read(path / rel, pool, flat_into, manifest["files"][rel])
            for stem, reading in reads.items():
                parts[stem] = reading.state(map_location)
        finally:
            for reading in reads.values():
                reading.close()
    return parts


def legacy_rng(parts: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """The RNG state of a format-1 checkpoint, whose torch states were in rng.pt and the others in
    state.json, in the form `ProcessRNG.load_state_dict` takes."""
    rng = dict(parts["rng"])
    if "python" not in rng:
        rng.update(state["rng"])
    return rng

"""DCP's `.metadata` pickle is read without running what it names (train/checkpoint/dcp_metadata.py)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from runyard.errors import CheckpointCorrupt
from runyard.train.checkpoint import dcp_storage
from runyard.train.checkpoint.dcp_metadata import read_metadata


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # creates the marker file when unpickled


def written(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "lr": 0.1}
    dcp.save(state, storage_writer=dcp_storage.RawFileSystemWriter(tmp_path), no_dist=True)
    return tmp_path / ".metadata"


def test_a_checkpoints_metadata_reads_back_with_its_shapes_and_dtypes(tmp_path):
    metadata = read_metadata(written(tmp_path))
    w = metadata.state_dict_metadata["w"]
    assert tuple(w.size) == (2, 3) and w.properties.dtype == torch.float32
    reader = dcp_storage.RawFileSystemReader(tmp_path)
    assert reader.read_metadata() is reader.read_metadata(), "read once per reader"
    out = {"w": torch.zeros(2, 3), "lr": 0.0}
    dcp.load(out, storage_reader=reader, planner=dcp_storage.SafeLoadPlanner(), no_dist=True)
    assert torch.equal(out["w"], torch.arange(6.0).reshape(2, 3)) and out["lr"] == 0.1


def test_metadata_naming_anything_else_is_refused_before_it_runs(tmp_path):
    path = written(tmp_path)
    marker = tmp_path / "ran"
    path.write_bytes(pickle.dumps({"metadata": _RunsCode(marker)}))
    with pytest.raises(CheckpointCorrupt, match=r"names io\.open, which DCP's metadata never holds"):
        read_metadata(path)
    with pytest.raises(CheckpointCorrupt, match="never holds"):  # the reader sharded.py loads through
        dcp_storage.RawFileSystemReader(tmp_path).read_metadata()
    assert not marker.exists()


def test_truncated_or_foreign_metadata_is_corrupt(tmp_path):
    path = written(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointCorrupt, match=r"\.metadata is not DCP metadata"):
        read_metadata(path)
    path.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointCorrupt, match="holds a dict, not DCP metadata"):
        read_metadata(path)

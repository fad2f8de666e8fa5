"""The fast paths of checkpoint I/O keep every guarantee: a large file is hashed on a second thread while
it is read and still refused when one byte differs; old sha256 entries verify through the same path; data
parallel ranks each stage only the copies they write."""

from __future__ import annotations

import pytest
import torch

from runyard.errors import CheckpointCorrupt
from runyard.train.checkpoint import sharded, tensorfile
from runyard.train.checkpoint.checksums import BackgroundHasher, file_checksum
from runyard.train.parallel import DistContext

BIG = tensorfile._BACKGROUND_HASH // 4 + 1000  # float32 elements: a file past the background-hash size


def big_file(tmp_path):
    path = tmp_path / "big.safetensors"
    tensors = {"a": torch.randn(BIG), "b": torch.arange(10, dtype=torch.int64)}
    entry = tensorfile.write_tensors(path, tensors)
    return path, tensors, entry


def test_a_large_file_is_checked_while_read_on_a_second_thread(tmp_path):
    path, tensors, entry = big_file(tmp_path)
    assert entry["bytes"] >= tensorfile._BACKGROUND_HASH
    into = {"a": torch.zeros(BIG)}
    got, _ = tensorfile.read_tensors(path, into=into, expected=entry)
    assert got["a"].data_ptr() == into["a"].data_ptr() and torch.equal(got["a"], tensors["a"]) and torch.equal(got["b"], tensors["b"])

    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # in the middle of the large tensor: the size and header stay valid
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="fails its xxh3_128 checksum"):
        tensorfile.read_tensors(path, into={"a": torch.zeros(BIG)}, expected=entry)


def test_a_large_file_with_a_sha256_entry_is_checked_too(tmp_path):
    path, tensors, entry = big_file(tmp_path)
    old = {"sha256": file_checksum(path, "sha256"), "bytes": entry["bytes"]}  # a format-1 era manifest entry
    got, _ = tensorfile.read_tensors(path, expected=old)
    assert torch.equal(got["a"], tensors["a"])
    with pytest.raises(CheckpointCorrupt, match="fails its sha256 checksum"):
        tensorfile.read_tensors(path, expected={**old, "sha256": "0" * 64})


def test_a_truncated_large_file_is_refused(tmp_path):
    path, _, entry = big_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-4096])
    with pytest.raises(CheckpointCorrupt, match="bytes, its manifest says"):
        tensorfile.read_tensors(path, expected=entry)
    with pytest.raises(CheckpointCorrupt, match="ends early"):
        tensorfile.read_tensors(path, expected={**entry, "bytes": len(data) - 4096})


def test_the_background_hasher_hashes_in_order_and_reports_errors():
    import xxhash

    pieces = [bytes([i]) * (1000 + i) for i in range(50)]
    hasher = BackgroundHasher(xxhash.xxh3_128())
    for p in pieces:
        hasher.update(p)
    assert hasher.hexdigest() == xxhash.xxh3_128(b"".join(pieces)).hexdigest()

    broken = BackgroundHasher(xxhash.xxh3_128())
    broken.update(object())
    with pytest.raises(TypeError):
        broken.hexdigest()
    closed = BackgroundHasher(xxhash.xxh3_128())
    closed.close()
    closed.close()  # twice is harmless (read_tensors closes it on every way out)


def test_data_parallel_ranks_split_the_plain_tensors_they_all_hold(monkeypatch):
    """Each rank keeps the copies it writes (largest first, to the least loaded holder); a tensor one rank
    alone holds (a pipeline stage's) stays with it; non-tensor values stay everywhere (DCP dedups them)."""
    sd = {
        0: {"model": {"big": torch.zeros(100), "mid": torch.zeros(60), "small": torch.zeros(30), "only0": torch.zeros(5)},
            "optim": {"param_groups.big.lr": 0.1}},
        1: {"model": {"big": torch.zeros(100), "mid": torch.zeros(60), "small": torch.zeros(30), "only1": torch.zeros(500)},
            "optim": {"param_groups.big.lr": 0.1}},
    }

    def gather(out, obj, group=None):
        for rank in (0, 1):
            out[rank] = sorted({(p, k): t.numel() * t.element_size() for p, d in sd[rank].items() for k, t in d.items()
                                if isinstance(t, torch.Tensor)}.items())

    monkeypatch.setattr(sharded.dist, "all_gather_object", gather)
    kept = {rank: sharded._own_copies(sd[rank], DistContext(rank=rank, world_size=2, local_rank=rank,
                                                            device=torch.device("cpu")))
            for rank in (0, 1)}
    # only1 (2000 bytes) goes to rank 1 first; then big, mid and small to rank 0, the less loaded.
    assert set(kept[0]["model"]) == {"big", "mid", "small", "only0"}
    assert set(kept[1]["model"]) == {"only1"}
    assert kept[0]["optim"] == kept[1]["optim"] == {"param_groups.big.lr": 0.1}
    names = [set(kept[r]["model"]) for r in (0, 1)]
    assert names[0].isdisjoint(names[1]) and names[0] | names[1] == {"big", "mid", "small", "only0", "only1"}


def test_an_async_save_stages_plain_tensors_into_buffers_it_reuses():
    stager = sharded._PlainCopies()
    w, groups = torch.randn(4, 3), {"lr": [0.1]}
    state = {"model": {"w": w, "t": torch.arange(5)}, "optim": {"param_groups.w": groups}}
    assert stager.handles(state)
    first, before = stager.stage(state), w.clone()
    w.add_(1.0)  # training goes on once staged
    groups["lr"][0] = 0.2
    assert torch.equal(first["model"]["w"], before) and first["optim"]["param_groups.w"] == {"lr": [0.1]}
    ptr = first["model"]["w"].data_ptr()
    second = stager.stage(state)
    assert second["model"]["w"].data_ptr() == ptr, "the buffer of the first save is reused"
    assert torch.equal(second["model"]["w"], w)
    state["model"]["w"] = torch.randn(2, 2)  # another shape: a buffer of its own
    assert tuple(stager.stage(state)["model"]["w"].shape) == (2, 2)
    assert not stager.handles({"model": {"w": torch.empty(2, device="meta")}}), "device tensors: DCP's stager"

"""The fast paths of checkpoint I/O keep every guarantee: a file is read piece by piece on several threads,
each piece hashed as it lands, and still refused when one byte differs or the file ends early; whole-file
xxh3-128 and sha256 entries (formats 2 and 1) verify through the same path; data parallel ranks each stage
only the copies they write (train/checkpoint/deferred_copies.py has its own tests)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
import xxhash

from runyard.errors import CheckpointCorrupt
from runyard.train.checkpoint import checksums, sharded, store, tensorfile
from runyard.train.checkpoint.checksums import CHECKSUM
from runyard.train.checkpoint.parallel_read import Span, file_checksum, reading_pool, start
from runyard.train.parallel import DistContext

PIECE = 4096  # the tree checksum's piece, made small so a small file spans many pieces


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setitem(checksums.PIECEWISE, CHECKSUM, PIECE)


def tree_checksum(data: bytes) -> str:
    """The tree checksum computed from its definition (checksums.py's docstring)."""
    return xxhash.xxh3_128(b"".join(xxhash.xxh3_128(data[i : i + PIECE]).digest()
                                    for i in range(0, len(data), PIECE))).hexdigest()


def many_piece_file(tmp_path, n=10_000):
    """Tensors whose bytes cross piece boundaries at odd places, in a file of ~10 pieces."""
    path = tmp_path / "big.safetensors"
    tensors = {"a": torch.randn(n), "b": torch.arange(10, dtype=torch.int64), "c": torch.randn(777).to(torch.bfloat16)}
    entry = tensorfile.write_tensors(path, tensors)
    return path, tensors, entry


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_tree_checksum_is_the_same_written_read_back_and_from_its_definition(tmp_path):
    path, _, entry = many_piece_file(tmp_path)
    data = path.read_bytes()
    assert len(data) > 8 * PIECE and entry["bytes"] == len(data)
    assert entry[CHECKSUM] == tree_checksum(data)
    with reading_pool() as pool:
        assert file_checksum(path, CHECKSUM, pool) == entry[CHECKSUM]
    assert file_checksum(path, CHECKSUM) == entry[CHECKSUM]  # without a pool: the pieces in turn
    exact = tmp_path / "exact"
    exact.write_bytes(data[: 3 * PIECE])  # a whole number of pieces: no empty last piece
    hasher = checksums.TreeHasher()
    hasher.update(data[:100])
    hasher.update(data[100 : 3 * PIECE])
    assert hasher.hexdigest() == file_checksum(exact, CHECKSUM) == tree_checksum(data[: 3 * PIECE])


def test_a_file_read_piece_by_piece_lands_in_place_and_a_flipped_byte_is_refused(tmp_path):
    path, tensors, entry = many_piece_file(tmp_path)
    into = {"a": torch.zeros(10_000)}
    got, _ = tensorfile.read_tensors(path, into=into, expected=entry)
    assert got["a"].data_ptr() == into["a"].data_ptr()
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)

    data = bytearray(path.read_bytes())
    for where in (len(data) // 2, len(data) - 1):  # in a middle piece, in the last one
        flipped = bytearray(data)
        flipped[where] ^= 0x10  # the size and the header stay valid
        path.write_bytes(bytes(flipped))
        fds = open_fds()
        with pytest.raises(CheckpointCorrupt, match=f"fails its {CHECKSUM} checksum"):
            tensorfile.read_tensors(path, into={"a": torch.zeros(10_000)}, expected=entry)
        assert open_fds() == fds, "the file is closed on the way out"


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_a_whole_file_checksum_of_an_older_format_is_checked_too(tmp_path, algorithm):
    path, tensors, entry = many_piece_file(tmp_path)
    digest = getattr(xxhash, algorithm, None) or getattr(hashlib, algorithm)
    old = {algorithm: digest(path.read_bytes()).hexdigest(), "bytes": entry["bytes"]}
    got, _ = tensorfile.read_tensors(path, expected=old)
    assert torch.equal(got["a"], tensors["a"])
    assert file_checksum(path, algorithm) == old[algorithm]
    with pytest.raises(CheckpointCorrupt, match=f"fails its {algorithm} checksum"):
        tensorfile.read_tensors(path, expected={**old, algorithm: "0" * len(old[algorithm])})


def test_a_truncated_file_is_refused_and_closed(tmp_path):
    path, _, entry = many_piece_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-4096])
    fds = open_fds()
    with pytest.raises(CheckpointCorrupt, match="bytes, its manifest says"):
        tensorfile.read_tensors(path, expected=entry)
    with pytest.raises(CheckpointCorrupt, match="ends early: its tensors end at byte"):
        tensorfile.read_tensors(path, expected={**entry, "bytes": len(data) - 4096})
    # A file that shrinks while it is read: the spans ask for more bytes than are there.
    spans = [Span(0, memoryview(bytearray(len(data))))]
    with reading_pool() as pool:
        pending = start(os.open(path, os.O_RDONLY), path, spans, pool)
        with pytest.raises(CheckpointCorrupt, match="ends early: no bytes at offset"):
            pending.result()
    assert open_fds() == fds


def test_a_manifest_entry_without_a_known_checksum_is_refused(tmp_path):
    path, _, entry = many_piece_file(tmp_path)
    with pytest.raises(CheckpointCorrupt, match="no known checksum"):
        tensorfile.read_tensors(path, expected={"md5": "0", "bytes": entry["bytes"]})


def test_verification_hashes_the_pieces_and_names_the_file(tmp_path):
    step = tmp_path / "step_00000001"
    step.mkdir()
    path, _, entry = many_piece_file(step)
    (step / store.MANIFEST).write_text(json.dumps({"format": 3, "step": 1, "files": {"big.safetensors": entry}}))
    store.verify_checkpoint(step)
    data = bytearray(path.read_bytes())
    data[5 * PIECE + 3] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=f"big.safetensors fails its {CHECKSUM} checksum"):
        store.verify_checkpoint(step)


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


def test_async_saves_of_plain_cpu_tensors_defer_their_copies_and_others_use_dcps_stager():
    assert sharded._plain_cpu({"model": {"w": torch.randn(2)}, "optim": {"param_groups.w": {"lr": 0.1}}})
    assert not sharded._plain_cpu({"model": {"w": torch.empty(2, device="meta")}}), "device tensors: DCP's stager"

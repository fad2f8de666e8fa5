"""Tokenizer and shard round trip; checksum and header corruption detected."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runyard.data.shards import (
    HEADER,
    ShardCorrupt,
    ShardWriter,
    dtype_for_vocab,
    load_index,
    open_shard,
    read_doc_offsets,
    verify_index,
    write_index,
    write_shard,
)
from runyard.data.tokenize import encode_documents
from runyard.data.tokenizer import EOS_TOKEN, load_tokenizer, train_bpe


def test_dtype_fits_vocabulary():
    assert dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == np.uint32


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_shard_round_trip(tmp_path: Path, dtype):
    tokens = np.arange(5000, dtype=np.int64) % np.iinfo(dtype).max
    write_shard(tmp_path / "s.bin", tokens, np.dtype(dtype))
    back = open_shard(tmp_path / "s.bin")
    assert back.dtype.itemsize == np.dtype(dtype).itemsize
    np.testing.assert_array_equal(back, tokens)


def test_writer_cuts_fixed_shards_and_records_document_starts(tmp_path: Path):
    docs = [np.arange(n, dtype=np.int64) + 1000 * i for i, n in enumerate([700, 300, 1500, 10])]
    w = ShardWriter(tmp_path, "train", 1024, np.dtype(np.uint16))
    w.add_tokens(np.concatenate(docs[:2]), np.array([700, 300]))
    w.add_tokens(np.concatenate(docs[2:]), np.array([1500, 10]))
    entries = w.finish()
    assert [e["tokens"] for e in entries] == [1024, 1024, 462]
    # Global document starts 0, 700, 1000, 2500 -> shard 0 holds 0,700,1000; shard 2 holds 2500-2048,
    # each in the offsets file beside its shard; the index holds only their count and checksum.
    assert [read_doc_offsets(tmp_path / e["docs_file"]).tolist() for e in entries] == [[0, 700, 1000], [], [452]]
    assert [e["documents"] for e in entries] == [3, 0, 1] and all("doc_starts" not in e for e in entries)
    write_index(
        tmp_path / "train.json",
        entries,
        dtype=np.dtype(np.uint16),
        vocab_size=5000,
        eos_id=0,
        shard_tokens=1024,
        num_documents=4,
    )
    stream = np.concatenate(
        [open_shard(tmp_path / e["file"]) for e in load_index(tmp_path / "train.json")["shards"]]
    )
    np.testing.assert_array_equal(stream, np.concatenate(docs))
    verify_index(tmp_path / "train.json")


def test_checksum_mismatch_is_detected(tmp_path: Path):
    w = ShardWriter(tmp_path, "train", 1024, np.dtype(np.uint16))
    w.add_tokens(np.arange(3000) % 500, np.array([3000]))
    entries = w.finish()
    write_index(
        tmp_path / "train.json",
        entries,
        dtype=np.dtype(np.uint16),
        vocab_size=500,
        eos_id=0,
        shard_tokens=1024,
        num_documents=1,
    )
    shard = tmp_path / entries[1]["file"]
    data = bytearray(shard.read_bytes())
    data[HEADER.size + 10] ^= 0xFF  # flip one token's bits; size and header stay valid
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardCorrupt, match=entries[1]["file"]):
        verify_index(tmp_path / "train.json")


def test_truncated_shard_is_refused(tmp_path: Path):
    write_shard(tmp_path / "s.bin", np.arange(100), np.dtype(np.uint16))
    data = (tmp_path / "s.bin").read_bytes()
    (tmp_path / "s.bin").write_bytes(data[:-2])
    with pytest.raises(ShardCorrupt, match="header says 100 tokens"):
        open_shard(tmp_path / "s.bin")


def test_tokenizer_and_shard_round_trip(tmp_path: Path):
    texts = ["def add(a, b):\n    return a + b\n", "héllo wörld ✓ 你好\n", "class A:\n    pass\n"] * 20
    tok = train_bpe(texts, vocab_size=300, min_frequency=2, max_bytes=10_000)
    tok.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    eos = tok.token_to_id(EOS_TOKEN)
    tokens, lengths = encode_documents(tok, texts, eos, np.dtype(np.uint16))
    w = ShardWriter(tmp_path, "train", 1024, np.dtype(np.uint16))
    w.add_tokens(tokens, lengths)
    entries = w.finish()
    stream = np.concatenate([open_shard(tmp_path / e["file"]) for e in entries]).tolist()
    decoded, doc = [], []
    for t in stream:
        if t == eos:
            decoded.append(tok.decode(doc))
            doc = []
        else:
            doc.append(t)
    assert decoded == texts

"""Sources: globs and excludes, JSONL, Parquet, gzip, zstd, fsspec URLs, undecodable bytes."""

from __future__ import annotations

import gzip
import json
import sysconfig
from collections import Counter
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from runyard.data.sources import expand_path_template, iter_file_documents, list_input_files
from runyard.errors import DataError
from runyard.spec.data import SourceSpec


def read_all(source: SourceSpec) -> tuple[list[tuple[str, str]], Counter]:
    counts: Counter = Counter()
    docs = [d for f in list_input_files([source]) for d in iter_file_documents(source, f, counts)]
    return docs, counts


def test_glob_with_excludes_and_stdlib_template(tmp_path: Path):
    for rel in ("a.py", "pkg/b.py", "pkg/tests/t.py", "test/x.py", "c.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    docs, _ = read_all(SourceSpec(path=f"{tmp_path}/**/*.py", exclude=["**/tests/**", "**/test/**"]))
    assert sorted(Path(i).name for i, _ in docs) == ["a.py", "b.py"]
    assert expand_path_template("{stdlib}/os.py") == sysconfig.get_paths()["stdlib"] + "/os.py"


def test_jsonl_field_gzip_and_bad_records(tmp_path: Path):
    lines = [
        json.dumps({"text": "first"}),
        "{not json",
        json.dumps({"body": "no text"}),
        json.dumps({"text": "second"}),
    ]
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    docs, counts = read_all(SourceSpec(path=str(tmp_path / "*.jsonl.gz"), format="jsonl"))
    assert [t for _, t in docs] == ["first", "second"]
    assert counts["bad_records"] == 2


def test_parquet_column_and_zstd(tmp_path: Path):
    pq.write_table(pa.table({"content": ["a b c", "d e f"], "n": [1, 2]}), tmp_path / "d.parquet")
    docs, _ = read_all(SourceSpec(path=str(tmp_path / "d.parquet"), format="parquet", text_field="content"))
    assert [t for _, t in docs] == ["a b c", "d e f"]
    with pytest.raises(DataError, match="no column 'text'"):
        read_all(SourceSpec(path=str(tmp_path / "d.parquet"), format="parquet"))
    (tmp_path / "z.txt.zst").write_bytes(zstandard.ZstdCompressor().compress("zstd text ✓".encode()))
    docs, _ = read_all(SourceSpec(path=str(tmp_path / "z.txt.zst")))
    assert docs[0][1] == "zstd text ✓"


def test_fsspec_url(tmp_path: Path):
    fs = fsspec.filesystem("memory")
    fs.pipe("/corpus/one.txt", b"from memory one")
    fs.pipe("/corpus/two.txt", b"from memory two")
    docs, _ = read_all(SourceSpec(path="memory://corpus/*.txt"))
    assert [t for _, t in docs] == ["from memory one", "from memory two"]
    assert all(i.startswith("memory://") for i, _ in docs)


def test_undecodable_bytes_replace_or_skip(tmp_path: Path):
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 \xff\xfe latin-1 bytes")
    docs, counts = read_all(SourceSpec(path=str(tmp_path / "*.txt"), encoding_errors="replace"))
    assert len(docs) == 2 and counts["undecodable_replaced"] == 1
    assert "\ufffd" in dict(docs)[str(tmp_path / "bad.txt")]
    docs, counts = read_all(SourceSpec(path=str(tmp_path / "*.txt"), encoding_errors="skip"))
    assert [t for _, t in docs] == ["fine"] and counts["undecodable_skipped"] == 1


def test_corrupt_compressed_file_names_the_file(tmp_path: Path):
    (tmp_path / "broken.txt.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="broken.txt.gz: cannot decompress as gzip"):
        read_all(SourceSpec(path=str(tmp_path / "broken.txt.gz")))

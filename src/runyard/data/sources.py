"""Sources: turn the spec's `sources` into documents.

A source is a local path, a glob or any fsspec URL, in one of three formats: `text` (each file is one
document), `jsonl` (one document per line, text under a named field) and `parquet` (one document per
row of a named column). Files ending in `.gz` or `.zst` are decompressed on the fly. Bytes that are not
UTF-8 follow the source's `encoding_errors` policy: `replace` (U+FFFD, counted) or `skip` (the document
is left out, counted); a corpus never stops half-way on a bad byte.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import io
import json
import os
import sysconfig
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from runyard.data.config import SourceSpec
from runyard.errors import DataError


@dataclass(frozen=True)
class InputFile:
    """One file of one source: `source` is its index in the spec's list."""

    source: int
    path: str
    size: int


def expand_path_template(path: str) -> str:
    """Replace `{stdlib}` with the running interpreter's standard library directory."""
    return path.replace("{stdlib}", sysconfig.get_paths()["stdlib"])


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _excluded(path: str, patterns: list[str]) -> bool:
    # fnmatch's '*' crosses '/', so '**/test/**' matches any path with a 'test' directory in it.
    return any(fnmatch.fnmatch(path, p) for p in patterns)


def list_source_files(source: SourceSpec, index: int) -> list[InputFile]:
    """The files a source names, sorted by path so that every later step sees the same order."""
    pattern = expand_path_template(source.path)
    files: list[InputFile] = []
    if _is_url(pattern):
        import fsspec

        for of in fsspec.open_files(pattern):
            url = of.fs.unstrip_protocol(of.path)
            if not _excluded(url, source.exclude) and not of.fs.isdir(of.path):
                files.append(InputFile(index, url, int(of.fs.size(of.path) or 0)))
    else:
        pattern = pattern.removeprefix("file://")
        matches = glob.glob(pattern, recursive=True) if glob.has_magic(pattern) else [pattern]
        for p in matches:
            if os.path.isfile(p) and not _excluded(p, source.exclude):
                files.append(InputFile(index, os.path.abspath(p), os.path.getsize(p)))
    files.sort(key=lambda f: f.path)
    return files


def list_input_files(sources: list[SourceSpec]) -> list[InputFile]:
    """Every file of every source; raises DataError naming the source that matched nothing."""
    out: list[InputFile] = []
    for i, source in enumerate(sources):
        files = list_source_files(source, i)
        if not files:
            raise DataError(
                f"data.sources[{i}].path {source.path!r} matched no files "
                f"(expanded to {expand_path_template(source.path)!r})"
            )
        out.extend(files)
    return out


def read_bytes(path: str) -> bytes:
    """The raw (still compressed) bytes of a local file or fsspec URL."""
    if _is_url(path):
        import fsspec

        with fsspec.open(path, "rb") as f:
            return f.read()
    with open(path.removeprefix("file://"), "rb") as f:
        return f.read()


def _compression(source: SourceSpec, path: str) -> str:
    if source.compression != "infer":
        return source.compression
    if path.endswith(".gz"):
        return "gzip"
    if path.endswith((".zst", ".zstd")):
        return "zstd"
    return "none"


def decompress(source: SourceSpec, path: str, raw: bytes) -> bytes:
    """Undo gzip or zstd compression (by file name unless the source says otherwise)."""
    kind = _compression(source, path)
    try:
        if kind == "gzip":
            return gzip.decompress(raw)
        if kind == "zstd":
            import zstandard

            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)) as reader:
                return reader.read()
    except Exception as exc:  # gzip raises OSError/EOFError, zstandard its own ZstdError
        raise DataError(f"{path}: cannot decompress as {kind}: {exc}") from None
    return raw


def decode(data: bytes, policy: str, counts: Counter) -> str | None:
    """UTF-8 decode under the source's policy; None means 'skip this document'."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        if policy == "skip":
            counts["undecodable_skipped"] += 1
            return None
        counts["undecodable_replaced"] += 1
        return data.decode("utf-8", errors="replace")


def iter_file_documents(source: SourceSpec, file: InputFile, counts: Counter) -> Iterator[tuple[str, str]]:
    """(doc_id, text) for each document in one file. `counts` collects bytes read and decode/parse
    problems; documents that cannot be used are counted, never raised."""
    data = decompress(source, file.path, read_bytes(file.path))
    counts["files"] += 1
    counts["bytes_read"] += len(data)
    if source.format == "text":
        text = decode(data, source.encoding_errors, counts)
        if text is not None:
            yield file.path, text
    elif source.format == "jsonl":
        yield from _jsonl_documents(source, file.path, data, counts)
    else:
        yield from _parquet_documents(source, file.path, data, counts)


def _jsonl_documents(
    source: SourceSpec, path: str, data: bytes, counts: Counter
) -> Iterator[tuple[str, str]]:
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        text_line = decode(line, source.encoding_errors, counts)
        if text_line is None:
            continue
        try:
            record = json.loads(text_line)
        except json.JSONDecodeError:
            counts["bad_records"] += 1
            continue
        value = record.get(source.text_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            counts["bad_records"] += 1
            continue
        yield f"{path}#L{lineno}", value


def _parquet_documents(
    source: SourceSpec, path: str, data: bytes, counts: Counter
) -> Iterator[tuple[str, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
    except pa.ArrowException as exc:
        raise DataError(f"{path}: not a readable Parquet file: {exc}") from None
    if source.text_field not in pf.schema_arrow.names:
        raise DataError(
            f"{path}: Parquet file has no column {source.text_field!r} (text_field); "
            f"columns are {pf.schema_arrow.names}"
        )
    row = 0
    for batch in pf.iter_batches(columns=[source.text_field]):
        column = batch.column(0)
        is_binary = pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)
        for value in column.to_pylist():
            row += 1
            if isinstance(value, bytes) and is_binary:
                value = decode(value, source.encoding_errors, counts)
                if value is None:
                    continue
            if not isinstance(value, str):
                counts["bad_records"] += 1
                continue
            yield f"{path}#{row - 1}", value

"""Sources: turn the spec's `sources` into documents, reading each file once, in blocks.

A source is a local path, a glob or any fsspec URL, in one of three formats: `text` (each file is one
document), `jsonl` (one document per line, text under a named field) and `parquet` (one document per
row of a named column). Files ending in `.gz` or `.zst` are decompressed on the fly. Bytes that are not
UTF-8 follow the source's `encoding_errors` policy: `replace` (U+FFFD, counted) or `skip` (the document
is left out, counted); a corpus never stops half-way on a bad byte.

Reading is streamed: a file is never held whole in memory (only the document being read is), and its
sha256 is computed from the same bytes as they are read (`FileDigest`), so a remote source is fetched
once per preparation. Parquet needs random access (its footer comes first): a local Parquet file is
hashed in one sequential pass and then parsed; a remote or compressed one is copied to a local temporary
file while it is hashed, and parsed there.

Each listed file carries its identity (`InputFile.identity`): size, modification time and inode of a
local file, or the version facts an fsspec store reports (ETag, generation, mtime...). After a file is
read its identity is taken again: a file that disappeared or changed meanwhile raises `InputChanged`.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import hashlib
import io
import json
import os
import sysconfig
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from runyard.data.errors import DocumentTooLarge, InputChanged
from runyard.errors import DataError
from runyard.spec.data import SourceSpec
from runyard.spec.job import reference_hint

READ_BLOCK = 1 << 20
# A file modified this close to when it was read may change again within the same timestamp tick:
# its identity cannot vouch for its content later (git's "racy" files), so work keyed by it is redone.
RACY_SECONDS = 2.0
# fsspec `info()` keys that change whenever an object's content does, in the stores that report them.
_VERSION_KEYS = (
    "ETag", "etag", "md5Hash", "crc32c", "generation", "VersionId", "version_id", "mtime",
    "LastModified", "last_modified", "updated", "created", "content_md5",
)


@dataclass(frozen=True)
class InputFile:
    """One file of one source: `source` is its index in the spec's list. `identity` is what the listing
    saw of it (see the module doc); "" when not taken."""

    source: int
    path: str
    size: int
    identity: str = ""


def expand_path_template(path: str) -> str:
    """Replace `{stdlib}` with the running interpreter's standard library directory."""
    return path.replace("{stdlib}", sysconfig.get_paths()["stdlib"])


def is_url(path: str) -> bool:
    """An fsspec URL other than file://."""
    return "://" in path and not path.startswith("file://")


def _excluded(path: str, patterns: list[str]) -> bool:
    # fnmatch's '*' crosses '/', so '**/test/**' matches any path with a 'test' directory in it.
    return any(fnmatch.fnmatch(path, p) for p in patterns)


def local_identity(st: os.stat_result) -> str:
    return f"stat:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def remote_identity(info: dict) -> str:
    """`info:` and the version facts of an fsspec `info()`; `unversioned:` when it reports none (its
    content can then only be known by reading it)."""
    facts = {k: str(info[k]) for k in _VERSION_KEYS if info.get(k) not in (None, "")}
    size = int(info.get("size") or 0)
    if not facts:
        return f"unversioned:{size}"
    return "info:" + json.dumps({"size": size, **facts}, sort_keys=True)


def current_identity(path: str) -> str | None:
    """The identity `path` has now, or None if it is gone."""
    try:
        if is_url(path):
            fs, p = fsspec.core.url_to_fs(path)
            return remote_identity(fs.info(p))
        return local_identity(os.stat(path.removeprefix("file://")))
    except FileNotFoundError:
        return None


def list_source_files(source: SourceSpec, index: int) -> list[InputFile]:
    """The files a source names, sorted by path so that every later step sees the same order."""
    pattern = expand_path_template(source.path)
    files: list[InputFile] = []
    if is_url(pattern):
        for of in fsspec.open_files(pattern):
            url = of.fs.unstrip_protocol(of.path)
            if _excluded(url, source.exclude):
                continue
            info = of.fs.info(of.path)
            if info.get("type") != "directory":
                files.append(InputFile(index, url, int(info.get("size") or 0), remote_identity(info)))
    else:
        pattern = pattern.removeprefix("file://")
        matches = glob.glob(pattern, recursive=True) if glob.has_magic(pattern) else [pattern]
        for p in matches:
            if os.path.isfile(p) and not _excluded(p, source.exclude):
                st = os.stat(p)
                files.append(InputFile(index, os.path.abspath(p), st.st_size, local_identity(st)))
    files.sort(key=lambda f: f.path)
    return files



def files_or_problem(source: SourceSpec, index: int, where: str) -> tuple[list[InputFile], tuple[str, str, str] | None]:
    """The source's files, or the spec problem (field path `where`, the path, what was expected) that says
    why there are none: unreadable, matching nothing (with what it expanded to), or all excluded. The one
    check `runyard plan` and `run` make of every source before any work (top-level data and stages')."""
    try:
        found = list_source_files(source, index)
    except (DataError, OSError, ValueError) as exc:
        return [], (where, source.path, f"a readable path, glob or URL ({exc}) {reference_hint(where)}")
    if found:
        return found, None
    expanded = expand_path_template(source.path)
    unfiltered = list_source_files(source.model_copy(update={"exclude": []}), index) if source.exclude else []
    if unfiltered:
        why = (f"files to read: it matches {len(unfiltered)} but {where.rsplit('.', 1)[0]}.exclude "
               f"{source.exclude} leaves none")
    else:
        relative = "" if os.path.isabs(expanded) or "://" in expanded else f", relative to {os.getcwd()}"
        why = f"a path or glob that matches files: it matched none (expanded to {expanded!r}{relative})"
    return [], (where, source.path, f"{why} {reference_hint(where)}")

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


@dataclass
class FileDigest:
    """What reading one file saw: the sha256 and size of its raw (still compressed) bytes, and whether it
    was modified so shortly before the read that its identity cannot vouch for its content later."""

    sha256: str = ""
    size: int = 0
    racy: bool = False


class _HashingReader(io.RawIOBase):
    """A binary stream that hashes every byte read through it."""

    def __init__(self, raw, hasher) -> None:
        self.raw, self.hasher, self.count = raw, hasher, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.raw.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self.hasher.update(data)
        self.count += n
        return n

    def drain(self) -> None:
        """Hash what the consumer left unread (a compressed stream's trailer, say)."""
        while block := self.raw.read(READ_BLOCK):
            self.hasher.update(block)
            self.count += len(block)


def _open_raw(path: str):
    if is_url(path):
        return fsspec.open(path, "rb").open()
    return open(path.removeprefix("file://"), "rb")


def read_bytes(path: str) -> bytes:
    """The raw (still compressed) bytes of a local file or fsspec URL, whole (instruction records: files a
    fine-tuning set keeps small; the text data stage streams instead, `read_stream`)."""
    with _open_raw(path) as f:
        return f.read()


def _compression(source: SourceSpec, path: str) -> str:
    if source.compression != "infer":
        return source.compression
    if path.endswith(".gz"):
        return "gzip"
    if path.endswith((".zst", ".zstd")):
        return "zstd"
    return "none"


def _decompressing(kind: str, stream):
    if kind == "gzip":
        return gzip.GzipFile(fileobj=stream, mode="rb")
    if kind == "zstd":
        reader = zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True)
        return io.BufferedReader(reader, READ_BLOCK)
    return stream


@contextmanager
def read_stream(source: SourceSpec, file: InputFile, digest: FileDigest) -> Iterator:
    """A decompressed binary stream of `file`; on leaving, `digest` holds the sha256 of every raw byte
    and the file's identity is checked against its listing (InputChanged if it moved)."""
    started = time.time()
    try:
        raw = _open_raw(file.path)
    except FileNotFoundError:
        raise InputChanged(
            f"{file.path} (data.sources[{file.source}]) disappeared after it was listed; nothing read from "
            "it was kept. Run the data stage again once the source is stable"
        ) from None
    hasher = hashlib.sha256()
    kind = _compression(source, file.path)
    with raw:
        hashing = _HashingReader(raw, hasher)
        buffered = io.BufferedReader(hashing, READ_BLOCK)
        try:
            yield _decompressing(kind, buffered)
        except (gzip.BadGzipFile, EOFError, zlib.error, zstandard.ZstdError) as exc:
            if kind == "none":
                raise
            raise DataError(f"{file.path}: cannot decompress as {kind}: {exc}") from None
        buffered.read()  # whatever the decompressor did not need, still part of the file's bytes
        hashing.drain()
    digest.sha256, digest.size = hasher.hexdigest(), hashing.count
    check_unchanged(file, digest, started)


def check_unchanged(file: InputFile, digest: FileDigest, started: float) -> None:
    """Raise InputChanged unless `file` still has the identity it was listed with (and the size read)."""
    if not file.identity:
        return
    where = f"{file.path} (data.sources[{file.source}])"
    if file.identity.startswith("sha256:"):  # known by content: the bytes read must be those
        if digest.sha256 != file.identity.removeprefix("sha256:"):
            raise InputChanged(f"{where} changed since it was first read (its sha256 differs); nothing read "
                               "from it was kept. Run the data stage again once the source is stable")
        return
    now = current_identity(file.path)
    if now is None:
        raise InputChanged(f"{where} disappeared while it was being read; nothing read from it was kept")
    if now != file.identity or (file.identity.startswith("stat:") and digest.size != file.size):
        raise InputChanged(
            f"{where} changed while the data stage read it (listed as {file.identity}, now {now}; "
            f"{digest.size:,} bytes read of {file.size:,} listed); nothing read from it was kept. Run the "
            "data stage again once the source is stable"
        )
    if file.identity.startswith("stat:"):
        mtime = int(file.identity.split(":")[2]) / 1e9
        digest.racy = started - mtime < RACY_SECONDS


def hash_file(file: InputFile) -> FileDigest:
    """Read `file` once, in blocks, for its sha256 alone (for files whose listing cannot vouch for them)."""
    digest = FileDigest()
    with read_stream(SourceSpec(path=file.path, compression="none"), file, digest) as stream:
        while stream.read(READ_BLOCK):
            pass
    return digest


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


@dataclass
class ReadLimits:
    """How much of a file may be held at once: one document, and a Parquet batch."""

    max_document_bytes: int = 1 << 62
    parquet_batch_bytes: int = 64 << 20
    temp_dir: str | None = None  # where remote or compressed Parquet files are copied to be parsed
    digests: dict[str, FileDigest] = field(default_factory=dict)  # path -> what reading it saw


def _too_large(path: str, what: str, limit: int) -> DocumentTooLarge:
    return DocumentTooLarge(
        f"{path}: {what} is larger than {limit:,} bytes, the largest document a worker's share of "
        "data.memory_limit can clean. Raise data.memory_limit, lower data.workers, or split the file"
    )


def iter_file_documents(
    source: SourceSpec, file: InputFile, counts: Counter, limits: ReadLimits | None = None
) -> Iterator[tuple[str, str]]:
    """(doc_id, text) for each document in one file, read in blocks. `counts` collects bytes read and
    decode/parse problems (documents that cannot be used are counted, never raised); the file's sha256
    lands in `limits.digests[file.path]` once it is read to the end."""
    limits = limits or ReadLimits()
    digest = limits.digests.setdefault(file.path, FileDigest())
    counts["files"] += 1
    if source.format == "parquet":
        yield from _parquet_documents(source, file, counts, limits, digest)
        return
    with read_stream(source, file, digest) as stream:
        if source.format == "text":
            data = _read_capped(stream, limits.max_document_bytes, file.path)
            counts["bytes_read"] += len(data)
            text = decode(data, source.encoding_errors, counts)
            if text is not None:
                yield file.path, text
        else:
            yield from _jsonl_documents(source, file.path, stream, counts, limits.max_document_bytes)


def _read_capped(stream, limit: int, path: str) -> bytes:
    blocks, size = [], 0
    while block := stream.read(READ_BLOCK):
        size += len(block)
        if size > limit:
            raise _too_large(path, "the file (one document in `text` format)", limit)
        blocks.append(block)
    return b"".join(blocks)


def _jsonl_documents(
    source: SourceSpec, path: str, stream, counts: Counter, limit: int
) -> Iterator[tuple[str, str]]:
    lineno = 0
    while True:
        line = stream.readline(limit + 2)
        if not line:
            return
        lineno += 1
        counts["bytes_read"] += len(line)
        if line.endswith(b"\n"):
            line = line[:-1]
        if len(line) > limit:
            raise _too_large(path, f"line {lineno}", limit)
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


@contextmanager
def _parquet_local_copy(source: SourceSpec, file: InputFile, limits: ReadLimits, digest: FileDigest):
    """A local path to parse `file` from, its bytes hashed on the way (see the module doc)."""
    local = not is_url(file.path) and _compression(source, file.path) == "none"
    if local:
        with read_stream(source, file, digest) as stream:
            while stream.read(READ_BLOCK):
                pass
        yield file.path.removeprefix("file://")
        return
    fd, tmp = tempfile.mkstemp(prefix=".runyard-parquet-", suffix=".parquet", dir=limits.temp_dir)
    try:
        with os.fdopen(fd, "wb") as out, read_stream(source, file, digest) as stream:
            while block := stream.read(READ_BLOCK):
                out.write(block)
        yield tmp
    finally:
        os.unlink(tmp)


def _parquet_documents(
    source: SourceSpec, file: InputFile, counts: Counter, limits: ReadLimits, digest: FileDigest
) -> Iterator[tuple[str, str]]:
    with _parquet_local_copy(source, file, limits, digest) as local_path:
        counts["bytes_read"] += os.path.getsize(local_path)
        try:
            pf = pq.ParquetFile(local_path)
        except pa.ArrowException as exc:
            raise DataError(f"{file.path}: not a readable Parquet file: {exc}") from None
        if source.text_field not in pf.schema_arrow.names:
            raise DataError(
                f"{file.path}: Parquet file has no column {source.text_field!r} (text_field); "
                f"columns are {pf.schema_arrow.names}"
            )
        meta = pf.metadata
        row_bytes = max(1, (sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)))
                        // max(1, meta.num_rows))
        batch_rows = max(1, limits.parquet_batch_bytes // row_bytes)
        row = 0
        for batch in pf.iter_batches(batch_size=batch_rows, columns=[source.text_field]):
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
                yield f"{file.path}#{row - 1}", value

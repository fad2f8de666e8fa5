"""What is installed: each distribution's name, version, wheel tags, and the digest of its files.

The *content digest* of a distribution is sha256 over the sorted (path, hash) pairs that its RECORD
lists for files inside site-packages, leaving out what an installer adds or rewrites (INSTALLER,
REQUESTED, direct_url.json, RECORD itself, byte-code, and scripts and data installed outside
site-packages). The same digest computed from a wheel's own RECORD matches it exactly when that wheel
is the one that was installed. That is what lets runyard name an archive's hash honestly: an archive
found anywhere (a local wheel directory, pip's cache, a download) counts only if its digest equals the
installed one.

The digest depends on RECORD alone, so it is remembered by RECORD's path and stat in a memo file:
parsing every RECORD of a large environment (torch's lists tens of thousands of files) cost every run's
start about two seconds.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name

from runyard.system.files import JsonMemo

# Files an installer writes into a .dist-info directory itself (PEP 376, PEP 610, PEP 627).
_INSTALLER_FILES = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json", "RECORD.jws", "RECORD.p7s"}


@dataclass(frozen=True)
class InstalledDist:
    """One installed distribution as the lock records it."""

    name: str  # canonical (PEP 503) name
    version: str
    tags: tuple[str, ...]  # the wheel's tags from its WHEEL file; () if not installed from a wheel
    build_tag: str | None
    content_sha256: str | None  # None when the distribution has no RECORD with hashes
    installer: str | None
    direct_url: dict | None  # PEP 610: how it was installed when not from an index
    location: str

    @property
    def editable(self) -> bool:
        return bool(((self.direct_url or {}).get("dir_info") or {}).get("editable"))

    @property
    def from_local_directory(self) -> bool:
        return "dir_info" in (self.direct_url or {})

    def wheel_filename(self) -> str | None:
        """The file name of the wheel it came from (PEP 427), rebuilt from its tags."""
        return wheel_filename(self.name, self.version, self.build_tag, self.tags) if self.tags else None


def _skipped(path: str) -> bool:
    parts = path.split("/")
    if path.endswith(".pyc") or "__pycache__" in parts:
        return True
    return len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] in _INSTALLER_FILES


def content_digest(entries: dict[str, str]) -> str:
    """sha256 over sorted 'path<TAB>hash' lines."""
    text = "".join(f"{path}\t{entries[path]}\n" for path in sorted(entries))
    return hashlib.sha256(text.encode()).hexdigest()


def installed_entries(files: Iterable[metadata.PackagePath] | None) -> dict[str, str]:
    """(path -> 'algo=digest') for the files of an installed distribution that came from its wheel."""
    entries = {}
    for f in files or []:
        path = str(f).replace("\\", "/")
        if f.hash is None or path.startswith("../") or path.startswith("/") or _skipped(path):
            continue
        entries[path] = f"{f.hash.mode}={f.hash.value}"
    return entries


def archive_entries(archive: zipfile.ZipFile) -> dict[str, str]:
    """(path -> 'algo=digest') from a wheel's RECORD, with paths as they are once installed."""
    record = _dist_info_member(archive, "RECORD")
    entries = {}
    with archive.open(record) as raw:
        for row in csv.reader(io.TextIOWrapper(raw, encoding="utf-8")):
            if len(row) < 2 or not row[1]:
                continue
            path = row[0]
            parts = path.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue  # scripts, headers, data: installed outside site-packages
                path = "/".join(parts[2:])
            if not _skipped(path):
                entries[path] = row[1]
    return entries


def _dist_info_member(archive: zipfile.ZipFile, name: str) -> str:
    for member in archive.namelist():
        parts = member.split("/")
        if len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] == name:
            return member
    raise zipfile.BadZipFile(f"no .dist-info/{name} in {archive.filename}")


@dataclass(frozen=True)
class WheelFacts:
    """What a wheel file says about itself."""

    name: str
    version: str
    tags: tuple[str, ...]
    build_tag: str | None
    content_sha256: str


def read_wheel(path: Path | str) -> WheelFacts:
    """Name, version, tags and content digest of a wheel file (reads only its metadata and RECORD)."""
    with zipfile.ZipFile(path) as archive:
        meta = archive.read(_dist_info_member(archive, "METADATA")).decode("utf-8", "replace")
        wheel = archive.read(_dist_info_member(archive, "WHEEL")).decode("utf-8", "replace")
        digest = content_digest(archive_entries(archive))
    name, version = _name_version(meta)
    tags, build = _wheel_tags(wheel)
    return WheelFacts(canonicalize_name(name), version, tags, build, digest)


def _metadata_text(dist: metadata.Distribution) -> str:
    """Its METADATA (a .dist-info folder) or PKG-INFO (an .egg-info folder, or the file itself), as
    importlib.metadata reads them."""
    return dist.read_text("METADATA") or dist.read_text("PKG-INFO") or dist.read_text("") or ""


def _name_version(metadata_text: str) -> tuple[str, str]:
    """Name and Version from a METADATA file's headers (its long description is never parsed)."""
    name = version = ""
    for line in metadata_text.splitlines():
        if not line.strip():
            break  # the headers end at the first blank line
        key, _, value = line.partition(":")
        if key == "Name":
            name = value.strip()
        elif key == "Version":
            version = value.strip()
    return name, version


def _wheel_tags(wheel_text: str | None) -> tuple[tuple[str, ...], str | None]:
    tags, build = [], None
    for line in (wheel_text or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Tag":
            tags.append(value.strip())
        elif key.strip() == "Build":
            build = value.strip()
    return tuple(tags), build


def wheel_filename(name: str, version: str, build_tag: str | None, tags: Iterable[str]) -> str:
    """The PEP 427 file name for a wheel with these tags (compressed tag sets, in first-seen order)."""
    columns: list[list[str]] = [[], [], []]
    for tag in tags:
        for column, part in zip(columns, tag.split("-"), strict=True):
            if part not in column:
                column.append(part)
    parts = [name.replace("-", "_"), version] + ([build_tag] if build_tag else []) + [".".join(c) for c in columns]
    return "-".join(parts) + ".whl"


def _direct_url(dist: metadata.Distribution) -> dict | None:
    text = dist.read_text("direct_url.json")
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class DigestMemo(JsonMemo):
    """(RECORD's path, inode, size, mtime) -> an installed distribution's content digest."""

    def content_sha256(self, dist: metadata.Distribution) -> str | None:
        key = _record_key(dist)
        if key is not None and key in self.entries:
            return self.entries[key]
        entries = installed_entries(dist.files)
        digest = content_digest(entries) if entries else None
        return self.remember(key, digest) if key is not None else digest


def _record_key(dist: metadata.Distribution) -> str | None:
    """RECORD's path, inode, size and mtime (an installer writes a new file), or None where the
    distribution is not a folder on disk."""
    folder = getattr(dist, "_path", None)  # PathDistribution's folder; other finders have none
    if folder is None:
        return None
    try:
        st = os.stat(Path(folder) / "RECORD")
    except OSError:
        return None
    return f"{Path(folder).resolve() / 'RECORD'}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"


def describe(dist: metadata.Distribution, memo: DigestMemo | None = None) -> InstalledDist:
    """The lock's view of one installed distribution."""
    return _described(dist, *_name_version(_metadata_text(dist)), memo if memo is not None else DigestMemo(None))


def _described(dist: metadata.Distribution, name: str, version: str, memo: DigestMemo) -> InstalledDist:
    tags, build = _wheel_tags(dist.read_text("WHEEL"))
    return InstalledDist(
        name=canonicalize_name(name),
        version=version,
        tags=tags,
        build_tag=build,
        content_sha256=memo.content_sha256(dist),
        installer=(dist.read_text("INSTALLER") or "").strip() or None,
        direct_url=_direct_url(dist),
        location=str(dist.locate_file("")),
    )


def installed_distributions(paths: list[str] | None = None, memo: DigestMemo | None = None) -> list[InstalledDist]:
    """Every distribution importable from `paths` (default sys.path), the first of each name winning
    as it would for `import`, sorted by name. `memo` remembers the content digests (saved by the caller)."""
    seen: dict[str, InstalledDist] = {}
    memo = memo if memo is not None else DigestMemo(None)
    for dist in metadata.distributions(path=paths if paths is not None else sys.path):
        name, version = _name_version(_metadata_text(dist))  # METADATA read once a distribution
        if not name:
            continue  # a broken .dist-info directory
        if canonicalize_name(name) not in seen:
            seen[canonicalize_name(name)] = _described(dist, name, version, memo)
    return [seen[name] for name in sorted(seen)]

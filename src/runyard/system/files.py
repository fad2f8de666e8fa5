"""Durable file writes and file digests, shared by every part of runyard (it imports no torch).

A reader of a file written with `atomic_write_*` sees either the old file or the whole new one, even
after a crash or power loss: the data goes to a temporary file beside it, is fsynced, renamed into
place, and the directory is fsynced so the rename itself survives. A write that fails for lack of space
raises `DiskFull` naming the file, the bytes it needed and the bytes free.

Files and directories made here get the permissions the process's umask gives (0644 and 0755 under the
usual 022), like every other file of a run; a secret asks for its own `mode`.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

from runyard.system.diskspace import writing


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path | str, data: bytes, mode: int | None = None) -> None:
    """Write `data` to `path` durably and all at once; `mode` sets the permissions (e.g. 0o600 for a
    secret) before any byte is written."""
    path = Path(path)
    with writing(str(path), path.parent, needed=len(data)):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


def make_temp_dir(parent: Path | str, prefix: str) -> Path:
    """A new, uniquely named directory in `parent` for files that will be renamed into place together.
    Unlike tempfile.mkdtemp (always 0700), it gets the umask's permissions, so the directory it becomes
    reads like the rest of the run."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    while True:
        path = parent / f"{prefix}{uuid.uuid4().hex[:12]}"
        try:
            path.mkdir(mode=0o777)  # the umask applies
        except FileExistsError:
            continue
        return path


def current_umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting it, and put it back at once
    os.umask(mask)
    return mask


def match_umask(path: Path | str) -> None:
    """Give a file that a library created with its own fixed mode (safetensors writes 0600) the
    permissions the umask gives every other file."""
    os.chmod(path, 0o666 & ~current_umask())


def atomic_write_text(path: Path | str, text: str, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: Path | str, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


class JsonMemo:
    """A dict of computed facts kept as one JSON file: read once, written atomically when changed. A file
    that is missing or unreadable starts the memo empty, and an entry lost to a concurrent writer is
    computed again; callers key entries by what would change the answer (a file's path, size, mtime)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, Any] = {}
        self.changed = False
        if path is not None and path.is_file():
            try:
                loaded = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                loaded = {}
            self.entries = loaded if isinstance(loaded, dict) else {}

    def remember(self, key: str, value: Any) -> Any:
        self.entries[key] = value
        self.changed = True
        return value

    def save(self) -> None:
        if self.path is not None and self.changed:
            atomic_write_text(self.path, json.dumps(self.entries, sort_keys=True))
            self.changed = False


def sha256_file(path: Path | str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()

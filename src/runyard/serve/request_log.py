"""Opt-in logging of served prompts as a dataset the data stage reads.

Each prompt is scrubbed with the data stage's PII scrubber (`runyard.data.pii`: e-mail addresses,
phone numbers, IP addresses and card numbers become placeholders) before anything touches the disk,
then appended as one JSON line `{"text": ..., "time": ...}` to a segment file. A segment is written as
`*.jsonl.part` and renamed to `*.jsonl` (fsynced) once it is complete: when it holds `segment_records`
lines, when a retraining job is about to read the directory, and at shutdown. So the directory is
always a valid `format: jsonl` source (`DIR/*.jsonl`, text under `text`) and a killed server never
leaves a half-written file that reads as data; the next server recovers the whole lines of a dead
one's `.part` file.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from runyard.data.pii import scrub_pii
from runyard.spec.data import TRAFFIC_FILTERS, PiiSpec
from runyard.system.files import fsync_dir, fsync_file

SEGMENT_GLOB = "*.jsonl"
PART_SUFFIX = ".part"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RequestLog:
    """Scrubbed prompts, appended to JSONL segments in `directory`. Thread-safe."""

    def __init__(self, directory: Path, pii: PiiSpec | None = None, segment_records: int = 1000):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.pii = pii or PiiSpec(enabled=True)
        self.segment_records = segment_records
        self.scrubbed: Counter = Counter()
        self.records = 0
        self._lock = threading.Lock()
        self._file = None
        self._path: Path | None = None
        self._in_segment = 0
        self._segments = 0
        self._recover()

    def source(self) -> dict[str, Any]:
        """This directory as a data-stage source (a job spec's `data.sources` entry): `kind: traffic`,
        cleaned with the request filters (spec/data.py TRAFFIC_FILTERS), written out so the derived spec
        shows them."""
        return {"path": str(self.directory.resolve() / SEGMENT_GLOB), "format": "jsonl", "text_field": "text",
                "kind": "traffic", "filters": dict(TRAFFIC_FILTERS)}

    def append(self, text: str) -> None:
        counts: Counter = Counter()
        clean = scrub_pii(text, self.pii, counts)
        line = json.dumps({"text": clean, "time": round(time.time(), 3)}, ensure_ascii=False) + "\n"
        with self._lock:
            if self._file is None:
                self._open()
            self._file.write(line)
            self._file.flush()
            self._in_segment += 1
            self.records += 1
            self.scrubbed.update(counts)
            if self._in_segment >= self.segment_records:
                self._seal()

    def seal(self) -> None:
        """Complete the open segment now (before something reads the directory)."""
        with self._lock:
            self._seal()

    def sealed_records(self) -> int:
        """Prompts in complete segments."""
        with self._lock:
            return self.records - self._in_segment

    def close(self) -> None:
        self.seal()

    def _open(self) -> None:
        self._segments += 1
        name = f"requests-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{self._segments:05d}.jsonl"
        self._path = self.directory / (name + PART_SUFFIX)
        self._file = open(self._path, "a", encoding="utf-8")  # noqa: SIM115 (held open across appends)
        self._in_segment = 0

    def _seal(self) -> None:
        if self._file is None:
            return
        self._file.close()
        fsync_file(self._path)
        os.replace(self._path, self._path.with_suffix(""))  # drop .part
        fsync_dir(self.directory)
        self._file, self._path, self._in_segment = None, None, 0

    def _recover(self) -> None:
        """Seal the whole lines of `.part` segments whose server is gone."""
        for part in sorted(self.directory.glob(f"*{PART_SUFFIX}")):
            try:
                pid = int(part.name.split("-")[2])
            except (IndexError, ValueError):
                continue
            if _pid_alive(pid) and pid != os.getpid():
                continue
            good = []
            for line in part.read_bytes().split(b"\n"):
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    continue  # the torn last line of a killed writer
                if isinstance(record, dict) and isinstance(record.get("text"), str):
                    good.append(line + b"\n")
            if good:
                target = part.with_suffix("")
                tmp = target.with_name(target.name + ".recovering")
                tmp.write_bytes(b"".join(good))
                fsync_file(tmp)
                os.replace(tmp, target)
            part.unlink()
            fsync_dir(self.directory)

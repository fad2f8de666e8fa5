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

import io
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from runyard.data.pii import scrub_pii
from runyard.spec.data import TRAFFIC_FILTERS, PiiSpec
from runyard.system.files import atomic_write_bytes, atomic_write_text, fsync_dir, fsync_file

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
        self.append_record({"text": clean, "time": round(time.time(), 3)}, counts)

    def append_record(self, record: dict[str, Any], scrubbed: Counter | None = None) -> None:
        """One JSON line, already scrubbed by the caller (`scrubbed`: what its scrubbing replaced)."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        counts = scrubbed or Counter()
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
                if isinstance(record, dict) and (isinstance(record.get("text"), str) or "features" in record):
                    good.append(line + b"\n")
            if good:
                target = part.with_suffix("")
                tmp = target.with_name(target.name + ".recovering")
                tmp.write_bytes(b"".join(good))
                fsync_file(tmp)
                os.replace(tmp, target)
            part.unlink()
            fsync_dir(self.directory)


ROWS_SCHEMA_FILE = "schema.json"
IMAGE_PREFIX = "images-"
NO_LABELS = ("logged rows and images carry no labels, so a supervised model cannot be retrained on them: "
             "runyard has no way yet to attach labels to logged inputs (such as a /v1/feedback route keyed by "
             "request id), so --retrain-spec is refused on a table or image server")


class PredictLog:
    """What a table or image server was asked to predict, kept in `directory` up to `max_inputs` inputs
    (past that, counted and dropped). Rows: JSONL segments sealed as RequestLog's are, one line a row
    `{"id": request id, "row": index in the request, "time", "features": {name: value as posted}}`, string
    values PII-scrubbed, with the feature schema in `schema.json` beside them. Images: one `.npz` per
    request (`images`: the batch as the model took it, float32 [n, channels, height, width]; `ids`)."""

    def __init__(self, directory: Path, kind: str, schema: dict[str, Any], max_inputs: int = 100_000,
                 pii: PiiSpec | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.kind, self.max_inputs = kind, max_inputs
        self.pii = pii or PiiSpec(enabled=True)
        self.logged = self.dropped = 0
        self._lock = threading.Lock()
        self._requests = 0
        atomic_write_text(self.directory / ROWS_SCHEMA_FILE, json.dumps(schema, indent=1) + "\n")
        self.rows = RequestLog(self.directory) if kind == "table" else None

    def _room(self, n: int) -> bool:
        with self._lock:
            if self.logged + n > self.max_inputs:
                self.dropped += n
                return False
            self.logged += n
            self._requests += 1
            return True

    def log_rows(self, request_id: str, rows: list[dict[str, Any]]) -> None:
        if not self._room(len(rows)):
            return
        now = round(time.time(), 3)
        for i, row in enumerate(rows):
            counts: Counter = Counter()
            features = {k: scrub_pii(v, self.pii, counts) if isinstance(v, str) else v for k, v in row.items()}
            self.rows.append_record({"id": request_id, "row": i, "time": now, "features": features}, counts)

    def log_images(self, request_id: str, images: np.ndarray) -> None:
        if not self._room(len(images)):
            return
        buf = io.BytesIO()
        np.savez(buf, images=np.asarray(images, dtype=np.float32), ids=np.array([request_id] * len(images)))
        name = f"{IMAGE_PREFIX}{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{self._requests:06d}.npz"
        atomic_write_bytes(self.directory / name, buf.getvalue())

    def status(self) -> dict[str, Any]:
        return {"directory": str(self.directory), "kind": self.kind, "inputs_logged": self.logged,
                "inputs_dropped": self.dropped, "max_inputs": self.max_inputs, "retraining": f"not available: {NO_LABELS}"}

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()

"""The logged traffic, handed back to whoever runs the server (`runyard serve --log-requests DIR
--share-traffic`): `GET /v1/traffic` seals the segment being written and lists the sealed ones (name,
records, bytes, sha256); `GET /v1/traffic/{name}` answers one segment's bytes.

Why: a model served on a provider's machine (a standing lease) logs its traffic there, inside the
lease's sandbox, while the tenant decides on retraining and pays for it. The tenant reaches its
server only through the lease's endpoint, which admits only the tenant's token, so this is how the
scrubbed log (runyard.serve.request_log: PII replaced before anything touched the disk) comes back
to its owner (runyard.maintain). Off by default: on a server anyone can reach, the log would be
everyone's.

A name is only ever one of the listed segment files (no path, no `.part`): nothing else in the
folder, and nothing outside it, can be read.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse

from runyard.serve.request_log import SEGMENT_GLOB, RequestLog

SEGMENT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}\.jsonl$")


def segments(directory: Path) -> list[dict[str, Any]]:
    """The sealed segments of a request log, oldest first, with what a copy is checked against."""
    out = []
    for path in sorted(Path(directory).glob(SEGMENT_GLOB)):
        data = path.read_bytes()
        out.append({"name": path.name, "records": data.count(b"\n"), "bytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest()})
    return out


def add_traffic_routes(app: FastAPI, request_log: RequestLog) -> None:
    """`GET /v1/traffic` and `GET /v1/traffic/{name}` over `request_log` (see the module docstring)."""

    @app.get("/v1/traffic")
    def list_traffic() -> dict[str, Any]:
        request_log.seal()  # what was logged so far becomes a sealed segment the tenant can take
        return {"object": "list", "data": segments(request_log.directory)}

    @app.get("/v1/traffic/{name}")
    def get_segment(name: str):  # type: ignore[no-untyped-def]
        path = request_log.directory / name
        if not SEGMENT_NAME.match(name) or not path.is_file():
            return JSONResponse({"error": {"message": f"no sealed traffic segment {name[:200]!r}",
                                           "type": "not_found_error", "param": "name", "code": None}}, 404)
        return FileResponse(path, media_type="application/x-ndjson")

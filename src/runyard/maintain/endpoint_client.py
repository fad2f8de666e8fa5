"""The tenant's view of its served model through the lease's endpoint: the drift monitor's judgement
and events (`GET /v1/drift`), and the logged traffic (`GET /v1/traffic`, runyard.serve.traffic_share).

Traffic is mirrored into a local folder as `<sha256 prefix>.jsonl`: content-addressed, so a segment is
copied once however often it is listed, two servers' segments (before and after a roll-out) never
collide, and a copy whose bytes do not hash to what the server listed is refused, never kept. The
folder is then a request log's folder as the retraining reads it (sealed JSONL segments)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import httpx

from runyard.errors import RunyardError
from runyard.system.files import atomic_write_bytes

MAX_SEGMENT_BYTES = 256 << 20


class EndpointError(RunyardError):
    """The lease's endpoint could not be reached or answered unexpectedly; the message says which call."""


class EndpointClient:
    """Calls to a deployment's endpoint with the tenant's bearer token."""

    def __init__(self, url: str, token: str, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def _get(self, path: str) -> httpx.Response:
        try:
            answer = self._http.get(path)
        except httpx.HTTPError as exc:
            raise EndpointError(f"{self.url}{path}: {type(exc).__name__}: {exc}") from None
        if answer.status_code != 200:
            raise EndpointError(f"{self.url}{path} answered {answer.status_code}: {answer.text[:300]}")
        return answer

    def drift(self) -> dict[str, Any]:
        """The served model's drift status: its latest judgement, the event rule and the events so far."""
        return self._get("/v1/drift").json()

    def mirror_traffic(self, folder: Path) -> int:
        """Copy the sealed traffic segments not yet in `folder`; returns how many were copied."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        copied = 0
        for segment in self._get("/v1/traffic").json().get("data", []):
            digest = str(segment.get("sha256", ""))
            if len(digest) != 64 or int(segment.get("bytes", 0)) > MAX_SEGMENT_BYTES:
                raise EndpointError(f"{self.url}/v1/traffic listed a segment it cannot have: {str(segment)[:200]}")
            target = folder / f"{digest[:20]}.jsonl"
            if target.exists():
                continue
            data = self._get(f"/v1/traffic/{segment['name']}").content
            if hashlib.sha256(data).hexdigest() != digest:
                raise EndpointError(f"traffic segment {segment['name']!r} did not arrive whole (its sha256 differs "
                                    "from the one listed); it was not kept")
            atomic_write_bytes(target, data)
            copied += 1
        return copied

"""The logged traffic handed back to whoever runs the server (`--share-traffic`): `GET /v1/traffic` seals
what was logged and lists the sealed segments with their sha256; `GET /v1/traffic/NAME` answers exactly
those bytes; nothing else in (or outside) the folder can be read; without the flag there is no such route,
and the flag without a log is refused before the model loads."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest

from runyard.serve.errors import ServeConfigError
from runyard.serve.server import ServeOptions, build_app
from runyard.system.http_thread import AppThread

from ..e2e.tiny_export import make_tiny_export


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    return make_tiny_export(tmp_path_factory.mktemp("served") / "run")


def _serve(export: Path, **options) -> tuple[AppThread, list]:
    app, closers = build_app(export, ServeOptions(kv_cache_bytes=8 << 20, **options))
    return AppThread(app, name="model-server"), closers


def test_the_sealed_log_comes_back_whole_and_nothing_else_does(export, tmp_path):
    traffic = tmp_path / "traffic"
    server, closers = _serve(export, log_requests=traffic, share_traffic=True)
    (tmp_path / "secret.jsonl").write_text("not the log's\n")
    try:
        with server, httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/v1/traffic").json()["data"] == []
            prompts = ["def load(path):", "import json as j", "call me at alice.smith@gmail.com please"]
            for prompt in prompts:
                assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
            listed = http.get("/v1/traffic").json()["data"]
            assert sum(s["records"] for s in listed) == 3
            body = b""
            for segment in listed:
                got = http.get(f"/v1/traffic/{segment['name']}")
                assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == segment["sha256"]
                body += got.content
            assert b"def load(path):" in body and b"alice.smith@gmail.com" not in body  # scrubbed at the source
            (traffic / "half.jsonl.part").write_text('{"text": "unsealed"}\n')
            for name in ("half.jsonl.part", "..%2Fsecret.jsonl", "../secret.jsonl", "nothing.jsonl", "x" * 300):
                assert http.get(f"/v1/traffic/{name}").status_code == 404, name
    finally:
        for thing in closers:
            thing.close()


def test_without_the_flag_there_is_no_route_and_the_flag_needs_a_log(export, tmp_path):
    server, closers = _serve(export, log_requests=tmp_path / "traffic")
    try:
        with server, httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/v1/traffic").status_code == 404
    finally:
        for thing in closers:
            thing.close()
    with pytest.raises(ServeConfigError, match="--share-traffic .* needs --log-requests"):
        build_app(export, ServeOptions(share_traffic=True))

"""A lease's data URLs, fetched for it by the launcher from a real HTTP server on loopback: public
addresses only unless the operator allows private ones (the metadata service, loopback and private
networks stay out of reach, redirects included), each file bounded, and the job then reads its copy
inside the sandbox with no network of its own; a URL that cannot be fetched ends the job with the
reason, before any of its code runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runyard.control.fetch import FetchError, allowed_networks, checked_address, fetch_url
from runyard.control.lease_job import LeaseFolder, url_files
from runyard.control.sandbox import SandboxPolicy, wrap_argv
from runyard.errors import EXIT_BAD_SPEC

BODY = b"tenant data fetched over http\n" * 100
LOOPBACK = allowed_networks(["127.0.0.0/8"])  # the operator's setting that lets tests use a loopback server


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/data.txt":
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)
        elif self.path == "/to-metadata":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
            self.end_headers()
        elif self.path == "/to-data":
            self.send_response(302)
            self.send_header("Location", "/data.txt")
            self.end_headers()
        elif self.path == "/endless":  # no Content-Length: the bound is enforced while reading
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"x" * (2 << 20))
        else:
            self.send_response(404)
            self.end_headers()


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "192.168.0.1", "169.254.169.254", "::1", "fd00::1",
                                     "0.0.0.0", "224.0.0.1", "::ffff:127.0.0.1", "::ffff:169.254.169.254"])
def test_private_and_special_addresses_are_refused_unless_the_operator_allows_their_network(address):
    with pytest.raises(FetchError, match="not a public address"):
        checked_address(address, 80)
    network = allowed_networks([f"{address}/{32 if '.' in address else 128}"])
    assert checked_address(address, 80, network) == address
    if address != "127.0.0.1":
        with pytest.raises(FetchError, match="not a public address"):
            checked_address(address, 80, LOOPBACK)


def test_a_url_is_fetched_whole_or_not_at_all(tmp_path, server):
    got = fetch_url(f"{server}/to-data", tmp_path / "a.txt", max_bytes=1 << 20, networks=LOOPBACK)
    assert got.bytes == len(BODY) and (tmp_path / "a.txt").read_bytes() == BODY
    with pytest.raises(FetchError, match="more than the 1000 bytes"):
        fetch_url(f"{server}/data.txt", tmp_path / "b.txt", max_bytes=1000, networks=LOOPBACK)
    with pytest.raises(FetchError, match="more than the 4096 bytes"):
        fetch_url(f"{server}/endless", tmp_path / "c.txt", max_bytes=4096, networks=LOOPBACK)
    with pytest.raises(FetchError, match="404"):
        fetch_url(f"{server}/missing", tmp_path / "d.txt", max_bytes=1000, networks=LOOPBACK)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]  # no partial file left behind


def test_a_redirect_is_checked_like_the_url(tmp_path, server):
    # The first hop is allowed (loopback, by the operator's setting); the redirect's target, the
    # cloud metadata service, is refused before any connection is made to it.
    with pytest.raises(FetchError, match="'169.254.169.254' resolves to 169.254.169.254, which is not a public"):
        fetch_url(f"{server}/to-metadata", tmp_path / "m.txt", max_bytes=1000, networks=LOOPBACK)
    with pytest.raises(FetchError, match="not a public address"):
        fetch_url(f"{server}/data.txt", tmp_path / "m.txt", max_bytes=1000)
    assert not list(tmp_path.iterdir())


def _lease(tmp_path, urls: list[str], allow_loopback: bool) -> LeaseFolder:
    folder = LeaseFolder(tmp_path / "lease-5").create()
    SandboxPolicy(lease_id=5, root=str(folder.root), data_urls=url_files(urls),
                  data_networks=["127.0.0.0/8"] if allow_loopback else [], max_fetch_bytes=1 << 20).save(folder.policy)
    return folder


def _run(folder: LeaseFolder, script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RUNYARD_DEVICES": "cpu:0", "RUNYARD_JOB_ID": "1"}
    return subprocess.run(wrap_argv([sys.executable, "-c", script], folder.policy), env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_job_reads_its_fetched_copy_without_a_network(sandboxed, tmp_path, server):
    url = f"{server}/data.txt"
    folder = _lease(tmp_path, [url], allow_loopback=True)
    script = ("import socket, sys\n"
              f"data = open({str(folder.urls / '0-data.txt')!r}, 'rb').read()\n"
              "try:\n"
              f"    socket.create_connection(('127.0.0.1', {server.rsplit(':', 1)[1]}), timeout=3)\n"
              "    print('network')\n"
              "except OSError:\n"
              "    print('no network')\n"
              "print(len(data))")
    out = _run(folder, script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["no network", str(len(BODY))]
    assert not folder.failure.exists()


@pytest.mark.parametrize(("path", "allow_loopback", "why"), [
    ("/data.txt", False, "not a public address"),
    ("/missing", True, "404"),
    ("/endless", True, "more than"),
])
def test_a_url_that_cannot_be_fetched_ends_the_job_with_the_reason(sandboxed, tmp_path, server, path, allow_loopback,
                                                                    why):
    folder = _lease(tmp_path, [f"{server}{path}"], allow_loopback=allow_loopback)
    out = _run(folder, "open('run/ran', 'w').close()")
    assert out.returncode == EXIT_BAD_SPEC
    reason = json.loads(folder.failure.read_text())["reason"]
    assert reason.startswith("a data URL could not be fetched") and why in reason
    assert not (folder.run_dir / "ran").exists(), "the job's code ran although its data was missing"

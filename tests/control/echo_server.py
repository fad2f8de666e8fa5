"""A tiny HTTP server for deployment tests: /healthz answers 200 (or 503 while the file named by
--unhealthy-if exists), /echo answers what it received (headers and body), /stream sends three
server-sent events a little apart, /exit/N exits with code N. Used as the model server behind
the serving relay, in place of `runyard serve`, where a test needs a server it can steer."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--unhealthy-if", type=Path, default=None)
    args = parser.parse_args()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a) -> None:
            pass

        def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/healthz":
                sick = args.unhealthy_if is not None and args.unhealthy_if.exists()
                self._send(503 if sick else 200, b'{"ok": %s}' % (b"false" if sick else b"true"))
            elif self.path == "/stream":
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(3):
                    chunk = f"data: {i}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                    time.sleep(0.05)
                self.wfile.write(b"0\r\n\r\n")
            elif self.path.startswith("/exit/"):
                self._send(200, b"{}")
                self.wfile.flush()
                os._exit(int(self.path.rsplit("/", 1)[1]))
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length).decode()
            echoed = {"path": self.path, "body": body, "headers": {k.lower(): v for k, v in self.headers.items()}}
            self._send(200, json.dumps(echoed).encode())

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"echo server on {args.port}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

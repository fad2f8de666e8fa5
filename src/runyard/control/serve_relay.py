"""Inside a deployment's sandbox: run `runyard serve`, and relay its port to a Unix socket.

A standing lease's deployment runs in the lease's bubblewrap sandbox like any lease job, with no
network of its own: the sandbox has a network namespace holding only a loopback interface, so the
model server cannot reach anything and nothing can reach it. The one way in is this relay. Run as

    python -m runyard.control.serve_relay SOCKET PORT -- python -m runyard serve EXPORT --port PORT ...

it starts the server (listening on the sandbox's own 127.0.0.1:PORT), listens on SOCKET -- a Unix
socket in the lease's work folder, the only folder the sandbox may write, so the same path names it
inside and out -- and copies the bytes of every connection on SOCKET to and from the server's port.
Outside, only the provider's agent connects to that socket: its tenant-facing endpoint
(`runyard.control.endpoint`) checks the lease's token first, and its health probes use it too.

The relay lives exactly as long as the server. When the server exits the relay exits too, with a code
the control plane reads as the control plane reads a job's (`control/states.classify_exit`): the
server's own code (2: refused before serving, never retried), 128+N for a server killed by signal N
(an infrastructure failure: restarted with backoff), 1 for a server that stopped by itself when
nobody asked it to, and 143 when the relay was told to stop (SIGTERM/SIGINT, passed on to the
server), so a stop for preemption or a restart is never mistaken for a job that finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from runyard.errors import EXIT_BAD_SPEC, EXIT_FAILURE
from runyard.system.processes import die_with_parent

CHUNK = 64 * 1024
STOPPED = 128 + signal.SIGTERM


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()


def relay_handler(port: int):  # type: ignore[no-untyped-def]
    """The handler of one connection on the socket: a connection to the server's port, bytes both ways."""

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            client_writer.close()  # the server is not listening yet (or any more): the caller sees a reset
            return
        try:
            await asyncio.gather(_pipe(client_reader, server_writer), _pipe(server_reader, client_writer))
        finally:
            for writer in (client_writer, server_writer):
                with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                    writer.close()

    return handle


def exit_code(returncode: int, asked_to_stop: bool) -> int:
    """The relay's exit code for a server that ended with `returncode` (negative: killed by a signal)."""
    if asked_to_stop:
        return STOPPED
    if returncode < 0:
        return 128 - returncode
    return returncode or EXIT_FAILURE


async def run(socket_path: Path, port: int, command: list[str]) -> int:
    """Start `command`, relay `socket_path` to `port` until it exits; returns the relay's exit code."""
    socket_path.unlink(missing_ok=True)  # an earlier attempt's socket
    server = await asyncio.start_unix_server(relay_handler(port), path=str(socket_path))
    os.chmod(socket_path, 0o600)
    me = os.getpid()
    # The server dies with the relay however the relay ends (inside bwrap the sandbox's pid namespace
    # ends with it anyway; an unconfined deployment has only this).
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                             preexec_fn=lambda: die_with_parent(signal.SIGKILL, expected_parent=me))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)

    async def forward_stop() -> None:
        await stop.wait()
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)

    forwarder = asyncio.create_task(forward_stop())
    try:
        returncode = await asyncio.to_thread(child.wait)
    finally:
        forwarder.cancel()
        server.close()
        socket_path.unlink(missing_ok=True)
    return exit_code(returncode, stop.is_set())


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--" or not argv[1].isdigit():
        print("usage: python -m runyard.control.serve_relay SOCKET PORT -- COMMAND [ARGS...]", file=sys.stderr)
        return EXIT_BAD_SPEC
    return asyncio.run(run(Path(argv[0]), int(argv[1]), argv[3:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The engine core: runyard's `BatchEngine` over an export in a process of its own (vLLM's engine core).

In the server's process the engine thread shares the interpreter lock with the HTTP event loop, and the
loop's work on each step's tokens was added to the step (benchmarks/results/serve_profile.md). Here the
steps have an interpreter to themselves; the server (serve/engine_process.py) keeps HTTP, tokenization of
prompts and the requests' bookkeeping.

The two talk over two pipes in frames: a 4-byte length, then a pickled tuple. The pipes are private to
a parent and the child it started, never a socket, so nothing from the network is unpickled.
- server -> core: `("submit", seq_id, prompt_ids, SamplingParams)`, `("abort", seq_id)`, `("close",)`;
- core -> server: `("ready", facts)` once the model is loaded (and compiled), `("failed", kind, message)`
  when it cannot be, then `("events", [SeqEvent, ...], state)` after each step's hand-over, where state
  is the engine's failure (None while it runs) and its recent sequence duration.

The core ends when told to close, or when its command pipe closes (the server is gone), and also by
the parent-death signal the server sets (system/processes.py): never an orphan holding a model. SIGINT and
SIGTERM do not end it (`main`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pickle
import signal
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

from runyard.errors import RunyardError
from runyard.model.hf.export import export_eos_ids, load_export
from runyard.serve.batch_engine import DEFAULT_KV_CACHE_BYTES, BatchEngine
from runyard.serve.scheduler import SchedulerConfig
from runyard.serve.sequence import SeqEvent

log = logging.getLogger("runyard.serve")

_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class CoreOptions:
    """How the core builds its engine (serve/server.py's ServeOptions, the engine's part)."""

    device: str = "cpu"
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    max_batch: int = 64
    max_prefill_tokens: int = 4096
    compile: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def write_frame(out: BinaryIO, message: tuple) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_LENGTH.pack(len(body)) + body)
    out.flush()


def read_frame(source: BinaryIO) -> tuple | None:
    """The next frame, or None when the pipe has closed (a frame cut short counts as closed). `source` must
    be buffered: a raw pipe's read returns what has arrived, part of a frame larger than the pipe's buffer."""
    head = source.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    body = source.read(length)
    if len(body) < length:
        return None
    return pickle.loads(body)  # noqa: S301 - our own child's private pipe (module docstring)


class _Outbox:
    """A step's events, collected from the sinks and sent as one frame once the step hands them over."""

    def __init__(self, out: BinaryIO):
        self.out = out
        self.engine: BatchEngine | None = None
        self._events: list[SeqEvent] = []
        self._lock = threading.Lock()  # the engine thread, and the command reader ending refused submits

    def sink(self, event: SeqEvent) -> None:
        self._events.append(event)

    def send(self) -> None:
        with self._lock:
            events, self._events = self._events, []
            if not events:
                return
            state = (self.engine.failure, self.engine.mean_sequence_s)  # only an engine hands events over
            with contextlib.suppress(BrokenPipeError, ValueError):  # the server is gone: nobody to tell
                write_frame(self.out, ("events", events, state))


def build_batch_engine(
    export_dir: Path, options: CoreOptions, *, max_queue: int, on_delivered: Callable[[], None] | None = None
) -> BatchEngine:
    """runyard's engine over an export, in this process (not started)."""
    model, _cfg, tokenizer = load_export(export_dir, device=options.device)
    return BatchEngine(
        model,
        tokenizer,
        eos_ids=export_eos_ids(export_dir, tokenizer) or None,  # None: the common end-of-text names
        device=options.device,
        kv_cache_bytes=options.kv_cache_bytes,
        max_batch=options.max_batch,
        max_queue=max_queue,
        scheduler=SchedulerConfig(max_prefill_tokens=options.max_prefill_tokens),
        compile=options.compile,
        on_delivered=on_delivered,
    )


def serve_commands(engine: BatchEngine, commands: BinaryIO, outbox: _Outbox) -> None:
    """Run the server's commands until it says close or goes away."""
    while (frame := read_frame(commands)) is not None:
        kind = frame[0]
        if kind == "submit":
            _, seq_id, prompt_ids, params = frame
            try:
                engine.submit(seq_id, prompt_ids, params, outbox.sink)
            except RunyardError as exc:  # the engine failed since the server last heard: end this one too
                log.warning("sequence %s refused: %s", seq_id, exc)
                outbox.sink(SeqEvent(seq_id, None, "", None, "error", len(prompt_ids), 0))
                outbox.send()
        elif kind == "abort":
            engine.abort(frame[1])
        elif kind == "close":
            return


def _ignored(signum: int, _frame) -> None:
    log.info("signal %d ignored: the server ends the engine core", signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runyard.serve.engine_core", description=__doc__.splitlines()[0])
    p.add_argument("export_dir", type=Path)
    p.add_argument("--options", required=True, help="CoreOptions as JSON")
    p.add_argument("--commands-fd", type=int, required=True, help="the pipe the server writes commands to")
    p.add_argument("--events-fd", type=int, required=True, help="the pipe this process writes events to")
    args = p.parse_args(argv)
    # The server ends the core (close, its pipe, the parent-death signal). A Ctrl-C in a terminal, or a
    # supervisor's SIGTERM to the whole group, reaches the core too: left to end it, the server would see a
    # core die under it and start another while it shuts down. A no-op handler, not SIG_IGN, which the
    # compiler's worker processes would inherit.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignored)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    commands = os.fdopen(args.commands_fd, "rb")
    out = os.fdopen(args.events_fd, "wb")
    outbox = _Outbox(out)
    try:
        # The server admits (it sees the requests first), so the core's own queue is unbounded.
        engine = build_batch_engine(args.export_dir, CoreOptions(**json.loads(args.options)), max_queue=sys.maxsize,
                                    on_delivered=outbox.send)
        outbox.engine = engine
    except Exception as exc:  # the server raises it again, by kind, with this message
        write_frame(out, ("failed", type(exc).__name__, str(exc)))
        return 2
    facts: dict[str, Any] = {"n_slots": engine.n_slots, "context_length": engine.context_length,
                             "vocab_size": engine.vocab_size, "eos_ids": sorted(engine.eos_ids)}
    write_frame(out, ("ready", facts))
    engine.start()
    try:
        serve_commands(engine, commands, outbox)
    finally:
        engine.close()  # what is still queued or running ends as 'abort', sent before the pipe closes
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The server's side of an engine core in its own process (serve/engine_core.py): the `Engine` the HTTP
layer uses (serve/inflight.py), with the steps run by a child process.

The server keeps what it needs without asking the core: the tokenizer (prompts are encoded and checked
here, so a bad one is refused before it is sent), which sequences are waiting or running, and admission.
A reader thread takes the core's frames and hands each event to its sequence's sink, as the engine
thread does in-process.

If the core dies (killed, out of memory), every sequence in flight ends with finish reason 'error', the
engine reports the failure (`/healthz` answers 503, so a load balancer takes the replica out) and new
requests are refused with EngineUnavailable: as a failed step does in-process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

from tokenizers import Tokenizer

from runyard.model.hf.export import TOKENIZER_FILE, ExportError, language_model_export_config
from runyard.serve.batch_engine import admit, checked_prompt
from runyard.serve.engine_core import CoreOptions, read_frame, write_frame
from runyard.serve.errors import EngineUnavailable, ServeConfigError
from runyard.serve.sampling import SamplingParams
from runyard.serve.sequence import SeqEvent, Sink
from runyard.system.processes import popen_dying_with_me

log = logging.getLogger("runyard.serve")

CLOSE_TIMEOUT_S = 30.0  # for the core to end its sequences and exit before it is killed
_RAISED_AGAIN = {cls.__name__: cls for cls in (ExportError, ServeConfigError)}  # the core's load errors, by kind


class EngineProcess:
    """An `Engine` whose steps run in a child process; built when its model is loaded (and compiled)."""

    def __init__(self, export_dir: Path, options: CoreOptions, *, max_queue: int = 256):
        export_dir = Path(export_dir)
        language_model_export_config(export_dir)  # the core checks its files as it loads them
        try:
            self.tokenizer = Tokenizer.from_file(str(export_dir / TOKENIZER_FILE))
        except Exception as exc:
            raise ExportError(f"{export_dir / TOKENIZER_FILE} cannot be loaded: {exc}") from None
        self.max_queue = max_queue
        self._sinks: dict[str, Sink] = {}
        # Sequences with at least one event (running, not waiting): their prompt and completion tokens so far.
        self._progress: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()  # the sinks and counts, and the command pipe
        self._failed: str | None = None
        self._closing = False
        self._mean_seq_s = 1.0
        commands_read, commands_write = os.pipe()
        events_read, events_write = os.pipe()
        self._events = os.fdopen(events_read, "rb", buffering=0)
        try:
            self.proc = popen_dying_with_me(
                [sys.executable, "-m", "runyard.serve.engine_core", str(export_dir), "--options", options.to_json(),
                 "--commands-fd", str(commands_read), "--events-fd", str(events_write)],
                pass_fds=(commands_read, events_write), stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(commands_read)
            os.close(events_write)
        self._commands_file = os.fdopen(commands_write, "wb")
        facts = self._wait_ready(export_dir)
        self._n_slots: int = facts["n_slots"]
        self.context_length: int = facts["context_length"]
        self.vocab_size: int = facts["vocab_size"]
        self.eos_ids = frozenset(facts["eos_ids"])
        self._reader = threading.Thread(target=self._read_events, name="runyard-engine-core-events", daemon=True)
        self._reader.start()

    def _wait_ready(self, export_dir: Path) -> dict:
        frame = read_frame(self._events)
        if frame is not None and frame[0] == "ready":
            return frame[1]
        self._events.close()
        self._commands_file.close()
        code = self.proc.wait()
        if frame is not None and frame[0] == "failed":
            _, kind, message = frame
            raise _RAISED_AGAIN.get(kind, EngineUnavailable)(message)
        raise EngineUnavailable(f"the engine process for {export_dir} exited ({_exit_text(code)}) before it was ready")

    # -- the Engine protocol (serve/inflight.py) --------------------------------------------------

    @property
    def n_slots(self) -> int:
        return self._n_slots

    @property
    def failure(self) -> str | None:
        """Why the engine stopped (its process died, or a step failed there), if it did."""
        return self._failed

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def queue_depth(self) -> int:
        with self._lock:
            return len(self._sinks) - len(self._progress)

    def running_count(self) -> int:
        with self._lock:
            return len(self._progress)

    def check_admission(self, n_sequences: int) -> None:
        admit(self.queue_depth(), n_sequences, self.max_queue, self.n_slots, self._mean_seq_s)

    def submit(self, seq_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        prompt_ids = checked_prompt(prompt_ids, self.eos_ids, self.vocab_size, self.context_length)
        with self._lock:
            if self._failed is not None:
                raise EngineUnavailable(f"the engine stopped after an error: {self._failed}")
            self._sinks[seq_id] = sink
            self._send(("submit", seq_id, prompt_ids, params))

    def abort(self, seq_id: str) -> None:
        with self._lock:
            if seq_id in self._sinks:
                self._send(("abort", seq_id))

    def close(self) -> None:
        """Ask the core to end its sequences and exit; kill it if it does not in time."""
        with self._lock:
            self._closing = True
            self._send(("close",))
            with contextlib.suppress(BrokenPipeError):  # the core is gone already: what was buffered with it
                self._commands_file.close()
        try:
            self.proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not exit in %.0f s; killing it", CLOSE_TIMEOUT_S)
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=CLOSE_TIMEOUT_S)

    # -- the core's side --------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        """Called under the lock. A core that is gone is noticed by the reader, which ends everything."""
        if self._commands_file.closed:
            return
        with contextlib.suppress(BrokenPipeError, ValueError):
            write_frame(self._commands_file, message)

    def _read_events(self) -> None:
        while (frame := read_frame(self._events)) is not None:
            _, events, (failure, mean_seq_s) = frame
            self._mean_seq_s = mean_seq_s
            if failure is not None:
                self._failed = failure
            for event in events:
                self._deliver(event)
        code = self.proc.wait()
        self._events.close()
        with self._lock:
            if not self._closing or code != 0:
                self._failed = self._failed or f"the engine process exited ({_exit_text(code)})"
            reason = "abort" if self._closing else "error"
            left = list(self._sinks)
        if left:
            log.error("the engine process ended with %d sequence(s) in flight: they end as %r", len(left), reason)
        for seq_id in left:
            prompt_tokens, completion_tokens = self._progress.get(seq_id, (0, 0))
            self._deliver(SeqEvent(seq_id, None, "", None, reason, prompt_tokens, completion_tokens))

    def _deliver(self, event: SeqEvent) -> None:
        with self._lock:
            if event.finish_reason is None:
                self._progress[event.seq_id] = (event.prompt_tokens, event.completion_tokens)
                sink = self._sinks.get(event.seq_id)
            else:
                self._progress.pop(event.seq_id, None)
                sink = self._sinks.pop(event.seq_id, None)
        if sink is None:
            return
        try:
            sink(event)
        except Exception:  # a consumer's bug must not stop the others' events
            log.exception("sink of sequence %s failed", event.seq_id)


def _exit_text(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"

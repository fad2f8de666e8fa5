"""The server's side of an engine core in its own process (serve/engine_core.py): the `Engine` the HTTP
layer uses (serve/inflight.py), with the steps run by a child process.

The server keeps what it needs without asking the core: the tokenizer (prompts are encoded and checked
here, so a bad one is refused before it is sent), which sequences are waiting or running, and admission.
A reader thread takes the core's frames and hands each event to its sequence's sink, as the engine
thread does in-process.

If the core dies (killed, out of memory), every sequence in flight ends with finish reason 'error' and a
new core is started: until it is ready the engine reports the failure (`/healthz` answers 503, so a load
balancer takes the replica out) and new requests are refused with EngineUnavailable. A core that keeps
dying is left dead. A step that fails inside the core fails the engine as it does in-process (the core
says so with its events), and is not restarted: the same step would fail again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
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
MAX_RESTARTS, RESTART_WINDOW_S = 3, 600.0  # a core that keeps dying is left dead: the replica reports it
_RAISED_AGAIN = {cls.__name__: cls for cls in (ExportError, ServeConfigError)}  # the core's load errors, by kind


class _Core:
    """One engine core process and the two pipes to it."""

    def __init__(self, export_dir: Path, options: CoreOptions):
        self.export_dir = export_dir
        commands_read, commands_write = os.pipe()
        events_read, events_write = os.pipe()
        try:
            # The kernel kills the core when the thread starting it ends: the server's main thread, or the
            # reader thread restarting it, which lives until the engine closes.
            self.proc = popen_dying_with_me(
                [sys.executable, "-m", "runyard.serve.engine_core", str(export_dir), "--options", options.to_json(),
                 "--commands-fd", str(commands_read), "--events-fd", str(events_write)],
                pass_fds=(commands_read, events_write), stdin=subprocess.DEVNULL,
            )
        except BaseException:
            for fd in (commands_write, events_read):
                os.close(fd)
            raise
        finally:
            os.close(commands_read)
            os.close(events_write)
        self.events = os.fdopen(events_read, "rb")
        self.commands = os.fdopen(commands_write, "wb")

    def wait_ready(self) -> dict:
        """The core's facts once its model is loaded; raises (the core's own error, by kind) if it never is."""
        frame = read_frame(self.events)
        if frame is not None and frame[0] == "ready":
            return frame[1]
        code = self.end()
        if frame is not None and frame[0] == "failed":
            _, kind, message = frame
            raise _RAISED_AGAIN.get(kind, EngineUnavailable)(message)
        raise EngineUnavailable(f"the engine process for {self.export_dir} exited ({_exit_text(code)}) before it "
                                "was ready")

    def send(self, message: tuple) -> None:
        """A core that is gone is noticed by the reader, which ends everything."""
        if self.commands.closed:
            return
        with contextlib.suppress(BrokenPipeError, ValueError):
            write_frame(self.commands, message)

    def close_commands(self) -> None:
        with contextlib.suppress(BrokenPipeError):  # the core is gone already: what was buffered with it
            self.commands.close()

    def stop(self, timeout_s: float) -> int:
        """Wait for the core to exit, killing it after `timeout_s`; its exit code."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not exit in %.0f s; killing it", timeout_s)
            self.proc.kill()
            return self.proc.wait()

    def end(self) -> int:
        """After the core's events have ended: wait for it to exit, close the pipes; its exit code."""
        self.close_commands()
        code = self.proc.wait()
        self.events.close()
        return code


class EngineProcess:
    """An `Engine` whose steps run in a child process; built when its model is loaded (and compiled).

    A core that dies is started again (at most MAX_RESTARTS times in RESTART_WINDOW_S): meanwhile the engine
    reports the failure, so requests get 503 and `/healthz` answers 503, until the new core is ready."""

    def __init__(self, export_dir: Path, options: CoreOptions, *, max_queue: int = 256):
        self.export_dir, self.options = Path(export_dir), options
        language_model_export_config(self.export_dir)  # the core checks its files as it loads them
        try:
            self.tokenizer = Tokenizer.from_file(str(self.export_dir / TOKENIZER_FILE))
        except Exception as exc:
            raise ExportError(f"{self.export_dir / TOKENIZER_FILE} cannot be loaded: {exc}") from None
        self.max_queue = max_queue
        self._sinks: dict[str, Sink] = {}
        # Sequences with at least one event (running, not waiting): their prompt and completion tokens so far.
        self._progress: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()  # the sinks and counts, the current core and its command pipe
        self._failed: str | None = None
        self._closing = False
        self._mean_seq_s = 1.0
        self._restarts: list[float] = []
        self._core = _Core(self.export_dir, options)
        facts = self._core.wait_ready()
        self._n_slots: int = facts["n_slots"]
        self.context_length: int = facts["context_length"]
        self.vocab_size: int = facts["vocab_size"]
        self.eos_ids = frozenset(facts["eos_ids"])
        self._reader = threading.Thread(target=self._read_events, name="runyard-engine-core-events", daemon=True)
        self._reader.start()

    @property
    def proc(self) -> subprocess.Popen:
        """The current core's process."""
        return self._core.proc

    # -- the Engine protocol (serve/inflight.py) --------------------------------------------------

    @property
    def n_slots(self) -> int:
        return self._n_slots

    @property
    def failure(self) -> str | None:
        """Why the engine is not serving (its process died and is restarting or could not be, or a step
        failed there), if it is not."""
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
                raise EngineUnavailable(f"the engine is not serving: {self._failed}")
            if self._closing:
                raise EngineUnavailable("the engine is shutting down")
            self._sinks[seq_id] = sink
            self._core.send(("submit", seq_id, prompt_ids, params))

    def abort(self, seq_id: str) -> None:
        with self._lock:
            if seq_id in self._sinks:
                self._core.send(("abort", seq_id))

    def close(self) -> None:
        """Ask the core to end its sequences and exit; kill it if it does not in time."""
        with self._lock:
            self._closing = True
            core = self._core
            core.send(("close",))
            core.close_commands()
        core.stop(CLOSE_TIMEOUT_S)  # the reader reads its last events and closes its pipe
        self._reader.join(timeout=CLOSE_TIMEOUT_S)

    # -- the core's side --------------------------------------------------------------------------

    def _read_events(self) -> None:
        """The reader thread: each core's events until it ends, then a new core when one may be started."""
        while True:
            core = self._core
            while (frame := read_frame(core.events)) is not None:
                _, events, (failure, mean_seq_s) = frame
                self._mean_seq_s = mean_seq_s
                if failure is not None:
                    self._failed = failure
                for event in events:
                    self._deliver(event)
            code = core.end()
            restart = self._end_in_flight(code)
            if not restart or not self._restart(code):
                return

    def _end_in_flight(self, code: int) -> bool:
        """After a core ended: end the sequences it left, and say whether to start another."""
        with self._lock:
            closing = self._closing
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S]
            restart = not closing and len(self._restarts) < MAX_RESTARTS
            if not closing or code != 0:
                why = f"the engine process exited ({_exit_text(code)})"
                self._failed = f"{why}; restarting it" if restart else (self._failed or why)
            left = list(self._sinks)
        reason = "abort" if closing else "error"
        if left:
            log.error("the engine process ended with %d sequence(s) in flight: they end as %r", len(left), reason)
        for seq_id in left:
            prompt_tokens, completion_tokens = self._progress.get(seq_id, (0, 0))
            self._deliver(SeqEvent(seq_id, None, "", None, reason, prompt_tokens, completion_tokens))
        return restart

    def _restart(self, code: int) -> bool:
        """Start a new core in place of one that died; whether it is serving."""
        log.warning("the engine process exited (%s); starting another", _exit_text(code))
        with self._lock:
            if self._closing:
                return False
            self._restarts.append(time.monotonic())
            try:
                core = self._core = _Core(self.export_dir, self.options)
            except OSError as exc:
                self._failed = f"the engine process exited ({_exit_text(code)}) and could not be started again: {exc}"
                return False
        try:
            core.wait_ready()
        except Exception as exc:
            self._failed = f"the engine process exited ({_exit_text(code)}) and could not be started again: {exc}"
            log.error("%s", self._failed)
            return False
        with self._lock:
            if self._closing:  # close() has told this core to close already; the loop reads its last events
                return True
            self._failed = None
        log.warning("the engine process is serving again (pid %d)", core.proc.pid)
        return True

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

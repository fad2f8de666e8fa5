"""A request in flight: its choices submitted to the engine as sequences, their events brought from
the engine thread to the event loop, and what clients see recorded in the metrics."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenizers import Tokenizer

from runyard.serve.metrics import ServerMetrics
from runyard.serve.responses import usage
from runyard.serve.sampling import SamplingParams
from runyard.serve.sequence import SeqEvent, Sink


class Engine(Protocol):
    """What the HTTP layer needs from an engine: runyard's `BatchEngine` (on a thread here), `EngineProcess` (the
    same engine in a process of its own) or the vLLM adapter."""

    tokenizer: Tokenizer
    context_length: int
    eos_ids: frozenset[int]

    @property
    def n_slots(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def queue_depth(self) -> int: ...
    def running_count(self) -> int: ...
    def check_admission(self, n_sequences: int) -> None: ...
    def submit(self, seq_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None: ...
    def abort(self, seq_id: str) -> None: ...


@dataclass
class Choice:
    prompt_ids: list[int]
    params: SamplingParams
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    logprobs: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


class LoopDispatcher:
    """Hands events from the engine thread to the event loop with one wake-up per burst rather than
    one per token: a step's events for every running request land together."""

    _by_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one per event loop

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Any]] = []
        self._scheduled = False

    @classmethod
    def for_running_loop(cls) -> LoopDispatcher:
        loop = asyncio.get_running_loop()
        dispatcher = cls._by_loop.get(loop)
        if dispatcher is None:
            dispatcher = cls._by_loop[loop] = cls(loop)
        return dispatcher

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        """Called from any thread."""
        with self._lock:
            self._pending.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for queue, item in pending:
            queue.put_nowait(item)


class InFlight:
    """One HTTP request's choices in flight, and its metrics."""

    def __init__(
        self, engine: Engine, metrics: ServerMetrics, choices: list[Choice], n_per_prompt: int, arrival: float, prefix: str
    ):
        self.engine, self.metrics, self.choices, self.arrival = engine, metrics, choices, arrival
        self.n_per_prompt = n_per_prompt
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def seq_id(self, index: int) -> str:
        return f"{self.id}-{index}"

    async def events(self) -> AsyncIterator[list[tuple[int, SeqEvent]]]:
        """Lists of (choice index, event) as the engine produces them: every event already waiting
        comes in one list, so a stream that falls behind the engine sends fewer, larger chunks (as
        vLLM's stream interval does) instead of falling further behind. Leaving early (the client
        went away) cancels the choices still running."""
        dispatcher = LoopDispatcher.for_running_loop()
        queue: asyncio.Queue[tuple[int, SeqEvent]] = asyncio.Queue()

        def sink_for(index: int) -> Sink:
            return lambda event: dispatcher.post(queue, (index, event))

        submitted = []
        try:
            for i, choice in enumerate(self.choices):
                self.engine.submit(self.seq_id(i), choice.prompt_ids, choice.params, sink_for(i))
                submitted.append(i)
                self.metrics.prompt_tokens.inc(len(choice.prompt_ids))
            remaining = len(self.choices)
            while remaining:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                for index, event in batch:
                    self._record(self.choices[index], event)
                    if event.finish_reason is not None:
                        remaining -= 1
                yield batch
        finally:
            for i in submitted:
                if self.choices[i].finish_reason is None:  # the client left before this choice ended
                    self.engine.abort(self.seq_id(i))
                    self.choices[i].finish_reason = "abort"
                    self.metrics.requests.labels("abort").inc()

    def _record(self, choice: Choice, event: SeqEvent) -> None:
        now = time.perf_counter()
        if event.token_id is not None:
            if choice.first_token_at is None:
                choice.first_token_at = now
                self.metrics.ttft.observe(now - self.arrival)
            elif choice.last_token_at is not None:
                self.metrics.itl.observe(now - choice.last_token_at)
            choice.last_token_at = now
            choice.tokens = event.completion_tokens
            self.metrics.tokens(1)
        choice.text += event.text
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
            choice.tokens = event.completion_tokens
            self.metrics.requests.labels(event.finish_reason).inc()
            self.metrics.e2e.observe(now - self.arrival)

    def usage(self) -> dict[str, int]:
        """Prompt tokens count once per prompt (not per choice), as OpenAI counts them."""
        prompt = sum(len(c.prompt_ids) for i, c in enumerate(self.choices) if i % self.n_per_prompt == 0)
        return usage(prompt, sum(c.tokens for c in self.choices))


def by_choice(batch: list[tuple[int, SeqEvent]]) -> list[tuple[int, list[SeqEvent]]]:
    """A batch of events grouped by choice, choices in order of their first event."""
    groups: dict[int, list[SeqEvent]] = {}
    for index, event in batch:
        groups.setdefault(index, []).append(event)
    return list(groups.items())

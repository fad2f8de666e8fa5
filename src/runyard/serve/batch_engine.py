"""The serving engine: many requests through one model by continuous batching.

One loop, one step at a time (vLLM's shape): drain new requests and cancellations, ask the scheduler
(serve/scheduler.py, a pure function of the queue and the free KV slots) which prompts, or chunks of
prompts, are prefilled this step, then run ONE forward over a flat row of tokens: the next token of
every decoding sequence, each at its own position, followed by the prompt chunks (chunked prefill:
a new request costs its prompt's tokens inside the step, not a forward of its own between steps).
Sequences join and leave the decode batch at every step; a finished or cancelled one frees its KV
slot at once (the last running sequence moves into it, so the batch stays one contiguous view of the
pool).

KV memory is a fixed budget allocated once (`KVPool`): `kv_cache_bytes` divided by what a sequence of
the full context needs gives the slots. Slots rather than paged blocks: on the CPU there is no paged
attention kernel, so blocks would have to be gathered into contiguous keys and values at every layer
of every step; a slot per sequence is read in place (the README and the serving note give the numbers).

The loop runs in its own thread (`start`); each sequence reports through its `sink` callback (called
from the engine thread, all of a step's events once the step is done) one `SeqEvent` per token.
Without the thread, `step` and `generate` drive it directly (tests, benchmarks).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch
from tokenizers import Tokenizer

from runyard.model.kv_cache import KVPool, PrefillChunk
from runyard.model.transformer import Transformer
from runyard.serve.decode_graph import DecodeGraph
from runyard.serve.detokenize import IncrementalDetokenizer, StopScanner
from runyard.serve.engine import find_eos_id
from runyard.serve.errors import EngineUnavailable, InvalidRequest, QueueFull
from runyard.serve.sampling import SamplingParams, TokenLogprobs, new_generator, sample_batch
from runyard.serve.scheduler import SchedulerConfig, WaitingSequence, schedule
from runyard.serve.sequence import Completion, SeqEvent, SequenceState, Sink

log = logging.getLogger("runyard.serve")

DEFAULT_KV_CACHE_BYTES = 512 * 1024 * 1024


def checked_prompt(prompt_ids: Sequence[int], eos_ids: frozenset[int], vocab_size: int, context_length: int) -> list[int]:
    """The prompt an engine runs for `prompt_ids`, or InvalidRequest naming what is wrong with it. An empty
    prompt starts as if at a document boundary (the end-of-text token)."""
    if not prompt_ids:
        if not eos_ids:
            raise InvalidRequest("the prompt encodes to no tokens and the model has no end-of-text token", "prompt")
        return [min(eos_ids)]
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if len(prompt_ids) >= context_length:
        raise InvalidRequest(
            f"the prompt has {len(prompt_ids)} tokens; the model's context is {context_length}, "
            "which must hold the prompt and at least one new token",
            "prompt",
        )
    return list(prompt_ids)


def admit(depth: int, n_sequences: int, max_queue: int, n_slots: int, mean_sequence_s: float) -> None:
    """Raise QueueFull when `n_sequences` more would push a queue of `depth` past `max_queue`; its
    Retry-After is roughly when a slot's worth of the queue will have drained."""
    if depth + n_sequences > max_queue:
        waves = (depth + n_sequences) / max(1, n_slots)
        raise QueueFull(depth, max_queue, max(1, round(waves * mean_sequence_s)))


class BatchEngine:
    """Continuous batching over a `Transformer` and its tokenizer."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        device: str | torch.device = "cpu",
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        max_batch: int = 64,
        max_queue: int = 256,
        scheduler: SchedulerConfig | None = None,
        dtype: torch.dtype | None = None,
        compile: bool = False,
        eos_ids: set[int] | None = None,
        on_delivered: Callable[[], None] | None = None,
    ):
        """`on_delivered`: called on the engine thread after each hand-over of events to their sinks (the
        engine core's process sends them on together, serve/engine_core.py)."""
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.tokenizer = tokenizer
        cfg = model.cfg
        self.context_length, self.vocab_size = cfg.context_length, cfg.vocab_size
        per_slot = KVPool.bytes_per_slot(cfg.n_layers, cfg.n_kv_heads, cfg.context_length, cfg.head_dim, self.dtype)
        n_slots = min(max_batch, kv_cache_bytes // per_slot)
        if n_slots < 1:
            raise EngineUnavailable(
                f"a KV cache budget of {kv_cache_bytes} bytes holds no sequence: one of the full context "
                f"({cfg.context_length} positions) needs {per_slot} bytes"
            )
        self.pool = model.new_kv_pool(n_slots, dtype=self.dtype)
        self.max_queue = max_queue
        self.scheduler = scheduler or SchedulerConfig()
        # torch.compile is optional, and its first calls take a while. On a GPU the whole model is compiled;
        # on CPU the decode-only steps are (decode_graph.py): a dynamic graph of the whole model, rebuilt
        # around each step's differently shaped KV view, ran slower there than eager.
        on_cpu = self.device.type == "cpu"
        self.forward = torch.compile(self.model, dynamic=True) if compile and not on_cpu else self.model
        self.decode_graph = DecodeGraph(self.model, self.pool) if compile and on_cpu else None
        default_eos = find_eos_id(tokenizer)
        self.eos_ids = frozenset(eos_ids if eos_ids is not None else ({default_eos} - {None}))

        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # decoding; running[i] sits in KV slot i
        self.prefilling: SequenceState | None = None  # a prompt cut short by the step's budget, in slot len(running)
        self._joining: list[SequenceState] = []  # taken from the queue for the step in progress
        self._outbox: list[tuple[SequenceState, SeqEvent]] = []  # events not yet delivered (see _deliver)
        self._on_delivered = on_delivered
        self._incoming: list[SequenceState] = []
        self._aborts: set[str] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failed: str | None = None
        self._mean_seq_s = 1.0  # recent sequence duration, for Retry-After
        self.steps = 0
        self.generated_tokens = 0

    # -- what the HTTP layer calls (any thread) ---------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    @property
    def n_slots(self) -> int:
        return self.pool.n_slots

    def queue_depth(self) -> int:
        """Sequences waiting for a slot (submitted, prefill not yet begun)."""
        with self._cond:
            return len(self._incoming) + len(self.waiting)

    def running_count(self) -> int:
        return len(self.running)

    @property
    def mean_sequence_s(self) -> float:
        """How long a recent sequence took from its prefill to its end (for Retry-After)."""
        return self._mean_seq_s

    @property
    def failure(self) -> str | None:
        """Why the engine stopped, if a step failed (it then refuses new sequences)."""
        return self._failed

    def stats(self) -> dict[str, int]:
        """Queue, batch and cancellation counts, and work done so far."""
        with self._cond:
            waiting, aborts = len(self._incoming) + len(self.waiting), len(self._aborts)
        running = len(self.running) + (self.prefilling is not None)
        return {"waiting": waiting, "running": running, "aborts_pending": aborts, "kv_slots": self.n_slots,
                "steps": self.steps, "generated_tokens": self.generated_tokens}

    def check_admission(self, n_sequences: int) -> None:
        """Raise QueueFull when `n_sequences` more would push the queue past its bound."""
        admit(self.queue_depth(), n_sequences, self.max_queue, self.n_slots, self._mean_seq_s)

    def submit(self, seq_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        """Queue one sequence. Its events go to `sink` from the engine thread."""
        if self._failed is not None:
            raise EngineUnavailable(f"the engine stopped after an error: {self._failed}")
        prompt_ids = checked_prompt(prompt_ids, self.eos_ids, self.vocab_size, self.context_length)
        seq = SequenceState(
            seq_id=seq_id,
            prompt_ids=prompt_ids,
            params=params,
            sink=sink,
            generator=new_generator(params.seed),
            detok=IncrementalDetokenizer(self.tokenizer, prompt_ids),
            scanner=StopScanner(params.stop),
        )
        with self._cond:
            self._incoming.append(seq)
            self._cond.notify()

    def abort(self, seq_id: str) -> None:
        """Cancel a sequence (its client went away): it leaves the batch, and frees its slot, at the
        next step."""
        with self._cond:
            self._aborts.add(seq_id)
            self._cond.notify()

    def start(self) -> BatchEngine:
        """Run the step loop in a background thread until `close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="runyard-engine", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the loop; every sequence still queued or running ends with finish reason 'abort'."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        self._end_all("abort")

    # -- the loop ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._incoming or self._aborts or self._has_work()):
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as exc:  # a bug or out-of-memory: end every sequence rather than hang them
                log.exception("engine step failed; ending all sequences")
                self._failed = f"{type(exc).__name__}: {exc}"
                self._end_all("error")
                return

    def _has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling is not None)

    def _end_all(self, reason: str) -> None:
        """End every sequence queued, prefilling or running (each once) with `reason`."""
        seen: set[int] = set()
        for seq in itertools.chain(self._take_incoming(), self.waiting, self._joining, [self.prefilling], self.running):
            if seq is not None and id(seq) not in seen and seq.finish_reason is None:
                seen.add(id(seq))
                self._finish(seq, reason, "")
        self.waiting.clear()
        self.running.clear()
        self._joining = []
        self.prefilling = None
        self._deliver()

    def _take_incoming(self) -> list[SequenceState]:
        with self._cond:
            incoming, self._incoming = self._incoming, []
            return incoming

    def step(self) -> bool:
        """One step: cancellations, the scheduler's prefill chunks, and one forward over the decoding
        sequences' next tokens and those chunks. Returns whether there is still work queued or running."""
        self.waiting.extend(self._take_incoming())
        with self._cond:
            aborts, self._aborts = self._aborts, set()
        if aborts:
            self._apply_aborts(aborts)
        partial = self.prefilling
        free = self.n_slots - len(self.running) - (partial is not None)
        head = itertools.islice(self.waiting, max(0, min(free, self.scheduler.max_prefill_seqs)))
        chunks = schedule(
            [WaitingSequence(s.seq_id, len(s.prompt_ids)) for s in head],
            free,
            self.scheduler,
            None if partial is None else WaitingSequence(partial.seq_id, len(partial.prompt_ids) - partial.pos),
        )
        prefill = []
        for chunk in chunks:
            seq = partial if partial is not None and chunk.seq_id == partial.seq_id else self.waiting.popleft()
            prefill.append((seq, chunk.tokens))
        forwarded = bool(self.running or prefill)
        if forwarded:
            self._joining = [seq for seq, _ in prefill]  # ended by the failure handler if the forward fails
            self._forward(prefill)  # hands the last step's events over as its compute starts
            self._joining = []
            self._release_finished()
        self.steps += 1
        if not (forwarded and self._has_work()):
            self._deliver()  # else the next step's forward hands this one's events over
        return self._has_work()

    def _apply_aborts(self, aborts: set[str]) -> None:
        kept = deque()
        for seq in self.waiting:
            if seq.seq_id in aborts:
                self._finish(seq, "abort", "")
            else:
                kept.append(seq)
        self.waiting = kept
        if self.prefilling is not None and self.prefilling.seq_id in aborts:
            self._finish(self.prefilling, "abort", "")
            self.prefilling = None  # its slot (len(running)) is simply free again
        for seq in self.running:
            if seq.seq_id in aborts and seq.finish_reason is None:
                self._finish(seq, "abort", "")
        self._release_finished()

    @torch.inference_mode()
    def _forward(self, prefill: list[tuple[SequenceState, int]]) -> None:
        """One forward: a token for each running sequence (slots 0..B-1), then the prefill chunks, in
        slots B, B+1, ... (a continuing prompt is already in slot B). Samples the next token of every
        running sequence and of every prompt this step completes."""
        decoding = self.running
        n_decode = len(decoding)
        tokens = [s.last_token for s in decoding]
        logit_rows = list(range(n_decode))
        chunks, completed = [], []
        for slot, (seq, n) in enumerate(prefill, start=n_decode):
            chunks.append(PrefillChunk(slot, seq.pos, n))
            tokens.extend(seq.prompt_ids[seq.pos : seq.pos + n])
            if seq.pos + n == len(seq.prompt_ids):
                completed.append(seq)
                logit_rows.append(len(tokens) - 1)  # the prompt's last position predicts the first token
        positions, logits = [s.pos for s in decoding], None
        if self.decode_graph is not None and n_decode and not chunks:
            logits = self.decode_graph.logits(tokens, positions, before_compute=self._deliver)
        if logits is None:
            self._deliver()
            view = self.pool.step(positions, chunks)
            logits = self.forward(
                torch.tensor([tokens], device=self.device),
                kv_cache=view,
                positions=view.positions[None],
                logits_at=torch.tensor(logit_rows, dtype=torch.long, device=self.device),
            )
        for s in decoding:
            s.pos += 1
        now = time.perf_counter()
        for seq, n in prefill:
            seq.pos += n
        for seq in completed:
            seq.started = now
        last = prefill[-1][0] if prefill else None
        self.prefilling = last if last is not None and last.pos < len(last.prompt_ids) else None
        # The completed prompts sit in slots n_decode.. in order: they join the running batch there.
        self.running = decoding + completed
        if self.running:  # else the step only filled a prompt's KV
            self._sample(self.running, logits)

    def _sample(self, seqs: list[SequenceState], logits: torch.Tensor) -> None:
        tokens, logprobs = sample_batch(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for seq, token, lp in zip(seqs, tokens, logprobs, strict=True):
            self._accept(seq, token, lp)

    def _accept(self, seq: SequenceState, token: int, lp: TokenLogprobs | None) -> None:
        if token in self.eos_ids or token in seq.params.stop_token_ids:
            self._finish(seq, "stop", seq.scanner.flush())  # the end-of-text token itself is not shown
            return
        seq.output_ids.append(token)
        seq.last_token = token
        self.generated_tokens += 1
        piece = seq.scanner.feed(seq.detok.step(token))
        if seq.scanner.stopped:
            self._finish(seq, "stop", piece, token, lp)
        elif len(seq.output_ids) >= seq.params.max_tokens or seq.pos + 1 >= self.pool.max_len:
            # prompt + completion fill the context (as OpenAI and vLLM count it)
            self._finish(seq, "length", piece + seq.scanner.flush(), token, lp)
        else:
            self._emit(seq, SeqEvent(seq.seq_id, token, piece, lp, None, len(seq.prompt_ids), len(seq.output_ids)))

    def _finish(
        self, seq: SequenceState, reason: str, text: str, token: int | None = None, lp: TokenLogprobs | None = None
    ) -> None:
        seq.finish_reason = reason
        if seq.started is not None and reason in ("stop", "length"):
            self._mean_seq_s = 0.9 * self._mean_seq_s + 0.1 * (time.perf_counter() - seq.started)
        self._emit(seq, SeqEvent(seq.seq_id, token, text, lp, reason, len(seq.prompt_ids), len(seq.output_ids)))

    def _emit(self, seq: SequenceState, event: SeqEvent) -> None:
        self._outbox.append((seq, event))

    def _deliver(self) -> None:
        """Hand the events waiting to their sinks, all together: a consumer on another thread (the HTTP
        event loop) is then woken once per step, not once per token.

        While another step follows, a step's events wait for that step's compute to start (`_forward`).
        The event loop a delivery wakes shares the interpreter lock with this thread. Woken while the next
        step is being prepared, its work on the tokens takes the lock at each of the preparation's small
        tensor operations, and the step waits for it. Woken as a compiled step starts (it runs without the
        lock), it works while the step computes. The events are late by the preparation (tens of
        microseconds)."""
        outbox, self._outbox = self._outbox, []
        for seq, event in outbox:
            try:
                seq.sink(event)
            except Exception:  # a consumer's bug must not stop the batch
                log.exception("sink of sequence %s failed", seq.seq_id)
        if outbox and self._on_delivered is not None:
            self._on_delivered()

    def _release_finished(self) -> None:
        """Drop finished sequences from the batch; the last running sequence moves into each freed slot,
        and a partly prefilled prompt into the slot after the last running one."""
        partial_slot = len(self.running)
        done = [i for i, s in enumerate(self.running) if s.finish_reason is not None]
        for i in reversed(done):
            last = len(self.running) - 1
            if i != last:
                self.pool.move(last, i, self.running[last].pos)
                self.running[i] = self.running[last]
            self.running.pop()
        if self.prefilling is not None and partial_slot != len(self.running):
            self.pool.move(partial_slot, len(self.running), self.prefilling.pos)

    # -- synchronous use --------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: list[SamplingParams], *, start_at_step: list[int] | None = None
    ) -> list[Completion]:
        """Run `prompts` to completion on the calling thread (the loop thread must not be running).
        `start_at_step[i]` holds prompt i back until that many steps have run (to test joins mid-batch)."""
        if self._thread is not None:
            raise RuntimeError("generate() drives the engine itself; it cannot run beside start()")
        results: dict[str, Completion] = {}

        def sink_for(seq_id: str) -> Sink:
            def sink(event: SeqEvent) -> None:
                done = results.setdefault(seq_id, Completion([], "", "", []))
                if event.token_id is not None:
                    done.token_ids.append(event.token_id)
                done.text += event.text
                if event.logprobs is not None:
                    done.logprobs.append(event.logprobs)
                if event.finish_reason is not None:
                    done.finish_reason = event.finish_reason

            return sink

        starts = start_at_step or [0] * len(prompts)
        pending = sorted(range(len(prompts)), key=lambda i: starts[i])
        step = 0
        while pending or self._has_work() or self._incoming:
            while pending and starts[pending[0]] <= step:
                i = pending.pop(0)
                self.submit(f"gen-{i}", prompts[i], params[i], sink_for(f"gen-{i}"))
            self.step()
            step += 1
        return [results[f"gen-{i}"] for i in range(len(prompts))]

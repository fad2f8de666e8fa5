"""`runyard serve --engine vllm`: the same routes, metrics and drift watch over vLLM.

vLLM serves the export directory itself, which must be a Hugging Face model directory
(`config.json` with `architectures`, safetensors weights, `tokenizer.json`): what issue 11 makes the
export. It needs a GPU and the `vllm` package, imported only here, when this engine is chosen.
Scaling out is vLLM's: `--tensor-parallel-size N` shards the model over N GPUs of one machine; more
machines run more replicas behind a load balancer (the README says how).

The adapter speaks the engine protocol of serve/openai_api.py: each sequence is one vLLM request
(n=1, its own seed), streamed back as `SeqEvent`s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from runyard.model.hf.export import export_eos_ids
from runyard.serve.engine import find_eos_id
from runyard.serve.errors import InvalidRequest, QueueFull, ServeConfigError
from runyard.serve.sampling import SamplingParams, TokenLogprobs
from runyard.serve.sequence import SeqEvent, Sink

log = logging.getLogger("runyard.serve")


def check_hf_directory(export_dir: Path) -> dict[str, Any]:
    """config.json of a Hugging Face model directory; ServeError saying what is missing otherwise."""
    config_path = Path(export_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ServeConfigError(f"vLLM needs a Hugging Face model directory; cannot read {config_path}: {exc}") from None
    if not isinstance(config, dict) or not config.get("architectures"):
        raise ServeConfigError(
            f"vLLM needs a Hugging Face model directory, and {config_path} names no 'architectures' "
            "(this is runyard's own export format; serve it with --engine runyard)"
        )
    if not (Path(export_dir) / "tokenizer.json").is_file():
        raise ServeConfigError(f"{export_dir} has no tokenizer.json")
    return config


class VllmEngine:
    """vLLM's AsyncLLMEngine behind runyard's engine protocol."""

    def __init__(
        self, export_dir: Path, *, tensor_parallel_size: int = 1, max_queue: int = 256, max_num_seqs: int = 256,
        gpu_memory_utilization: float = 0.85,
    ):
        config = check_hf_directory(export_dir)
        if not torch.cuda.is_available():
            raise ServeConfigError("--engine vllm needs a CUDA GPU, and none is available")
        try:
            import vllm  # optional extra: imported only when this engine is chosen
        except ImportError:
            raise ServeConfigError("--engine vllm needs the vllm package (pip install vllm)") from None
        self._vllm = vllm
        self.tokenizer = Tokenizer.from_file(str(Path(export_dir) / "tokenizer.json"))
        self.context_length = int(config.get("max_position_embeddings") or 2048)
        self.eos_ids = frozenset(export_eos_ids(Path(export_dir), self.tokenizer) or {find_eos_id(self.tokenizer)} - {None})
        self.max_queue, self._slots = max_queue, max_num_seqs
        args = vllm.AsyncEngineArgs(
            model=str(export_dir),
            tokenizer=str(export_dir),
            tensor_parallel_size=tensor_parallel_size,
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype="bfloat16",
        )
        self.engine = vllm.AsyncLLMEngine.from_engine_args(args)
        self._lock = threading.Lock()
        self._active: dict[str, bool] = {}  # seq id -> has produced a token (running) or not (waiting)
        self._tasks: set[asyncio.Task] = set()

    @property
    def n_slots(self) -> int:
        return self._slots

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def queue_depth(self) -> int:
        with self._lock:
            return sum(1 for started in self._active.values() if not started)

    def running_count(self) -> int:
        with self._lock:
            return sum(1 for started in self._active.values() if started)

    def check_admission(self, n_sequences: int) -> None:
        with self._lock:
            depth = len(self._active)
        if depth + n_sequences > self.max_queue + self._slots:
            raise QueueFull(depth, self.max_queue, 1)

    def submit(self, seq_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        if len(prompt_ids) >= self.context_length:
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens; the context is {self.context_length}", "prompt")
        sampling = self._vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k is not None else -1,
            seed=params.seed,
            max_tokens=params.max_tokens,
            stop=list(params.stop) or None,
            stop_token_ids=sorted(params.stop_token_ids) or None,
            logprobs=params.logprobs,
        )
        with self._lock:
            self._active[seq_id] = False
        task = asyncio.get_running_loop().create_task(self._run(seq_id, prompt_ids, sampling, sink, params))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, seq_id: str, prompt_ids: list[int], sampling, sink: Sink, params: SamplingParams) -> None:
        text_so_far, ids_so_far = "", 0
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, sampling, request_id=seq_id):
                with self._lock:
                    if seq_id in self._active:
                        self._active[seq_id] = True
                o = out.outputs[0]
                new_ids = list(o.token_ids[ids_so_far:])
                new_text = o.text[len(text_so_far):]
                ids_so_far, text_so_far = len(o.token_ids), o.text
                finished = out.finished
                for k, token in enumerate(new_ids):
                    last = k == len(new_ids) - 1
                    lp = self._logprobs(o, ids_so_far - len(new_ids) + k, token, params)
                    sink(SeqEvent(
                        seq_id, token, new_text if last else "", lp,
                        (o.finish_reason or "stop") if (finished and last) else None,
                        len(prompt_ids), ids_so_far - len(new_ids) + k + 1,
                    ))
                if finished and not new_ids:
                    sink(SeqEvent(seq_id, None, new_text, None, o.finish_reason or "stop", len(prompt_ids), ids_so_far))
                if finished:
                    return
        except Exception:  # the engine failed this request: end it rather than leave it hanging
            log.exception("vLLM failed on sequence %s", seq_id)
            sink(SeqEvent(seq_id, None, "", None, "error", len(prompt_ids), ids_so_far))
        finally:
            with self._lock:
                self._active.pop(seq_id, None)

    @staticmethod
    def _logprobs(output, index: int, token: int, params: SamplingParams) -> TokenLogprobs | None:
        if params.logprobs is None or not output.logprobs or index >= len(output.logprobs):
            return None
        entry = output.logprobs[index]  # {token id: Logprob(logprob, rank, decoded_token)}
        chosen = entry.get(token)
        ranked = sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda x: -x[1])
        return TokenLogprobs(token, chosen.logprob if chosen else float("-inf"), tuple(ranked[: params.logprobs]))

    def abort(self, seq_id: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self.engine.abort(seq_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        shutdown = getattr(self.engine, "shutdown", None)
        if callable(shutdown):
            shutdown()

"""Serving throughput and latency: runyard's server against HF transformers `generate` and llama.cpp on the same weights.

The workload is fixed: prompts cut from the stdlib's sources (16 to 96 tokens) with fixed output
lengths, long-tailed as real completions are (16, 16, 16, 32, 32, 64, 128, 256 tokens in turn: mean 70,
max 256), sent by 1, 8 and 32 concurrent clients, each client
sending its next request when the last one is done (a closed loop). The tokenizer has no
end-of-text token, so every request generates exactly its output length on both sides.

- runyard engine: the continuous-batching engine in this process, driven by client threads exactly
  as HF is below (no HTTP on either side): the like-for-like comparison.
- runyard http: `runyard serve` on the export, in its own process (its engine steps in a process of its
  own, the engine core), clients streaming over HTTP (SSE); time to first token and time per output token
  are measured at the client, so they include HTTP (on a two-core machine, the server's event loop and the
  clients share the cores with the engine).
- runyard engine compiled / runyard http compiled: the same with `compile` (`runyard serve --compile`): a
  decode-only step (no prompt in it) runs as a compiled graph (serve/decode_graph.py: one for a lone
  sequence, one for several), compiled when the engine is built; steps with prompts stay eager. Measured
  at every client count, after one long request.
- HF one at a time: `LlamaForCausalLM.generate` with its KV cache, one request after another in
  arrival order (what a server without batching does).
- HF statically batched: whatever requests are waiting (up to 32) form one batch, left-padded, and
  run to the longest output in it; the next batch starts when it ends.
- llama.cpp: the export written as GGUF f32 (`runyard export-gguf`), run by llama.cpp through
  llama-cpp-python's low-level API in this process with the same threads: one context whose KV cache
  holds a sequence per client, and a loop that does what llama.cpp's server does with parallel slots
  (continuous batching): every step decodes one batch holding the next token of every running sequence
  and the whole prompt of each newly admitted one, takes each sequence's greedy token from its logits,
  and frees a finished sequence's cache at once. Measured where llama-cpp-python is installed.
Both HF modes run in this process (no HTTP: the peer pays nothing for it), fp32, SDPA attention, the
same number of torch threads as the server; token times come from a stopping-criteria hook called
after every decoding step. Inter-token latency is reported per request as time per output token
(TPOT: (last token - first token) / (tokens - 1)), the same way for both sides. Configurations run in interleaved order for `--repeats` rounds; figures
are medians over rounds, with their spread (min..max). A GPU adds vLLM's figures on the same weights.

Run: python benchmarks/serve_throughput.py   (needs `pip install -e .[bench]` for transformers and llama-cpp-python)
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import logging
import os
import queue
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, Samples, add_common_args, paired_ratio  # noqa: E402
from train_throughput import build_hf, copy_weights_to_hf  # noqa: E402  (a sibling script: the HF peer)

from runyard.data.tokenizer import tokenizer_config_for
from runyard.model.config import default_ffn_hidden
from runyard.model.hf.export import export_model
from runyard.model.hf.gguf import write_gguf
from runyard.model.transformer import ModelConfig, Transformer
from runyard.serve.batch_engine import BatchEngine, SeqEvent
from runyard.serve.sampling import SamplingParams
from runyard.system.http_thread import free_port
from runyard.system.processes import popen_dying_with_me

# A special token runyard's export does not name (so both sides generate every requested token), named as
# the end-of-sequence token only in the export the GGUF file is written from (GGUF needs one).
GGUF_EOS = "<|bench-eos|>"
# Long-tailed, as real completions are (most short, a few long): the waste static batching pays for.
OUTPUT_LENGTHS = (16, 16, 16, 32, 32, 64, 128, 256)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends (at least 16 in all)")
    add_common_args(p, repeats=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads, the same for both sides")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


@dataclass
class Result:
    """One configuration's run: per-request time to first token, time per output token and latency."""

    wall_s: float = 0.0
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def make_tokenizer(vocab: int) -> tuple[Tokenizer, list[str]]:
    """A byte-level BPE tokenizer trained on stdlib sources (no end-of-text token runyard or HF stops at), and
    those texts."""
    std = sysconfig.get_paths()["stdlib"]
    texts = [Path(f).read_text(encoding="utf-8") for f in sorted(glob.glob(f"{std}/email/*.py") + glob.glob(f"{std}/json/*.py"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=[GGUF_EOS],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok, texts


def make_workload(tok: Tokenizer, texts: list[str], n: int, seed: int) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs: prompts of 16 to 96 tokens cut from the texts."""
    rng = np.random.default_rng(seed)
    stream = np.concatenate([tok.encode(t).ids for t in texts])
    out = []
    for i in range(n):
        length = int(rng.integers(16, 97))
        start = int(rng.integers(0, len(stream) - length))
        out.append((stream[start : start + length].tolist(), OUTPUT_LENGTHS[i % len(OUTPUT_LENGTHS)]))
    return out


# -- runyard: a real server process and streaming HTTP clients ---------------------------------------


class RunyardServer:
    def __init__(self, export_dir: Path, threads: int, max_batch: int, extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        # A file, not a pipe nobody reads: a full pipe would stall the server. Closed in close().
        self.log = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = popen_dying_with_me(  # SIGTERM when this benchmark dies, however it dies
            [sys.executable, "-m", "runyard", "serve", str(export_dir), "--port", str(self.port),
             "--max-batch", str(max_batch), "--max-queue", "4096", *extra],
            signal.SIGTERM, env=env, stdout=subprocess.DEVNULL, stderr=self.log,
        )
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"runyard serve exited: {self.log.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("runyard serve did not come up")
            time.sleep(0.2)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def _stream_one(url: str, prompt: list[int], n: int, result: Result) -> None:
    """One streaming completion over a plain HTTP/1.1 connection. A lean client: on a two-core machine
    a heavy one would take CPU from the server it is measuring, so it reads whatever has arrived in one
    call (not line by line) and stamps every event that came in that read with the read's time."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    sent = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    first = last = None
    tokens = 0
    status = (await reader.readline()).split()[1]
    if status != b"200":
        raise RuntimeError(f"runyard answered {status.decode()}: {(await reader.read()).decode()[:500]}")
    pending = b""
    while data := await reader.read(1 << 16):
        now = time.perf_counter()
        # Whole lines only; chunked-encoding size lines and headers are not "data: " lines.
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            if b'"usage"' in line and b'"choices":[]' in line.replace(b" ", b""):
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                continue
            last = now
            first = first or now
    writer.close()
    result.output_tokens += tokens
    result.ttft_s.append(first - sent)
    result.tpot_s.append((last - first) / max(1, tokens - 1))
    result.latency_s.append(last - sent)


def run_runyard(url: str, workload: list[tuple[list[int], int]], clients: int) -> Result:
    async def main() -> Result:
        result = Result()
        jobs: asyncio.Queue = asyncio.Queue()
        for item in workload:
            jobs.put_nowait(item)

        async def worker() -> None:
            while not jobs.empty():
                prompt, n = jobs.get_nowait()
                await _stream_one(url, prompt, n, result)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        result.wall_s = time.perf_counter() - start
        return result

    return asyncio.run(main())


def run_engine(engine: BatchEngine, workload: list[tuple[list[int], int]], clients: int) -> Result:
    """runyard's engine in this process, driven by client threads like HF's (no HTTP on either side)."""
    result = Result()
    pending = list(workload)
    lock = threading.Lock()

    def client(k: int) -> None:
        while True:
            with lock:
                if not pending:
                    return
                prompt, n = pending.pop(0)
            done = threading.Event()
            times: list[float] = []

            def sink(event: SeqEvent, times: list[float] = times, done: threading.Event = done) -> None:
                if event.token_id is not None:
                    times.append(time.perf_counter())
                if event.finish_reason is not None:
                    done.set()

            sent = time.perf_counter()
            engine.submit(f"c{k}-{len(pending)}", prompt, SamplingParams(max_tokens=n, temperature=0), sink)
            done.wait()
            with lock:
                result.ttft_s.append(times[0] - sent)
                result.tpot_s.append((times[-1] - times[0]) / max(1, len(times) - 1))
                result.latency_s.append(times[-1] - sent)
                result.output_tokens += len(times)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.wall_s = time.perf_counter() - start
    return result


# -- HF transformers generate, one at a time or statically batched -----------------------------------


def run_hf(model, workload: list[tuple[list[int], int]], clients: int, static: bool, pad_id: int) -> Result:
    from transformers import StoppingCriteria, StoppingCriteriaList  # optional extra (bench)

    class StepTimes(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    result = Result()
    requests: queue.Queue = queue.Queue()
    pending = list(workload)
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not pending:
                    return
                prompt, n = pending.pop(0)
            done = threading.Event()
            requests.put((prompt, n, time.perf_counter(), done))
            done.wait()

    def serve_batch(batch) -> None:
        longest = max(len(p) for p, *_ in batch)
        ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, (p, *_rest) in enumerate(batch):
            ids[i, longest - len(p) :] = torch.tensor(p)  # left padding, as decoder-only generation needs
            mask[i, longest - len(p) :] = 1
        steps = StepTimes()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(n for _, n, *_ in batch),
                           do_sample=False, use_cache=True, pad_token_id=pad_id, eos_token_id=None,
                           stopping_criteria=StoppingCriteriaList([steps]))
        for _p, n, arrived, done in batch:
            times = steps.times[:n]
            result.ttft_s.append(times[0] - arrived)
            result.tpot_s.append((times[-1] - times[0]) / max(1, len(times) - 1))
            result.latency_s.append(times[-1] - arrived)
            result.output_tokens += len(times)
            done.set()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    served = 0
    while served < len(workload):
        batch = [requests.get()]
        if static:
            time.sleep(0.002)  # let the other waiting clients' requests land in this batch
            while len(batch) < 32:
                try:
                    batch.append(requests.get_nowait())
                except queue.Empty:
                    break
        serve_batch(batch)
        served += len(batch)
    result.wall_s = time.perf_counter() - start
    for t in threads:
        t.join()
    return result


# -- llama.cpp: continuous batching over one context's sequences ---------------------------------------


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401  (optional: the bench extra builds it from source)
    except ImportError:
        return False
    return True


class LlamaCppEngine:
    """A GGUF model in llama.cpp with a KV cache of `max_seqs` sequences of `context` tokens each, served
    greedily by continuous batching (see the module docstring)."""

    def __init__(self, path: Path, threads: int, max_seqs: int, context: int, max_batch_tokens: int = 2048):
        import llama_cpp as lc  # optional extra (bench)

        # llama.cpp's own log (hundreds of loading lines on stderr) down to errors, as Llama(verbose=False) sets it.
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        self.lc = lc
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lc.llama_context_default_params()
        params.n_ctx = max_seqs * context
        params.n_batch = params.n_ubatch = max_batch_tokens
        params.n_seq_max = max_seqs
        params.kv_unified = True  # one pool shared by the sequences, as runyard's slots share its budget
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create its context")
        self.memory = lc.llama_get_memory(self.ctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.max_seqs, self.max_batch_tokens = max_seqs, max_batch_tokens
        self.batch = lc.llama_batch_init(max_batch_tokens, 0, 1)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def run(self, workload: list[tuple[list[int], int]], clients: int) -> Result:
        """Closed-loop clients in threads (as for runyard's engine and HF); this thread runs the engine."""
        result = Result()
        requests: queue.Queue = queue.Queue()
        pending = list(workload)
        lock = threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    if not pending:
                        return
                    prompt, n = pending.pop(0)
                done = threading.Event()
                requests.put((prompt, n, time.perf_counter(), done))
                done.wait()

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        free, running, served = list(range(self.max_seqs)), {}, 0
        while served < len(workload):
            while free and (not requests.empty() or not running):
                prompt, n, arrived, done = requests.get()  # blocks only when nothing is running
                running[free.pop()] = {"feed": list(prompt), "pos": 0, "n": n, "times": [], "arrived": arrived, "done": done}
            rows = self._fill_batch(running)
            if self.lc.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            now = time.perf_counter()
            for seq, row in rows:
                state = running[seq]
                logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))
                state["times"].append(now)
                state["feed"] = [int(logits.argmax())]
                if len(state["times"]) == state["n"]:
                    times = state["times"]
                    result.ttft_s.append(times[0] - state["arrived"])
                    result.tpot_s.append((times[-1] - times[0]) / max(1, len(times) - 1))
                    result.latency_s.append(times[-1] - state["arrived"])
                    result.output_tokens += len(times)
                    self.lc.llama_memory_seq_rm(self.memory, seq, -1, -1)  # free its cache now
                    del running[seq]
                    free.append(seq)
                    served += 1
                    state["done"].set()
        result.wall_s = time.perf_counter() - start
        for t in threads:
            t.join()
        return result

    def _fill_batch(self, running: dict) -> list[tuple[int, int]]:
        """Put every running sequence's pending tokens (its next token, or its prompt) into the batch, asking
        for logits at each one's last; a prompt that does not fit waits for the next step. Returns
        (sequence, batch row) of the rows with logits."""
        b, k, rows = self.batch, 0, []
        for seq, state in running.items():
            feed = state["feed"]
            if not feed or k + len(feed) > self.max_batch_tokens:
                continue
            for j, token in enumerate(feed):
                b.token[k], b.pos[k], b.n_seq_id[k] = token, state["pos"] + j, 1
                b.seq_id[k][0] = seq
                b.logits[k] = j == len(feed) - 1
                k += 1
            rows.append((seq, k - 1))
            state["pos"] += len(feed)
            state["feed"] = []
        b.n_tokens = k
        return rows


# -- vLLM (GPU only) ----------------------------------------------------------------------------------


def vllm_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import vllm  # noqa: F401  (optional: only measured where it is installed)
    except ImportError:
        return False
    return True


# -- report -------------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


FIGURES = {
    "tokens/s": lambda r: r.tokens_per_s,
    "ttft p50 ms": lambda r: 1000 * pct(r.ttft_s, 50),
    "ttft p99 ms": lambda r: 1000 * pct(r.ttft_s, 99),
    "tpot p50 ms": lambda r: 1000 * pct(r.tpot_s, 50),
    "tpot p99 ms": lambda r: 1000 * pct(r.tpot_s, 99),
    "latency p50 ms": lambda r: 1000 * pct(r.latency_s, 50),
}


def summary(runs: list[Result]) -> dict[str, tuple[float, float, float]]:
    """median (min, max) over rounds of each figure."""
    figures = {name: [figure(r) for r in runs] for name, figure in FIGURES.items()}
    return {k: (statistics.median(v), min(v), max(v)) for k, v in figures.items()}


def build_model(args: argparse.Namespace) -> tuple[Transformer, ModelConfig, Tokenizer, list[str]]:
    """The benchmark's model (random weights from args.seed, in eval mode), its config, tokenizer and texts."""
    tok, texts = make_tokenizer(args.vocab)
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, ffn_hidden=default_ffn_hidden(args.d_model), context_length=args.context)
    torch.manual_seed(args.seed)
    return Transformer(cfg).eval(), cfg, tok, texts


def bench_tokenizer_config(cfg: ModelConfig) -> dict:
    """No eos_token: every request generates exactly its output length (see make_tokenizer)."""
    return {k: v for k, v in tokenizer_config_for(cfg.context_length).items() if k != "eos_token"}


def write_gguf_f32(model: Transformer, cfg: ModelConfig, tok_path: Path, tmp: Path) -> Path:
    """The same weights as GGUF f32, from an export that differs only in naming an end-of-sequence token
    (llama.cpp's loader needs one; no request reaches it)."""
    export = export_model(model, cfg, tok_path, tmp / "export-gguf",
                          tokenizer_config={**bench_tokenizer_config(cfg), "eos_token": GGUF_EOS})
    return write_gguf(export, tmp / "model.f32.gguf", "f32")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = Report("serve_throughput", args, packages=["transformers", "tokenizers", "gguf", "llama_cpp_python"])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop the server
    import transformers  # optional extra (bench): the peer

    torch.set_num_threads(args.threads)
    ours, cfg, tok, texts = build_model(args)
    hf = build_hf(cfg)
    copy_weights_to_hf(ours, hf)
    hf.eval()
    probe = torch.randint(0, cfg.vocab_size, (1, 32))
    with torch.no_grad():
        diff = (ours(probe) - hf(input_ids=probe, use_cache=False).logits).abs().max().item()
    print(f"model: d_model={cfg.d_model} layers={cfg.n_layers} heads={cfg.n_heads}/{cfg.n_kv_heads} vocab={cfg.vocab_size} "
          f"context={cfg.context_length}, {ours.num_parameters() / 1e6:.1f}M params, max |logit diff| vs HF {diff:.1e}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} thread(s), CPU fp32, "
          f"load average {os.getloadavg()[0]:.1f}")
    if diff > 1e-3:
        print("error: runyard and HF do not compute the same function; the comparison would be unfair")
        return 1

    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        tok_path = Path(tmp) / "tokenizer.json"
        tok.save(str(tok_path))
        export = export_model(ours, cfg, tok_path, Path(tmp) / "export", tokenizer_config=bench_tokenizer_config(cfg))
        llama = None
        if llama_cpp_available():
            llama = LlamaCppEngine(write_gguf_f32(ours, cfg, tok_path, Path(tmp)), args.threads,
                                   max_seqs=max(args.clients), context=cfg.context_length)
        else:
            print("llama.cpp: not measured (needs llama-cpp-python, in the bench extra)")
        results: dict[tuple[str, int], list[Result]] = {}
        server = RunyardServer(export, args.threads, max_batch=max(args.clients))
        engine = BatchEngine(ours, tok, max_batch=max(args.clients), max_queue=4096).start()
        # `compile` (runyard serve --compile): decode-only steps compiled (when the engine is built); a request
        # as long as the context warms both up.
        server_c = RunyardServer(export, args.threads, max_batch=max(args.clients), extra=("--compile",))
        engine_c = BatchEngine(ours, tok, max_batch=max(args.clients), max_queue=4096, compile=True).start()
        runners = {
            "runyard http": lambda w, c: run_runyard(server.url, w, c),
            "runyard engine": lambda w, c: run_engine(engine, w, c),
            "hf one at a time": lambda w, c: run_hf(hf, w, c, static=False, pad_id=0),
            "hf static batch": lambda w, c: run_hf(hf, w, c, static=True, pad_id=0),
            "runyard http compiled": lambda w, c: run_runyard(server_c.url, w, c),
            "runyard engine compiled": lambda w, c: run_engine(engine_c, w, c),
        }
        if llama is not None:
            runners["llama.cpp"] = llama.run
        try:
            warm = [(tok.encode(texts[0]).ids[:16], cfg.context_length - 17)]
            runners["runyard engine compiled"](warm, 1)
            runners["runyard http compiled"](warm, 1)
            for r in range(args.repeats):
                for clients in args.clients:
                    workload = make_workload(tok, texts, max(16, args.requests_per_client * clients), args.seed + clients)
                    modes = list(runners)
                    modes = modes[r % len(modes) :] + modes[: r % len(modes)]  # interleaved: each round starts elsewhere
                    for mode in modes:
                        res = runners[mode](workload, clients)
                        results.setdefault((mode, clients), []).append(res)
                        print(f"round {r + 1} {mode:<23} {clients:>2} clients: {res.tokens_per_s:8.0f} tokens/s "
                              f"(load average {os.getloadavg()[0]:.1f})", flush=True)
        finally:
            engine.close()
            engine_c.close()
            server.close()
            server_c.close()
            if llama is not None:
                llama.close()

    print()
    header = f"{'engine':<24}{'clients':>8}" + "".join(f"{k:>24}" for k in summary(next(iter(results.values()))))
    print(header)
    for (mode, clients), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        s = summary(runs)
        cells = "".join(f"{f'{m:.1f} ({lo:.1f}..{hi:.1f})':>24}" for m, lo, hi in s.values())
        print(f"{mode:<24}{clients:>8}{cells}")
    print("(median over rounds, min..max in brackets; 'runyard http': `runyard serve` measured at streaming HTTP "
          "clients; 'runyard engine', HF and llama.cpp: in this process, no HTTP)")

    top, one = max(args.clients), min(args.clients)

    def paired(mode: str, peer: str, clients: int, figure: str) -> Samples:
        """Per-round ratios of one figure: each round ran every mode back to back on the same machine state."""
        ours, theirs = ([FIGURES[figure](r) for r in results[(m, clients)]] for m in (mode, peer))
        return paired_ratio(Samples(ours), Samples(theirs))

    for mode in ("runyard engine", "runyard http"):
        tag = mode.split()[1]
        report.ratio(f"serve_{tag}_tokens_per_s_{top}_clients", paired(mode, "hf static batch", top, "tokens/s"),
                     f"HF generate statically batched, {top} clients", ">=", 3.0)
        report.ratio(f"serve_{tag}_request_latency_{one}_client",
                     paired(mode, "hf one at a time", one, "latency p50 ms"), "HF generate, one client", "<=", 1.1)
        report.ratio(f"serve_{tag}_time_per_output_token_{one}_client",
                     paired(mode, "hf one at a time", one, "tpot p50 ms"), "HF generate, one client", "<=", 1.1)
        if llama is not None:
            report.ratio(f"serve_{tag}_tokens_per_s_{top}_clients_vs_llama_cpp", paired(mode, "llama.cpp", top, "tokens/s"),
                         f"llama.cpp (GGUF f32, continuous batching), {top} clients", ">=", 1.0)
            report.ratio(f"serve_{tag}_time_per_output_token_{one}_client_vs_llama_cpp",
                         paired(mode, "llama.cpp", one, "tpot p50 ms"), "llama.cpp (GGUF f32), one client", "<=", 1.5)
        if llama is not None:
            report.ratio(f"serve_{tag}_compiled_time_per_output_token_{one}_client_vs_llama_cpp",
                         paired(f"{mode} compiled", "llama.cpp", one, "tpot p50 ms"),
                         "llama.cpp (GGUF f32), one client; runyard with compile (its decode steps compiled)", "<=", 1.5)
            report.ratio(f"serve_{tag}_compiled_tokens_per_s_{top}_clients_vs_llama_cpp",
                         paired(f"{mode} compiled", "llama.cpp", top, "tokens/s"),
                         f"llama.cpp (GGUF f32, continuous batching), {top} clients; runyard with compile", ">=", 1.0)
            for clients in sorted(set(args.clients) - {one, top}):
                middle = paired(f"{mode} compiled", "llama.cpp", clients, "tokens/s")
                report.note(f"{mode} compiled: tokens/s at {clients} clients over llama.cpp's: {middle.spread()} "
                            f"(eager: {paired(mode, 'llama.cpp', clients, 'tokens/s').spread()}; no target)")
        ttft = paired(mode, "hf static batch", top, "ttft p50 ms")
        report.note(f"{mode}: time to first token p50 at {top} clients over HF static batching's: {ttft.spread()} "
                    "(lower is better; no target)")
    report.note(f"1-minute load average before: {report.load_before[0]:.1f} on {os.cpu_count()} cores")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    if vllm_available():
        measure_vllm(hf, tok, texts, args)
    else:
        print("vLLM: not measured (needs a CUDA GPU and the vllm package)")
    return report.finish()


def measure_vllm(hf, tok: Tokenizer, texts: list[str], args: argparse.Namespace) -> None:
    """The same clients against `runyard serve --engine vllm` on the same weights as a Hugging Face
    directory (bf16 on the GPU, so its figures stand beside the CPU ones, not against them)."""
    with tempfile.TemporaryDirectory(prefix="serve-bench-hf-") as tmp:
        hf.config.eos_token_id = None
        hf.save_pretrained(tmp, safe_serialization=True)
        tok.save(str(Path(tmp) / "tokenizer.json"))
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        server = RunyardServer(Path(tmp), args.threads, max(args.clients), extra=("--engine", "vllm"))
        try:
            for clients in args.clients:
                runs = [run_runyard(server.url, make_workload(tok, texts, max(16, args.requests_per_client * clients), args.seed + clients),
                                    clients) for _ in range(args.repeats)]
                s = summary(runs)
                print(f"vllm (GPU) {clients:>2} clients: " + ", ".join(f"{k} {m:.1f}" for k, (m, _lo, _hi) in s.items()))
        finally:
            server.close()


if __name__ == "__main__":
    sys.exit(main())

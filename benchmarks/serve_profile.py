"""Where a decode step of runyard's serving engine goes, at 1 and 32 clients, beside llama.cpp's step.

The model, tokenizer and workload are serve_throughput.py's (same defaults, same seed), the engine is
`BatchEngine` driven synchronously (`step()` on this thread, no client threads, so nothing but the step
is timed), and clients are a closed loop: when a request finishes, the next one is submitted before
the next step. Every step is timed whole and in phases (perf_counter wrappers set on the classes by
this script, nothing in the engine changes):

- view: `KVPool.step` (the step's positions, the padding bias, the prefill masks);
- model: `Transformer.forward`, and inside it the attention of the pool (`PoolStep.attend`: writing the
  new keys and values, SDPA over the slots padded to the longest) and the linear layers;
- sample: `sample_batch` (greedy: argmax and `.tolist()`);
- accept: per-sequence bookkeeping, detokenization and the events (`_accept`), then `_deliver`;
- the rest of `step` (queue, scheduler, building the token list and its tensors, slot compaction).

With `--torch-profile`, torch.profiler's operator table for the decode-only steps is printed too.
llama.cpp (where llama-cpp-python is installed) runs the same workload through serve_throughput.py's
`LlamaCppEngine`, with `llama_decode` timed per call.

Run: python benchmarks/serve_profile.py [--clients 1 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import types
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_throughput as st  # noqa: E402  (a sibling script: the model, workload and llama.cpp peer)

from runyard.model import kv_cache, transformer
from runyard.serve import batch_engine
from runyard.serve.batch_engine import BatchEngine
from runyard.serve.sampling import SamplingParams

TIMES: dict[str, float] = defaultdict(float)


def timed(owner, name: str, label: str) -> None:
    """Wrap owner.name so its wall time adds to TIMES[label]."""
    fn = getattr(owner, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            TIMES[label] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def instrument() -> None:
    timed(kv_cache.KVPool, "step", "view")
    timed(kv_cache.PoolStep, "attend", "model.attention")
    timed(transformer.Linear, "forward", "model.linear")
    timed(transformer.Transformer, "forward", "model")
    timed(batch_engine, "sample_batch", "sample")
    timed(BatchEngine, "_accept", "accept")
    timed(BatchEngine, "_deliver", "deliver")
    timed(BatchEngine, "_release_finished", "release")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-profile", action="store_true")
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--no-runyard", action="store_true")
    p.add_argument("--llama-kv-split", action="store_true",
                   help="llama.cpp with a KV stream per sequence (kv_unified off) instead of serve_throughput.py's unified cache")
    return p.parse_args()


def drive(engine: BatchEngine, workload, clients: int, profiler=None) -> list[dict]:
    """Closed-loop clients without threads; returns one record per step."""
    pending = list(workload)
    in_flight = 0
    finished = []

    def sink(event):
        if event.finish_reason is not None:
            finished.append(event.seq_id)

    def submit():
        nonlocal in_flight
        prompt, n = pending.pop(0)
        engine.submit(f"r{len(pending)}", prompt, SamplingParams(max_tokens=n, temperature=0), sink)
        in_flight += 1

    while pending and in_flight < clients:
        submit()
    steps = []
    while in_flight:
        n_decode = len(engine.running)
        positions = [s.pos for s in engine.running]
        before = dict(TIMES)
        waiting_prefill = bool(engine.waiting or engine._incoming or engine.prefilling)
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        if profiler is not None:
            profiler.step()
        steps.append({"wall": wall, "n_decode": n_decode, "prefill": waiting_prefill,
                      "length": max(positions) + 1 if positions else 0,
                      "mean_length": statistics.fmean(positions) + 1 if positions else 0,
                      **{k: TIMES[k] - before.get(k, 0.0) for k in TIMES}})
        while finished:
            finished.pop()
            in_flight -= 1
            if pending:
                submit()
    return steps


def report_runyard(steps: list[dict], clients: int) -> None:
    decode = [s for s in steps if not s["prefill"] and s["n_decode"] > 0]
    if clients > 1:  # the steady state: the batch full (or nearly), no prompt in the step
        decode = [s for s in decode if s["n_decode"] >= clients * 3 // 4] or decode
    n = len(decode)
    wall = sum(s["wall"] for s in decode)
    tokens = sum(s["n_decode"] for s in decode)
    print(f"\nrunyard, {clients} client(s): {len(steps)} steps, {n} decode-only steps "
          f"(mean batch {tokens / max(1, n):.1f}, mean longest slot {statistics.fmean(s['length'] for s in decode):.0f}, "
          f"mean slot length {statistics.fmean(s['mean_length'] for s in decode):.0f})")
    print(f"  step wall: mean {1e3 * wall / n:.3f} ms, median {1e3 * statistics.median(s['wall'] for s in decode):.3f} ms; "
          f"{tokens / wall:.0f} tokens/s inside decode steps; all steps: "
          f"{sum(s['n_decode'] for s in steps) / sum(s['wall'] for s in steps):.0f} tokens/s")

    def part(key: str) -> float:
        return sum(s.get(key, 0.0) for s in decode)

    model, attn, lin = part("model"), part("model.attention"), part("model.linear")
    rows = [
        ("model forward", model),
        ("  attention over slots (PoolStep.attend)", attn),
        ("  linear layers (incl. lm_head)", lin),
        ("  rest of the forward (embedding, rotary, norms, SwiGLU, residuals, module calls)", model - attn - lin),
        ("KVPool.step (view, bias)", part("view")),
        ("sample_batch", part("sample")),
        ("_accept (detokenize, stop scan, events)", part("accept")),
        ("_deliver (sinks)", part("deliver")),
        ("_release_finished", part("release")),
    ]
    accounted = model + part("view") + part("sample") + part("accept") + part("deliver") + part("release")
    rows.append(("rest of step (queue, scheduler, token list, tensors)", wall - accounted))
    for name, t in rows:
        print(f"  {name:<85} {1e3 * t / n:8.3f} ms  {100 * t / wall:5.1f}%")


def llama_profile(model, cfg, tok, texts, workload_for, args) -> None:
    if not st.llama_cpp_available():
        print("\nllama.cpp: not measured (needs llama-cpp-python)")
        return
    import llama_cpp as lc

    if args.llama_kv_split:
        real_init = lc.llama_init_from_model

        def init_split(model, params, real_init=real_init):
            params.kv_unified = False
            return real_init(model, params)

        lc.llama_init_from_model = init_split
    with tempfile.TemporaryDirectory(prefix="serve-profile-") as tmp:
        tok_path = Path(tmp) / "tokenizer.json"
        tok.save(str(tok_path))
        path = st.write_gguf_f32(model, cfg, tok_path, Path(tmp))
        for clients in args.clients:
            engine = st.LlamaCppEngine(path, args.threads, max_seqs=max(args.clients), context=cfg.context_length)
            calls = []
            real = lc.llama_decode

            def decode(ctx, batch, real=real, calls=calls):
                n_tokens = batch.n_tokens
                t0 = time.perf_counter()
                rc = real(ctx, batch)
                calls.append((n_tokens, time.perf_counter() - t0))
                return rc

            engine.lc = types.SimpleNamespace(**{k: getattr(lc, k) for k in dir(lc) if not k.startswith("__")})
            engine.lc.llama_decode = decode
            try:
                engine.run(workload_for(clients), clients)  # warm
                calls.clear()
                t0 = time.perf_counter()
                res = engine.run(workload_for(clients), clients)
                total = time.perf_counter() - t0
            finally:
                engine.close()
            full = [t for k, t in calls if k >= clients * 3 // 4 and k <= clients] if clients > 1 else [t for k, t in calls if k == 1]
            print(f"\nllama.cpp, {clients} client(s): {len(calls)} llama_decode calls, {res.tokens_per_s:.0f} tokens/s "
                  f"end to end; decode-only calls ({len(full)}): llama_decode mean {1e3 * statistics.fmean(full):.3f} ms, "
                  f"median {1e3 * statistics.median(full):.3f} ms; time in llama_decode "
                  f"{100 * sum(t for _, t in calls) / total:.0f}% of the run")


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    # serve_throughput.py's model at its defaults, seeded from this script's --seed
    model, cfg, tok, texts = st.build_model(st.parse_args(["--seed", str(args.seed)]))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), model d_model={cfg.d_model} "
          f"layers={cfg.n_layers} vocab={cfg.vocab_size}")

    def workload_for(clients: int):
        return st.make_workload(tok, texts, max(16, args.requests_per_client * clients), args.seed + clients)

    instrument()
    for clients in [] if args.no_runyard else args.clients:
        engine = BatchEngine(model, tok, max_batch=max(args.clients), max_queue=4096)
        drive(engine, workload_for(clients)[:4], min(clients, 4))  # warm
        TIMES.clear()
        steps = drive(engine, workload_for(clients), clients)
        report_runyard(steps, clients)
        if args.torch_profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                n_steps = len(drive(engine, workload_for(clients), clients))
            averages = prof.key_averages()
            aten = sum(e.count for e in averages if e.key.startswith("aten::"))
            print(f"{aten / n_steps:.0f} aten operator calls per step (nested ones included), "
                  f"{sum(e.count for e in averages if e.key == 'aten::mm') / n_steps:.1f} matmuls")
            print(averages.table(sort_by="self_cpu_time_total", row_limit=25))
    if not args.no_llama:
        llama_profile(model, cfg, tok, texts, workload_for, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

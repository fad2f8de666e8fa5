"""Training throughput: runyard's Transformer against HF transformers' LlamaForCausalLM and against a
nanoGPT-style model of the same shape that fuses its projections as runyard does.

All three have the same shape (hidden size, layers, heads, kv heads, intermediate size, vocab, context,
tied embeddings); HF's uses attn_implementation="sdpa". The peers' weights are copied from runyard's, so all
start from the same point, and the script checks that their logits agree before timing anything (the same
math, not just the same shape). Each then trains with the same plain loop (forward, cross-entropy, backward,
AdamW step) on the same batches, in this process, on CPU: once in fp32 and once under CPU bf16 autocast
(`torch.autocast("cpu", torch.bfloat16)`, fp32 master weights, the loss in fp32).

- HF Llama is the framework a user would otherwise train with; its projections are separate matmuls.
- The nanoGPT-style peer (benchmarks/nanogpt_peer.py) fuses Q/K/V and gate/up like runyard and uses torch's
  own F.rms_norm and autograd for rotary and SwiGLU, so runyard / nanoGPT isolates what runyard's own
  fused ops and framework cost or save, with fusion equal on both sides.

Timing: the models alternate in interleaved rounds (order reversed every other round), each round a few
steps per model; a figure is the median round with its spread, a ratio the median of per-round ratios.

Peak memory: each model trains three steps in its own fresh subprocess, and we report its peak resident set
size minus the resident set just before the model is built (Linux: `/proc/self/clear_refs` = 5 resets the
high-water mark, `VmHWM` reads it; elsewhere `ru_maxrss`, which cannot be reset). Weights, gradients, AdamW
state, activations and allocator overhead; not the interpreter or libraries.

Run: python benchmarks/train_throughput.py [--record]   (needs the `bench` extra for transformers)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nanogpt_peer  # noqa: E402
from harness import Report, Samples, add_common_args, interleaved, paired_ratio  # noqa: E402

from runyard.model.config import default_ffn_hidden  # noqa: E402
from runyard.model.transformer import ModelConfig, Transformer  # noqa: E402

MODELS = ("runyard", "hf", "nanogpt")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=256, help="hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query attention)")
    p.add_argument("--ffn", type=int, default=None, help="SwiGLU intermediate size (default ~8/3 d_model)")
    p.add_argument("--context", type=int, default=256, help="sequence length trained on")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size")
    p.add_argument("--untied", action="store_true", help="separate output head (default: tied embeddings)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--steps-per-round", type=int, default=4, help="timed steps per model in each round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16 (CPU autocast)")
    p.add_argument("--seed", type=int, default=0, help="seed for init and batches")
    p.add_argument("--memory-only", choices=MODELS, help=argparse.SUPPRESS)
    add_common_args(p, repeats=6)
    return p.parse_args(argv)


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_hidden=args.ffn or default_ffn_hidden(args.d_model),
        context_length=args.context,
        tie_embeddings=not args.untied,
    )


def build_hf(cfg: ModelConfig) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM  # the bench extra's peer

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.context_length,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation="sdpa",
        dtype=torch.float32,
    )
    model = LlamaForCausalLM(hf_cfg)
    assert model.config._attn_implementation == "sdpa"
    return model


@torch.no_grad()
def copy_weights_to_hf(ours: Transformer, hf: torch.nn.Module) -> None:
    """Map runyard's fused projections onto HF's separate ones (same rotary convention, same layout)."""
    cfg = ours.cfg
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    hf.model.embed_tokens.weight.copy_(ours.tok_emb.weight)
    for block, layer in zip(ours.blocks, hf.model.layers, strict=True):
        q, k, v = block.attn.wqkv.weight.split([q_dim, kv_dim, kv_dim])
        layer.self_attn.q_proj.weight.copy_(q)
        layer.self_attn.k_proj.weight.copy_(k)
        layer.self_attn.v_proj.weight.copy_(v)
        layer.self_attn.o_proj.weight.copy_(block.attn.wo.weight)
        gate, up = block.ffn.w_gate_up.weight.chunk(2)
        layer.mlp.gate_proj.weight.copy_(gate)
        layer.mlp.up_proj.weight.copy_(up)
        layer.mlp.down_proj.weight.copy_(block.ffn.w_down.weight)
        layer.input_layernorm.weight.copy_(block.attn_norm.weight)
        layer.post_attention_layernorm.weight.copy_(block.ffn_norm.weight)
    hf.model.norm.weight.copy_(ours.norm.weight)
    if not cfg.tie_embeddings:
        hf.lm_head.weight.copy_(ours.lm_head.weight)


def build(name: str, cfg: ModelConfig) -> torch.nn.Module:
    if name == "runyard":
        return Transformer(cfg)
    return build_hf(cfg) if name == "hf" else nanogpt_peer.from_config(cfg)


def make_models(cfg: ModelConfig, seed: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(seed)
    ours = Transformer(cfg)
    hf = build_hf(cfg)
    copy_weights_to_hf(ours, hf)
    nano = nanogpt_peer.from_config(cfg)
    nanogpt_peer.load_from_runyard(nano, ours)
    return {"runyard": ours, "hf": hf, "nanogpt": nano}


def forward_fn(name: str, model: torch.nn.Module, precision: str = "fp32"):
    if name == "hf":
        def call(x):
            return model(input_ids=x, use_cache=False).logits
    else:
        call = model
    if precision == "fp32":
        return call

    def autocast_call(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return call(x)

    return autocast_call


def make_batches(cfg: ModelConfig, n: int, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + 1)
    data = torch.randint(0, cfg.vocab_size, (n, batch, cfg.context_length + 1), generator=g)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def train_steps(forward, opt, batches, vocab: int) -> list[float]:
    """The plain loop both models run. Returns each step's wall time in seconds."""
    times = []
    for x, y in batches:
        t0 = time.perf_counter()
        logits = forward(x)
        loss = F.cross_entropy(logits.float().view(-1, vocab), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # foreach=True for both: the default everywhere torch can, stated so neither side differs.
    return torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return _proc_status_kib("VmHWM") is not None
    except OSError:
        return False


def measure_memory(args: argparse.Namespace, name: str) -> int:
    """Peak RSS growth in bytes for building and training one model (run in a fresh subprocess)."""
    cfg = model_config(args)
    batches = make_batches(cfg, 3, args.batch, args.seed)  # the peak is reached within the first steps
    from transformers import LlamaForCausalLM  # noqa: F401  (imported by both runs: in both baselines)

    if _reset_peak_rss():
        before, peak = _proc_status_kib("VmRSS"), lambda: _proc_status_kib("VmHWM")
    else:
        before, peak = (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        )
    torch.manual_seed(args.seed)
    model = build(name, cfg)
    model.train()
    train_steps(forward_fn(name, model), make_optimizer(model), batches, cfg.vocab_size)
    return (peak() - before) * 1024  # both are KiB on Linux


def memory_in_subprocess(args: argparse.Namespace, argv: list[str], name: str) -> int:
    out = subprocess.run(
        [sys.executable, __file__, *argv, "--memory-only", name], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_growth_bytes"]


def check_same_function(models: dict[str, torch.nn.Module], cfg: ModelConfig, seed: int) -> float:
    """Largest |logit difference| of each peer from runyard on one probe batch (fp32, eval mode)."""
    probe = make_batches(cfg, 1, 2, seed + 99)[0][0]
    with torch.no_grad():
        logits = {name: forward_fn(name, m.eval())(probe) for name, m in models.items()}
    for m in models.values():
        m.train()
    return max((logits[name] - logits["runyard"]).abs().max().item() for name in models if name != "runyard")


def time_precision(models, cfg, args, precision: str, report: Report) -> None:
    batches = make_batches(cfg, args.steps_per_round, args.batch, args.seed)
    opts = {name: make_optimizer(m) for name, m in models.items()}
    for name, model in models.items():
        model.train()
        train_steps(forward_fn(name, model, precision), opts[name], batches[: args.warmup], cfg.vocab_size)
    contenders = {
        name: (lambda name=name: train_steps(forward_fn(name, models[name], precision), opts[name], batches,
                                             cfg.vocab_size))
        for name in models
    }
    print(f"== {precision}{' (CPU autocast)' if precision == 'bf16' else ''}: {args.repeats} rounds of "
          f"{args.steps_per_round} steps per model ==", flush=True)
    samples = interleaved(contenders, args.repeats, warmup=0)
    tokens = args.batch * cfg.context_length * args.steps_per_round
    for name, s in samples.items():
        print(f"  {name:<10} {s.rate(tokens).spread()} tokens/s")
    report.ratio(f"train_{precision}_vs_hf_llama", paired_ratio(samples["hf"], samples["runyard"]),
                 f"HF LlamaForCausalLM sdpa, CPU {precision}", ">=", 1.0,
                 {"tokens_per_s": {n: tokens / s.median for n, s in samples.items()}})
    report.ratio(f"train_{precision}_vs_nanogpt_fused", paired_ratio(samples["nanogpt"], samples["runyard"]),
                 f"nanoGPT-style fused model, CPU {precision}", ">=", 1.0,
                 {"tokens_per_s": {n: tokens / s.median for n, s in samples.items()}})


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_only:
        print(json.dumps({"peak_rss_growth_bytes": measure_memory(args, args.memory_only)}))
        return 0

    import transformers  # the bench extra's peer

    report = Report("train_throughput", args, packages=["transformers"])
    cfg = model_config(args)
    models = make_models(cfg, args.seed)
    print(
        f"shape: d_model={cfg.d_model} layers={cfg.n_layers} heads={cfg.n_heads} kv_heads={cfg.n_kv_heads} "
        f"ffn={cfg.ffn_hidden} vocab={cfg.vocab_size} context={cfg.context_length} tied={cfg.tie_embeddings} "
        f"batch={args.batch}; parameters "
        + ", ".join(f"{n}={sum(p.numel() for p in m.parameters()):,}" for n, m in models.items())
    )
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads")
    diff = check_same_function(models, cfg, args.seed)
    print(f"same weights, max |logit difference| from runyard = {diff:.2e}")
    if diff > 1e-3:
        print("error: the models do not compute the same function; the comparison would be unfair")
        return 1

    for precision in args.precisions.split(","):
        if precision not in ("fp32", "bf16"):
            raise SystemExit(f"--precisions: unknown precision {precision!r} (fp32, bf16)")
        time_precision(models, cfg, args, precision, report)

    mem = {name: memory_in_subprocess(args, argv, name) for name in MODELS}
    print("peak RSS growth, fp32, 3 steps, each model alone in a fresh subprocess: "
          + ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in mem.items()))
    report.ratio("train_peak_memory_vs_hf_llama", Samples([mem["runyard"] / mem["hf"]]),
                 "HF LlamaForCausalLM sdpa, CPU fp32", "<=", 1.0, {"bytes": mem})
    return report.finish()


if __name__ == "__main__":
    raise SystemExit(main())

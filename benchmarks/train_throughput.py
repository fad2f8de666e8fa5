"""Training throughput: runyard's Transformer against HF transformers' LlamaForCausalLM.

Both models have the same shape (hidden size, layers, heads, kv heads, intermediate size, vocab,
context, tied embeddings), HF's with attn_implementation="sdpa". HF's weights are copied from
runyard's, so both start from the same point; the script checks that their logits agree before
timing anything (the same math, not just the same shape). Both then train with the same plain loop
(forward, cross-entropy, backward, AdamW step) on the same batches, in this process, on CPU, fp32.
Timing alternates between the two models in rounds so load from other processes hits both alike;
tokens/s is from the median step time over all timed steps.

Peak memory: each model trains three steps in its own fresh subprocess, and we report
its peak resident set size minus the resident set just before the model is built. On Linux the
kernel's high-water mark is reset at that point (`/proc/self/clear_refs` = 5) and read back as
`VmHWM` from /proc/self/status; elsewhere `ru_maxrss` is used (it cannot be reset, so imports may
mask small models). That covers weights, gradients, AdamW state, activations and allocator
overhead; the interpreter and imported libraries are excluded. (`ru_maxrss` alone is not used on
Linux: a child started from this process inherits its parent's high-water mark.)

Run: python benchmarks/train_throughput.py   (needs `pip install -e .[bench]` for transformers)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from runyard.model.config import default_ffn_hidden
from runyard.model.transformer import ModelConfig, Transformer


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
    p.add_argument("--steps", type=int, default=24, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model first")
    p.add_argument("--rounds", type=int, default=4, help="alternations between the two models")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="seed for init and batches")
    p.add_argument("--memory-only", choices=["runyard", "hf"], help=argparse.SUPPRESS)
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
    from transformers import LlamaConfig, LlamaForCausalLM

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


def make_models(cfg: ModelConfig, seed: int) -> tuple[Transformer, torch.nn.Module]:
    torch.manual_seed(seed)
    ours = Transformer(cfg)
    hf = build_hf(cfg)
    copy_weights_to_hf(ours, hf)
    return ours, hf


def forward_fn(name: str, model: torch.nn.Module):
    if name == "runyard":
        return model
    return lambda x: model(input_ids=x, use_cache=False).logits


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
        loss = F.cross_entropy(logits.view(-1, vocab), y.view(-1))
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
    model = Transformer(cfg) if name == "runyard" else build_hf(cfg)
    model.train()
    train_steps(forward_fn(name, model), make_optimizer(model), batches, cfg.vocab_size)
    return (peak() - before) * 1024  # both are KiB on Linux


def memory_in_subprocess(args: argparse.Namespace, argv: list[str], name: str) -> int:
    out = subprocess.run(
        [sys.executable, __file__, *argv, "--memory-only", name], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_growth_bytes"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_only:
        print(json.dumps({"peak_rss_growth_bytes": measure_memory(args, args.memory_only)}))
        return 0

    import transformers

    cfg = model_config(args)
    ours, hf = make_models(cfg, args.seed)
    models = {"runyard": ours, "hf": hf}
    print(
        f"shape: d_model={cfg.d_model} layers={cfg.n_layers} heads={cfg.n_heads} kv_heads={cfg.n_kv_heads} "
        f"ffn={cfg.ffn_hidden} vocab={cfg.vocab_size} context={cfg.context_length} tied={cfg.tie_embeddings} "
        f"batch={args.batch}; params runyard={ours.num_parameters():,} "
        f"hf={sum(p.numel() for p in hf.parameters()):,}"
    )
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
        "CPU fp32"
    )

    probe = make_batches(cfg, 1, 2, args.seed + 99)[0][0]
    with torch.no_grad():
        diff = (ours.eval()(probe) - hf.eval()(input_ids=probe, use_cache=False).logits).abs().max().item()
    print(f"same weights, max |logit difference| = {diff:.2e}")
    if diff > 1e-3:
        print("error: the two models do not compute the same function; the comparison would be unfair")
        return 1

    per_round = max(1, args.steps // args.rounds)
    batches = make_batches(cfg, args.warmup + per_round * args.rounds, args.batch, args.seed)
    opts = {name: make_optimizer(m) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for name, model in models.items():
        model.train()
        train_steps(forward_fn(name, model), opts[name], batches[: args.warmup], cfg.vocab_size)
    for r in range(args.rounds):
        chunk = batches[args.warmup + r * per_round : args.warmup + (r + 1) * per_round]
        order = ["runyard", "hf"] if r % 2 == 0 else ["hf", "runyard"]
        for name in order:
            times[name] += train_steps(forward_fn(name, models[name]), opts[name], chunk, cfg.vocab_size)

    tokens_per_step = args.batch * cfg.context_length
    tps = {name: tokens_per_step / statistics.median(t) for name, t in times.items()}
    mem = {name: memory_in_subprocess(args, argv, name) for name in models}
    with torch.no_grad():
        x, y = batches[-1]
        losses = {
            name: F.cross_entropy(forward_fn(name, m.eval())(x).view(-1, cfg.vocab_size), y.view(-1)).item()
            for name, m in models.items()
        }

    print(f"{'model':<10}{'tokens/s':>12}{'ms/step':>10}{'peak RSS growth':>18}{'loss after':>12}")
    for name in models:
        ms = 1000 * statistics.median(times[name])
        print(f"{name:<10}{tps[name]:>12,.0f}{ms:>10.1f}{mem[name] / 2**20:>15.1f} MiB{losses[name]:>12.4f}")
    print(f"ratio runyard / hf tokens/s: {tps['runyard'] / tps['hf']:.2f}x (target >= 1.0x)")
    print(f"ratio runyard / hf peak memory: {mem['runyard'] / mem['hf']:.2f}x")
    print(
        "(tokens/s from the median step over interleaved rounds; peak RSS growth = high-water resident set "
        "minus the resident set before the model is built, each model alone in a fresh subprocess, 3 steps)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

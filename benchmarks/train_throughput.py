"""Training throughput: runyard's own stage loop against nanoGPT's train.py loop, on a nanoGPT-style model of
the same shape (the same fused projections) and on HF transformers' LlamaForCausalLM, on CPU in fp32 and under
bf16 autocast.

- runyard: `runyard.train.loop.train_stage`, what `runyard run` calls to train a stage, with the process
  settings `runyard run` gives it (run/execute.py: the threads, deterministic algorithms): its loader over a
  token store written here, the learning-rate schedule, forward and the loss normalised by the step's tokens,
  backward, gradient clipping, the non-finite guard, AdamW (fused), a readback and a metrics.jsonl row every
  step (the CPU default), and checkpoints at the spec's `checkpoint.interval` (the plain format: safetensors
  files, checksummed, fsynced, committed by a rename, retention applied).
- The peers run nanoGPT's train.py loop (a plain loop, as its author would write it for this model): the same
  initial weights (copied from the model runyard's stage builds), the very batches runyard's loader yields
  (their sequence ids drawn before timing; each batch is sliced from a uint16 memmap of the same tokens inside
  the timed loop, as nanoGPT's `get_batch` does), nanoGPT's warmup + cosine learning rate, cross-entropy,
  backward, `clip_grad_norm_` to the same 1.0, AdamW with the same hyperparameters (fused, as runyard's:
  nanoGPT fuses on CUDA only, and one kernel on both sides keeps the optimizer out of the ratio; nanoGPT's
  groups: every matrix decays, the embedding too), `loss.item()` every step (nanoGPT's log_interval
  1), and at the same steps as runyard's checkpoints nanoGPT's checkpoint: `torch.save` of {model, optimizer,
  model_args, iter_num, best_val_loss, config} to ckpt.pt, so the checkpoint's cost falls on both sides at the
  same cadence. nanoGPT's evaluation at its eval_interval has no counterpart inside the timed steps: runyard's
  held-out evaluation is set to the stage's last step, after them.
- HF Llama (attn_implementation="sdpa", separate q/k/v and gate/up projections) is the framework a user would
  otherwise train with; the nanoGPT-style model (benchmarks/nanogpt_peer.py: fused Q/K/V and gate/up, F.rms_norm,
  autograd's rotary and SwiGLU) isolates what runyard's own model code and loop cost or save.

The models' logits are checked to agree before anything is timed, and each round's first-step losses are printed
side by side (the same weights on the same batch: the same number, to the precision's rounding).

bf16: `torch.autocast("cpu", torch.bfloat16)` around each forward, fp32 master weights, the loss in fp32. runyard's
loop autocasts on CUDA only (`resources.precision: bf16` trains in fp32 on a CPU, model/compute.py's
`autocast_for`), so for the bf16 rounds the benchmark hands the loop the CPU autocast in place of `autocast_for`
(`unittest.mock.patch` of `runyard.train.loop.autocast_for`): the same context the loop enters on CUDA, around
the same forward; nothing else in the loop changes. On a CPU without bf16 instructions (no AVX512-BF16, no AMX)
the peers' bf16 runs torch's generic bf16 matmul, many times slower than its fp32 one, and runyard's takes the
bf16 product in fp32 (model/ops.py's `linear`), hence large bf16 ratios there (benchmarks/results/
train_profile.md); on a CPU with them both run torch's kernels.

Timing: every step's end is stamped on both sides (runyard's metrics rows carry it: `time`); a round's figure is
the seconds per step over `--steps-per-round` steps (`--bf16-steps-per-round` in bf16) after `--warmup` untimed
ones, the checkpoints among them included (by default one per round's timed steps). The three
contenders alternate in rounds, the order reversed every other round; a ratio is the median of the per-round
ratios (each round's pair saw the same machine).

Peak memory: each model trains three steps of the plain loop in its own fresh subprocess (fp32), and we report
its peak resident set size minus the resident set just before the model is built (Linux: `/proc/self/clear_refs`
= 5 resets the high-water mark, `VmHWM` reads it; elsewhere `ru_maxrss`, which cannot be reset).

`--profile` prints torch.profiler's top operators of one training step of each model in each precision
(what benchmarks/results/train_profile.md summarises) and times nothing.

Run: python benchmarks/train_throughput.py [--record]   (needs the `bench` extra for transformers)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nanogpt_peer  # noqa: E402
from harness import Report, Samples, add_common_args, paired_ratio  # noqa: E402
from token_split import write_random_split  # noqa: E402

from runyard.data.loader import TokenLoader  # noqa: E402
from runyard.data.pipeline import PreparedData  # noqa: E402
from runyard.model.config import default_ffn_hidden  # noqa: E402
from runyard.model.registry import get_family  # noqa: E402
from runyard.model.transformer import ModelConfig, Transformer  # noqa: E402
from runyard.run.execute import _configure_threads  # noqa: E402
from runyard.spec.job import parse_spec, resolved_stage  # noqa: E402
from runyard.spec.seeds import derive_seed  # noqa: E402
from runyard.train import loop as stage_loop  # noqa: E402
from runyard.train import parallel  # noqa: E402
from runyard.train.metrics import MetricsLog  # noqa: E402

MODELS = ("runyard", "hf", "nanogpt")
STAGE = "main"
CTX = parallel.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
# nanoGPT's train.py settings, given to runyard's spec too.
OPTIM = {"lr": 6e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0}


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
    p.add_argument("--steps-per-round", type=int, default=8, help="timed fp32 steps per contender in each round")
    p.add_argument("--bf16-steps-per-round", type=int, default=2,
                   help="timed bf16 steps per contender in each round (torch's own bf16 matmul is slow on a CPU "
                        "without bf16 instructions, and the peers use it)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per contender at the start of each round")
    p.add_argument("--checkpoint-interval", type=int, default=None,
                   help="steps between checkpoints, both sides (default: the round's timed steps: one per round)")
    # One thread by default: this machine's two cores are shared, and spin-waiting intra-op threads make the
    # timings swing with other processes' load rather than with the work measured. The same for every contender.
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads, every contender (default 1)")
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16 (CPU autocast)")
    p.add_argument("--seed", type=int, default=0, help="the spec's seed: initial weights and batches")
    p.add_argument("--profile", action="store_true",
                   help="print torch.profiler's top operators of one step per model and precision; time nothing")
    p.add_argument("--memory-only", choices=MODELS, help=argparse.SUPPRESS)
    add_common_args(p, repeats=5)
    args = p.parse_args(argv)
    if args.warmup < 1:  # the timed steps are measured from the end of the step before them
        p.error("--warmup must be at least 1")
    return args


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


def peer_from(name: str, ours: Transformer) -> torch.nn.Module:
    """A peer holding `ours`'s weights."""
    peer = build(name, ours.cfg)
    if name == "hf":
        copy_weights_to_hf(ours, peer)
    else:
        nanogpt_peer.load_from_runyard(peer, ours)
    return peer


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
    """A bare step (forward, cross-entropy, backward, AdamW step), for the memory figure and the profile.
    Returns each step's wall time in seconds."""
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
    """nanoGPT's AdamW groups (matrices decay, vectors do not); fused, as runyard's loop steps."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": OPTIM["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"], fused=True)


# -- the data both sides read ---------------------------------------------------------------------------------


def write_split(root: Path, name: str, vocab: int, tokens: int, seed: int) -> tuple[Path, Path]:
    """Random tokens as runyard's token store (shards + index) and, the same stream, as nanoGPT's .bin."""
    return write_random_split(root, name, vocab, tokens, seed, shard_tokens=1 << 20)


class Workload:
    """One precision's stage: its spec, the prepared token store, the batches' sequence ids, the initial model."""

    def __init__(self, args: argparse.Namespace, precision: str, root: Path):
        self.precision = precision
        self.steps = args.bf16_steps_per_round if precision == "bf16" else args.steps_per_round
        self.warmup = args.warmup
        self.total = self.warmup + self.steps
        self.checkpoint_interval = args.checkpoint_interval or self.steps
        cfg = model_config(args)
        self.spec = parse_spec({
            "name": "train-throughput", "seed": args.seed, "data": {"sources": [{"path": "unused"}]},
            "model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
                      "n_kv_heads": cfg.n_kv_heads, "ffn_hidden": cfg.ffn_hidden, "context_length": cfg.context_length,
                      "tie_embeddings": cfg.tie_embeddings, "dropout": 0.0},
            "optim": {**OPTIM, "betas": list(OPTIM["betas"])},
            "schedule": {"warmup_steps": self.warmup},
            "train": {"steps": self.total, "batch_size": args.batch},
            # Held-out evaluation at the last step only (after the timed steps), on one batch.
            "eval": {"interval": self.total, "batches": 1},
            "checkpoint": {"interval": self.checkpoint_interval},
            "resources": {"device": "cpu", "precision": precision, "threads": args.threads},
        })
        self.stage = resolved_stage(self.spec, STAGE)
        self.cfg = get_family("decoder").config_from_spec(self.stage.model, vocab_size=args.vocab)
        if self.cfg != cfg:
            raise SystemExit(f"the spec's model config {self.cfg} is not the benchmark's shape {cfg}")
        seqs = self.total * args.batch
        root.mkdir(parents=True, exist_ok=True)
        train_index, self.train_bin = write_split(root, "train", args.vocab, 2 * seqs * (cfg.context_length + 1), 0)
        heldout_index, _ = write_split(root, "heldout", args.vocab, 2 * args.batch * (cfg.context_length + 1), 1)
        self.prepared = PreparedData(tokenizer_path=root / "unused.json", vocab_size=args.vocab, eos_id=0,
                                     train_index=train_index, heldout_index=heldout_index, fingerprint="bench",
                                     stats={}, input_fingerprints={})
        # The sequences runyard's loader reads at each step (train/batches.py's loader: the stage's data seed).
        loader = TokenLoader(train_index, seq_len=cfg.context_length, batch_size=args.batch,
                             seed=derive_seed(self.spec.seed, "data", STAGE))
        self.sequence_ids = [loader.sequence_ids(step * args.batch) for step in range(self.total)]
        first = loader.next_batch()
        # The model the stage starts from (its seeded init), to copy into the peers.
        self.initial = stage_loop.build_model(self.spec, self.stage, self.prepared, CTX, run_dir=None)[0]
        data = np.memmap(self.train_bin, dtype=np.uint16, mode="r")
        peer_first = nanogpt_batch(data, self.sequence_ids[0], cfg.context_length)
        if not (torch.equal(first[0], peer_first[0]) and torch.equal(first[1], peer_first[1])):
            raise SystemExit("the peers' get_batch does not read the batches runyard's loader yields")


def nanogpt_batch(data: np.ndarray, ids: np.ndarray, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's get_batch, at the given sequences' offsets instead of random ones."""
    starts = [int(i) * (block + 1) for i in ids]
    x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in starts])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64)) for i in starts])
    return x, y


# -- the contenders' rounds -------------------------------------------------------------------------------------


def cpu_autocast_for(device: torch.device, precision: str):
    """The loop's autocast_for with CPU bf16 autocast: what it gives on CUDA, given on the CPU."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def window(stamps: dict[int, float], w: Workload) -> float:
    """Seconds per step over steps warmup+1 .. total, from each step's end time."""
    return (stamps[w.total] - stamps[w.warmup]) / w.steps


def runyard_round(w: Workload, workdir: Path) -> tuple[float, float]:
    """One stage through runyard's loop, as `runyard run` runs it. (seconds per step, first step's loss)"""
    run_dir = workdir / "runyard"
    shutil.rmtree(run_dir, ignore_errors=True)
    stage_dir = run_dir / "stages" / STAGE
    patch = (mock.patch.object(stage_loop, "autocast_for", cpu_autocast_for) if w.precision == "bf16"
             else contextlib.nullcontext())
    _configure_threads(w.spec)  # runyard run's process settings: threads, deterministic algorithms
    try:
        with patch:
            stage_loop.train_stage(w.spec, w.stage, w.prepared, stage_dir, CTX, show_progress=False)
    finally:
        torch._C._set_deterministic_algorithms(False)  # the peers' processes do not set it
    rows = [r for r in MetricsLog(stage_dir / "metrics.jsonl").read() if "loss" in r]
    return window({r["step"]: r["time"] for r in rows}, w), rows[0]["loss"]


def nanogpt_lr(it: int, w: Workload) -> float:
    """nanoGPT's get_lr: linear warmup, cosine decay to a tenth over the run."""
    lr, min_lr, warmup, decay_iters = OPTIM["lr"], OPTIM["lr"] / 10, w.warmup, w.total
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / max(1, decay_iters - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def peer_round(name: str, w: Workload, workdir: Path) -> tuple[float, float]:
    """nanoGPT's train.py loop on a peer model. (seconds per step, first step's loss)"""
    out_dir = workdir / name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    torch.set_num_threads(w.spec.resources.threads)
    model = peer_from(name, w.initial)
    model.train()
    optimizer = make_optimizer(model)
    forward = forward_fn(name, model, w.precision)
    data = np.memmap(w.train_bin, dtype=np.uint16, mode="r")
    block, vocab = w.cfg.context_length, w.cfg.vocab_size
    model_args = {"vocab": vocab, "d_model": w.cfg.d_model, "n_layers": w.cfg.n_layers, "block_size": block}
    stamps, first_loss = {}, math.nan
    x, y = nanogpt_batch(data, w.sequence_ids[0], block)
    for it in range(w.total):
        for group in optimizer.param_groups:
            group["lr"] = nanogpt_lr(it, w)
        logits = forward(x)
        loss = F.cross_entropy(logits.float().view(-1, vocab), y.view(-1))
        if it + 1 < w.total:
            x, y = nanogpt_batch(data, w.sequence_ids[it + 1], block)  # fetched before backward, as nanoGPT does
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lossf = loss.item()  # log_interval 1: the loss printed every step
        first_loss = lossf if it == 0 else first_loss
        step = it + 1
        stamps[step] = time.time()
        if step % w.checkpoint_interval == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "model_args": model_args,
                        "iter_num": step, "best_val_loss": 1e9, "config": {"learning_rate": OPTIM["lr"]}},
                       out_dir / "ckpt.pt")
    return window(stamps, w), first_loss


def time_precision(args: argparse.Namespace, precision: str, report: Report, root: Path) -> None:
    w = Workload(args, precision, root / precision)
    print(f"== {precision}{' (CPU autocast)' if precision == 'bf16' else ''}: {args.repeats} rounds of {w.warmup} "
          f"untimed + {w.steps} timed steps per contender; a checkpoint every {w.checkpoint_interval} steps ==",
          flush=True)
    seconds = {name: Samples() for name in MODELS}
    for r in range(args.repeats):
        losses = {}
        for name in MODELS if r % 2 == 0 else MODELS[::-1]:
            if name == "runyard":
                per_step, losses[name] = runyard_round(w, root / "work")
            else:
                per_step, losses[name] = peer_round(name, w, root / "work")
            seconds[name].values.append(per_step)
        print(f"  round {r + 1}/{args.repeats}: " + ", ".join(f"{n} {seconds[n].values[-1]:.3g} s/step" for n in MODELS)
              + "; first-step loss " + ", ".join(f"{n} {losses[n]:.5f}" for n in MODELS), file=sys.stderr, flush=True)
        # The same weights on the same batch: the same loss, to the precision's rounding.
        spread = max(abs(losses[n] - losses["runyard"]) for n in MODELS)
        if spread > (1e-3 if precision == "fp32" else 2e-2):
            raise SystemExit(f"first-step losses differ by {spread:.2e}: the contenders did not train alike")
    tokens = args.batch * w.cfg.context_length
    for name, s in seconds.items():
        print(f"  {name:<10} {s.rate(tokens).spread()} tokens/s")
    detail = {"tokens_per_s": {n: tokens / s.median for n, s in seconds.items()},
              "steps_per_round": w.steps, "warmup_steps": w.warmup, "checkpoint_interval": w.checkpoint_interval,
              "threads": args.threads}
    report.ratio(f"train_{precision}_vs_hf_llama", paired_ratio(seconds["hf"], seconds["runyard"]),
                 f"HF LlamaForCausalLM sdpa in nanoGPT's loop, CPU {precision}", ">=", 1.3, detail)
    report.ratio(f"train_{precision}_vs_nanogpt_fused", paired_ratio(seconds["nanogpt"], seconds["runyard"]),
                 f"nanoGPT's loop on a nanoGPT-style fused model, CPU {precision}", ">=", 1.0, detail)


# -- peak memory and the profile ----------------------------------------------------------------------------------


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


def make_models(cfg: ModelConfig, seed: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(seed)
    ours = Transformer(cfg)
    return {"runyard": ours, "hf": peer_from("hf", ours), "nanogpt": peer_from("nanogpt", ours)}


def check_same_function(models: dict[str, torch.nn.Module], cfg: ModelConfig, seed: int) -> float:
    """Largest |logit difference| of each peer from runyard on one probe batch (fp32, eval mode)."""
    probe = make_batches(cfg, 1, 2, seed + 99)[0][0]
    with torch.no_grad():
        logits = {name: forward_fn(name, m.eval())(probe) for name, m in models.items()}
    for m in models.values():
        m.train()
    return max((logits[name] - logits["runyard"]).abs().max().item() for name in models if name != "runyard")


def profile(models: dict[str, torch.nn.Module], cfg: ModelConfig, args: argparse.Namespace, rows: int = 15) -> None:
    """torch.profiler's operators by self CPU time over two bare steps of each model, per step; matrix
    products also by shape (where a layout's kernel is slow, that is where it shows)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    batches = make_batches(cfg, 3, args.batch, args.seed)
    for precision in args.precisions.split(","):
        for name, model in models.items():
            opt, forward = make_optimizer(model), forward_fn(name, model, precision)
            step = train_steps(forward, opt, batches[:1], cfg.vocab_size)[0]  # warm: allocations, lazy init
            with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                train_steps(forward, opt, batches[1:], cfg.vocab_size)
            ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in ops) / 2e3
            print(f"\n### {name}, {precision}: {total:.0f} ms of operator time per step "
                  f"(the unprofiled step before it: {step * 1e3:.0f} ms)\n")
            print("| ms/step | share | calls/step | operator |\n|---:|---:|---:|---|")
            for e in ops[:rows]:
                ms = e.self_cpu_time_total / 2e3
                print(f"| {ms:.1f} | {ms / total:.1%} | {e.count // 2} | `{e.key}` |")
            mms = sorted((e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::mm"),
                         key=lambda e: -e.self_cpu_time_total)
            print("\n`aten::mm` by shape: " + "; ".join(
                f"{'x'.join(map(str, e.input_shapes[0]))} @ {'x'.join(map(str, e.input_shapes[1]))} "
                f"{e.self_cpu_time_total / 2e3:.0f} ms" for e in mms[:6]))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_only:
        print(json.dumps({"peak_rss_growth_bytes": measure_memory(args, args.memory_only)}))
        return 0

    import transformers  # the bench extra's peer

    cfg = model_config(args)
    models = make_models(cfg, args.seed)
    print(
        f"shape: d_model={cfg.d_model} layers={cfg.n_layers} heads={cfg.n_heads} kv_heads={cfg.n_kv_heads} "
        f"ffn={cfg.ffn_hidden} vocab={cfg.vocab_size} context={cfg.context_length} tied={cfg.tie_embeddings} "
        f"batch={args.batch}; parameters "
        + ", ".join(f"{n}={sum(p.numel() for p in m.parameters()):,}" for n, m in models.items())
    )
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    diff = check_same_function(models, cfg, args.seed)
    print(f"same weights, max |logit difference| from runyard = {diff:.2e}")
    if diff > 1e-3:
        print("error: the models do not compute the same function; the comparison would be unfair")
        return 1
    if args.profile:
        profile(models, cfg, args)
        return 0
    del models

    report = Report("train_throughput", args, packages=["transformers"])
    with tempfile.TemporaryDirectory(prefix="train-throughput-") as tmp:
        for precision in args.precisions.split(","):
            if precision not in ("fp32", "bf16"):
                raise SystemExit(f"--precisions: unknown precision {precision!r} (fp32, bf16)")
            time_precision(args, precision, report, Path(tmp))

    mem = {name: memory_in_subprocess(args, argv, name) for name in MODELS}
    print("peak RSS growth, fp32, 3 steps, each model alone in a fresh subprocess: "
          + ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in mem.items()))
    report.ratio("train_peak_memory_vs_hf_llama", Samples([mem["runyard"] / mem["hf"]]),
                 "HF LlamaForCausalLM sdpa, CPU fp32", "<=", 1.0, {"bytes": mem})
    return report.finish()


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU check: train a GPT-2-124M-shaped model in bf16 with torch.compile and report tokens/s and MFU.

Shape: 12 layers, 768 wide, 12 heads, context 1024, vocabulary 50304 (GPT-2's, padded to a multiple of
64), tied embeddings, SwiGLU hidden 2048 (as many weights as GPT-2's 4x MLP): ~124M parameters. Random
tokens (nothing is downloaded); the figure is the training step's speed, not the loss.

MFU = model FLOPs per token (6N + attention, `Transformer.flops_per_token`) x tokens/s / the device's dense
bf16 peak (train/metrics.py's table; a device not in the table gets no MFU rather than a guess).

    python benchmarks/gpu_check.py                # on a CUDA machine: < 5 minutes on one GPU
    python benchmarks/gpu_check.py --cpu-smoke    # a tiny model on CPU, to check the script itself
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from runyard.model.transformer import ModelConfig, Transformer
from runyard.train.metrics import device_peak_flops, mfu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU, no compile (checks the script)")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps (default 30)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first, compile included (default 5)")
    ap.add_argument("--no-compile", action="store_true", help="eager mode")
    args = ap.parse_args()

    if args.cpu_smoke:
        device = torch.device("cpu")
        cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=128,
                          context_length=64)
        args.batch, args.steps, args.warmup, compile_model = 2, 3, 1, False
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; use --cpu-smoke to check the script on CPU")
            return 2
        device = torch.device("cuda")
        cfg = ModelConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_hidden=2048,
                          context_length=1024)
        compile_model = not args.no_compile
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    optimizer = torch.optim.AdamW(model.param_groups(0.1), lr=3e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    step_fn = torch.compile(model) if compile_model else model
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.context_length + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> float:
        with autocast:
            logits = step_fn(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; model: {model.num_parameters() / 1e6:.1f}M parameters, {cfg.n_layers} layers x "
          f"{cfg.d_model}, context {cfg.context_length}; batch {args.batch}; compile {compile_model}; bf16 "
          f"{device.type == 'cuda'}")
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        loss = step()
    sync()
    print(f"warm-up ({args.warmup} steps, compile included): {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync()
    elapsed = time.perf_counter() - t0
    tok_s = args.steps * args.batch * cfg.context_length / elapsed
    flops_per_token = model.flops_per_token()
    peak = device_peak_flops(device)
    util = mfu(flops_per_token, tok_s, peak)
    print(f"timed: {args.steps} steps in {elapsed:.2f} s, final loss {float(loss):.3f}")
    print(f"tokens/s: {tok_s:,.0f}")
    print(f"model FLOPs/token: {flops_per_token / 1e6:.1f} MFLOP -> {flops_per_token * tok_s / 1e12:.1f} TFLOP/s")
    if util is None:
        print("MFU: n/a (no dense bf16 peak known for this device; see train/metrics.py)")
    else:
        print(f"MFU: {util * 100:.1f}% of {peak / 1e12:.0f} TFLOP/s dense bf16 peak")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU check: train a GPT-2-124M-shaped model in bf16 with torch.compile; report tokens/s and MFU, against HF
transformers' LlamaForCausalLM of the same shape on the same GPU, with the same settings.

Shape: 12 layers, 768 wide, 12 heads, context 1024, vocabulary 50304 (GPT-2's, padded to a multiple of
64), tied embeddings, SwiGLU hidden 2048 (as many weights as GPT-2's 4x MLP): ~124M parameters. Random
tokens (nothing is downloaded); the figure is the training step's speed, not the loss. Both models: bf16
autocast, fp32 master weights, torch.compile (unless --no-compile), fused AdamW, gradient clipping; HF's
with attn_implementation="sdpa" and its weights copied from runyard's. Rounds alternate between the two.

MFU = model FLOPs per token (6N + attention, `Transformer.flops_per_token`, the same for both: same shape)
x tokens/s / the device's dense bf16 peak (train/metrics.py's table; a device not in the table gets no MFU
rather than a guess). RATIO gpu_mfu_vs_hf_llama is runyard's MFU over HF's.

    python benchmarks/gpu_check.py                # on a CUDA machine: < 5 minutes on one GPU
    python benchmarks/gpu_check.py --cpu-smoke    # tiny models on CPU, to check the script itself
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, Samples, add_common_args, paired_ratio  # noqa: E402
from train_throughput import build_hf, copy_weights_to_hf  # noqa: E402

from runyard.model.transformer import ModelConfig, Transformer  # noqa: E402
from runyard.train.metrics import device_peak_flops, mfu  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny models on CPU, no compile (checks the script)")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    ap.add_argument("--steps-per-round", type=int, default=10, help="timed steps per model per round (default 10)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first, compile included (default 5)")
    ap.add_argument("--no-compile", action="store_true", help="eager mode for both")
    add_common_args(ap, repeats=4)
    return ap.parse_args(argv)


class Trainer:
    """One model's training step: forward under autocast, loss in fp32, backward, clip, AdamW."""

    def __init__(self, model: torch.nn.Module, call, device: torch.device, compile_model: bool):
        self.model, self.device = model, device
        self.forward = torch.compile(call) if compile_model else call
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                           fused=device.type == "cuda")

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.forward(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        device = torch.device("cpu")
        cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=128,
                          context_length=64)
        args.batch, args.steps_per_round, args.warmup, compile_model = 2, 2, 1, False
        args.repeats = min(args.repeats, 2)
        if args.record:
            print("gpu_check: --cpu-smoke checks the script; its figures are not recorded")
            args.record = False
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
    report = Report("gpu_check", args, packages=["transformers"])

    torch.manual_seed(0)
    ours = Transformer(cfg)
    hf = build_hf(cfg)
    copy_weights_to_hf(ours, hf)
    ours, hf = ours.to(device), hf.to(device)
    trainers = {
        "runyard": Trainer(ours, ours, device, compile_model),
        "hf": Trainer(hf, lambda x: hf(input_ids=x, use_cache=False).logits, device, compile_model),
    }
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.context_length + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; model: {ours.num_parameters() / 1e6:.1f}M parameters, {cfg.n_layers} layers x "
          f"{cfg.d_model}, context {cfg.context_length}; batch {args.batch}; compile {compile_model}; bf16 "
          f"{device.type == 'cuda'}")
    for label, trainer in trainers.items():
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            trainer.step(x, y)
        sync()
        print(f"{label} warm-up ({args.warmup} steps, compile included): {time.perf_counter() - t0:.1f} s")

    seconds = {label: Samples() for label in trainers}
    labels = list(trainers)
    losses = {}
    for r in range(args.repeats):
        for label in labels if r % 2 == 0 else labels[::-1]:
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps_per_round):
                losses[label] = trainers[label].step(x, y)
            sync()
            seconds[label].values.append(time.perf_counter() - t0)
    tokens_per_round = args.steps_per_round * args.batch * cfg.context_length
    flops_per_token = ours.flops_per_token()
    peak = device_peak_flops(device)
    for label, s in seconds.items():
        tok_s = s.rate(tokens_per_round)
        util = mfu(flops_per_token, tok_s.median, peak)
        shown = "n/a (no dense bf16 peak known for this device)" if util is None else f"{util * 100:.1f}%"
        print(f"{label:<8} tokens/s {tok_s.spread()}, MFU {shown}, final loss {float(losses[label]):.3f}")
    print(f"model FLOPs/token: {flops_per_token / 1e6:.1f} MFLOP")
    # Same shape, so the same FLOPs per token: the MFU ratio is the tokens/s ratio, peak or no peak.
    report.ratio("gpu_mfu_vs_hf_llama", paired_ratio(seconds["hf"], seconds["runyard"]),
                 f"HF LlamaForCausalLM sdpa on the same {name}, "
                 f"{'bf16' if device.type == 'cuda' else 'fp32'}{', compiled' if compile_model else ''}", ">=", 1.0,
                 {"device": name, "peak_flops": peak, "flops_per_token": flops_per_token,
                  "tokens_per_s": {k: tokens_per_round / s.median for k, s in seconds.items()}})
    return report.finish()


if __name__ == "__main__":
    raise SystemExit(main())

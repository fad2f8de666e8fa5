"""Activation checkpointing's cost and saving: a training step (forward, backward, AdamW) of runyard's
decoder with `train.activation_checkpointing: full` against the same model and batches without it, on
CPU, laid out by the loop's own `train/layout.py`.

- time: step time with full recomputation over without (the issue's target: at most 1.4x);
- memory: bytes kept for backward by one forward (distinct storages reaching autograd's saved-tensor
  hooks, plus the inputs a recomputed block keeps; weights and buffers left out) with it over without
  (target: at most 0.5x). The plan's estimate of the same ratio is printed beside it.

Run: python benchmarks/activation_checkpointing.py [--record] [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Report, Samples, add_common_args, interleaved, paired_ratio  # noqa: E402

from runyard.model.compute import is_recomputed, token_loss_sum  # noqa: E402
from runyard.model.registry import get_family  # noqa: E402
from runyard.model.transformer import ModelConfig  # noqa: E402
from runyard.spec.job import parse_spec, resolved_stage  # noqa: E402
from runyard.train import layout, parallel  # noqa: E402

CFG = ModelConfig(vocab_size=2048, d_model=192, n_layers=4, n_heads=6, n_kv_heads=3, ffn_hidden=512,
                  context_length=128)
BATCH = 4
CTX = parallel.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
FAMILY = get_family("decoder")


def laid_out(mode: str):
    spec = parse_spec({"name": "ac", "data": {"sources": [{"path": "unused"}]},
                       "train": {"activation_checkpointing": mode}})
    torch.manual_seed(0)
    model = FAMILY.build(CFG)
    return model, layout.lay_out(model, FAMILY, CTX, spec.resources, resolved_stage(spec, "main").train)


def saved_bytes(model, module, tokens) -> int:
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    kept: dict[int, int] = {}

    def keep(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    def inputs(_block, args) -> None:  # what a recomputed block keeps: its inputs
        for a in args:
            if isinstance(a, torch.Tensor):
                keep(a)

    hooks = [b.register_forward_pre_hook(inputs) for b in model.blocks if is_recomputed(b)]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = token_loss_sum(module(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    model.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    return sum(kept.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, repeats=6)
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    report = Report("activation_checkpointing", args)
    report.note(f"load average at start {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, CFG.context_length + 1), generator=torch.Generator().manual_seed(1))
    models = {mode: laid_out(mode) for mode in ("none", "full")}
    optimizers = {mode: torch.optim.AdamW(m.parameters(), lr=1e-3) for mode, (m, _) in models.items()}

    def step(mode: str):
        model, module = models[mode]
        def run():
            loss = token_loss_sum(module(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
            loss.backward()
            optimizers[mode].step()
            optimizers[mode].zero_grad(set_to_none=True)
        return run

    times = interleaved({"full": step("full"), "none": step("none")}, args.repeats)
    report.ratio("activation_checkpointing_full_step_time", paired_ratio(times["full"], times["none"]),
                 "the same step without activation checkpointing", "<=", 1.4,
                 {"none_s": times["none"].median, "full_s": times["full"].median})
    kept = {mode: saved_bytes(*models[mode], tokens) for mode in models}
    size = FAMILY.sizing(CFG, micro_batch=BATCH)
    estimate = size.activation_bytes_with(CFG.n_layers) / size.activation_bytes
    report.ratio("activation_checkpointing_full_saved_bytes", Samples([kept["full"] / kept["none"]]),
                 "bytes kept for backward without activation checkpointing", "<=", 0.5,
                 {"none_bytes": kept["none"], "full_bytes": kept["full"], "plan_estimate_ratio": estimate})
    report.note(f"bytes kept for backward: {kept['none']} without, {kept['full']} with full recomputation; "
                f"the plan estimates the ratio as {estimate:.2f}")
    return report.finish()


if __name__ == "__main__":
    raise SystemExit(main())

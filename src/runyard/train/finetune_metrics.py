"""Held-out evaluation of fine-tuning stages: response loss (sft), reward accuracy and margin (dpo),
a task metric over held-out prompts answered greedily, and the before/after record the report shows.

Each sft or dpo stage writes `stages/<stage>/finetune.json`: `before` (its initial weights, evaluated
before the first step, so a resumed stage keeps the same baseline) and `after` (its final weights), each
with the held-out metrics and a few answers to held-out prompts. The eval report puts them side by side.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from runyard.data.samples import Batch, SampleStore
from runyard.model.compute import token_loss_sum
from runyard.serve.engine import Generator
from runyard.system.files import atomic_write_json
from runyard.train.objectives import dpo_loss, sequence_logprobs

FINETUNE_FILE = "finetune.json"


@torch.no_grad()
def response_loss(model: torch.nn.Module, batches: list[Batch], device: torch.device, autocast) -> tuple[float, int]:
    """Mean cross-entropy over the response (supervised) tokens of `batches`, and their count."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for b in batches:
        with autocast():
            logits = model(b.inputs.to(device))
        total += float(token_loss_sum(logits, b.labels.to(device)))
        count += b.supervised
    model.train(was_training)
    return total / max(count, 1), count


@torch.no_grad()
def pair_logprobs(model: torch.nn.Module, batch: Batch, device: torch.device, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probabilities of a DPO batch's chosen and rejected rows (no gradient)."""
    with autocast():
        logits = model(batch.inputs.to(device))
    logps = sequence_logprobs(logits, batch.labels.to(device))
    return logps[: batch.pairs], logps[batch.pairs :]


def dpo_metrics(model: torch.nn.Module, reference: list[tuple[torch.Tensor, torch.Tensor]], batches: list[Batch],
                beta: float, device: torch.device, autocast) -> dict[str, float]:
    """Held-out DPO loss, reward accuracy (chosen reward above rejected) and mean reward margin;
    `reference` holds the reference's log-probabilities of the same batches."""
    was_training = model.training
    model.eval()
    losses, margins = [], []
    for b, (ref_c, ref_r) in zip(batches, reference, strict=True):
        pol_c, pol_r = pair_logprobs(model, b, device, autocast)
        terms = dpo_loss(pol_c, pol_r, ref_c, ref_r, beta)
        losses.append(terms.losses)
        margins.append(terms.margins)
    model.train(was_training)
    loss, margin = torch.cat(losses), torch.cat(margins)
    return {"heldout_loss": float(loss.mean()), "heldout_reward_accuracy": float((margin > 0).float().mean()),
            "heldout_reward_margin": float(margin.mean()), "heldout_pairs": int(len(margin))}


def exact_match(prompt: str, answer: str, reference: str) -> bool:
    return answer.strip() == reference.strip()


def python_syntax(prompt: str, answer: str, reference: str) -> bool:
    """The prompt (a signature and docstring) and the answer (a body) parse together as Python, and the
    answer adds code: a docstring is a whole body already, so whitespace or comments alone do not count."""
    head = prompt.rstrip("\n") + "\n"
    try:
        tree = ast.dump(ast.parse(head + answer))
    except (SyntaxError, ValueError):
        return False
    try:
        alone = ast.dump(ast.parse(head))
    except (SyntaxError, ValueError):
        alone = None
    return tree != alone


CHECKERS: dict[str, Callable[[str, str, str], bool]] = {"exact_match": exact_match, "python_syntax": python_syntax}


def answers(model: torch.nn.Module, tokenizer: Tokenizer, store: SampleStore, ids: list[int], eos_id: int,
            max_new_tokens: int, device: torch.device) -> list[str]:
    """Greedy answers of `model` to the held-out samples `ids` (prompted with everything before their
    last response), stopping at the end-of-text token."""
    generator = Generator(model, tokenizer, device=device, eos_ids={eos_id})
    out = []
    for i in ids:
        completion = generator.generate_ids(store.prompt(int(i)), max_tokens=max_new_tokens, temperature=0.0)
        out.append(tokenizer.decode(completion))
    return out


def task_metric(metric: str, questions: list[dict[str, str]], replies: list[str]) -> dict[str, Any]:
    """The share of replies the named checker accepts."""
    checker = CHECKERS[metric]
    passed = [checker(q["prompt"], a, q["response"]) for q, a in zip(questions, replies, strict=True)]
    return {"name": metric, "score": sum(passed) / max(len(passed), 1), "prompts": len(passed)}


def read_record(stage_dir: Path) -> dict[str, Any]:
    path = stage_dir / FINETUNE_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def write_record(stage_dir: Path, key: str, value: dict[str, Any], **extra: Any) -> None:
    """Set `key` (`before` or `after`) of the stage's finetune.json, atomically."""
    record = read_record(stage_dir)
    record.update(extra)
    record[key] = value
    stage_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(stage_dir / FINETUNE_FILE, record)


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else ("-" if value is None else str(value))


def finetune_markdown(records: dict[str, dict[str, Any]]) -> list[str]:
    """The report's section: for each fine-tuning stage, its held-out metrics before and after, its
    trainable parameters, and answers to held-out prompts before and after."""
    lines: list[str] = []
    for stage, rec in records.items():
        before, after = rec.get("before", {}), rec.get("after", {})
        if not before:
            continue
        lines += ["", f"## Fine-tuning: stage {stage} ({rec.get('kind', '?')})", "",
                  "| held-out metric | base (stage start) | fine-tuned |", "|---|---:|---:|"]
        for key in sorted(k for k in before["metrics"] if k != "answers"):
            lines.append(f"| {key} | {_fmt(before['metrics'].get(key))} | {_fmt(after.get('metrics', {}).get(key))} |")
        params = rec.get("parameters")
        if params:
            lines += ["", f"Trainable parameters: {params['trainable']:,} of {params['total']:,} "
                      f"({params['trainable'] / max(params['total'], 1):.2%}); optimizer and gradient memory "
                      f"{params['train_state_bytes']:,} bytes against {params['full_train_state_bytes']:,} for a "
                      "full fine-tune of the same stage (benchmarks/finetune_throughput.py measures the peak)."]
        memory = rec.get("peak_memory")
        if memory:
            lines += ["", f"Peak memory while training ({memory['kind']}): {memory['bytes'] / 2**20:,.0f} MiB."]
        for i, sample in enumerate(before.get("samples", [])):
            later = after.get("samples", [])
            lines += ["", f"### Held-out prompt {i + 1}", "", "```", sample["prompt"][-800:], "```", "",
                      "Reference:", "", "```", sample["reference"][:800], "```", "", "Base model:", "", "```",
                      sample["answer"][:800], "```", "", "Fine-tuned:", "", "```",
                      later[i]["answer"][:800] if i < len(later) else "(not evaluated yet)", "```"]
    return lines

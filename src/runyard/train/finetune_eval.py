"""The before/after record of a fine-tuning stage (`stages/<stage>/finetune.json`, train/finetune_metrics.py):
held-out metrics, the task metric, answers to a few held-out prompts, and what LoRA saves. `before` is
taken from the stage's initial weights before its first step (kept across resumes), `after` from its
final weights."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import torch

from runyard.data.instruct import PreparedInstruct
from runyard.data.samples import eval_batches
from runyard.data.tokenizer import eos_token_beside, load_tokenizer
from runyard.spec.job import ResolvedStage
from runyard.train import finetune_metrics as finetune

BYTES_PER_TRAINED_VALUE = 4 * 3  # fp32 gradient and AdamW's two moments per trained parameter


def _parameters(setup, model: torch.nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()
                if setup.adapters is None or all(p is not q for q in setup.adapters.parameters()))
    trainable = setup.adapters.trainable_parameters() if setup.adapters is not None else total
    return {"trainable": trainable, "total": total, "train_state_bytes": trainable * BYTES_PER_TRAINED_VALUE,
            "full_train_state_bytes": total * BYTES_PER_TRAINED_VALUE}


def _evaluate(objective, model: torch.nn.Module, stage: ResolvedStage, instruct: PreparedInstruct,
              device: torch.device, autocast) -> dict[str, Any]:
    metrics = objective.evaluate(model, device, autocast, None)
    sft = stage.sft
    store = instruct.stores("heldout")[0]
    references = instruct.references("heldout")
    n = min(len(store), max(sft.task_prompts, sft.samples))
    _batches, ids = eval_batches([store], 1, n, 0, instruct.pad_id)  # the first n of a fixed draw
    replies = finetune.answers(model, load_tokenizer(instruct.tokenizer_path, eos_token_beside(instruct.tokenizer_path)), store, [int(i) for i in ids],
                               instruct.eos_id, sft.max_new_tokens, device) if n else []
    questions = [references[int(i)] for i in ids]
    if sft.task_prompts and stage.kind == "sft":
        task = finetune.task_metric(sft.task_metric, questions[: sft.task_prompts], replies[: sft.task_prompts])
        metrics[f"task_{task['name']}"] = task["score"]
    samples = [{"prompt": q["prompt"], "reference": q["response"], "answer": a}
               for q, a in zip(questions[: sft.samples], replies[: sft.samples], strict=True)]
    return {"metrics": metrics, "samples": samples}


def has_before(stage_dir: Path) -> bool:
    """Whether the stage's initial weights were evaluated already (a resumed stage keeps its first record)."""
    return "before" in finetune.read_record(stage_dir)


def record_before(setup, model: torch.nn.Module, stage: ResolvedStage, instruct: PreparedInstruct, stage_dir: Path,
                  device: torch.device, autocast) -> None:
    """Evaluate the stage's initial weights (`model`: the whole model, however training lays it out) once."""
    if has_before(stage_dir):
        return
    finetune.write_record(stage_dir, "before", _evaluate(setup.objective, model, stage, instruct, device, autocast),
                          kind=stage.kind, parameters=_parameters(setup, model))


def peak_memory(device: torch.device) -> dict[str, Any]:
    """The peak memory so far: the device's allocator peak on CUDA, else the process's peak RSS (which
    includes everything the process did before the stage)."""
    if device.type == "cuda":
        return {"kind": "cuda_max_allocated", "bytes": int(torch.cuda.max_memory_allocated(device))}
    return {"kind": "process_peak_rss", "bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def record_after(setup, model: torch.nn.Module, stage: ResolvedStage, instruct: PreparedInstruct, stage_dir: Path,
                 device: torch.device, autocast) -> None:
    """Evaluate the stage's final weights (`model`: LoRA merged), and note the peak memory of training."""
    memory = peak_memory(device)
    finetune.write_record(stage_dir, "after", _evaluate(setup.objective, model, stage, instruct, device, autocast),
                          peak_memory=memory)

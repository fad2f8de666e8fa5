"""Loading a stage's initial weights (`model.init`) into the model the loop just built.

Where they come from is model/stage_model.py's answer: an earlier stage's final checkpoint (verified), a
runyard export (its checksums verified first) or a Hugging Face model directory (read tensor by tensor
through safetensors, model/hf/weights.py). The loop calls this whenever it builds a stage's model (a
fresh start and a resume alike: a LoRA stage's checkpoint holds only adapters over these weights, and a
dpo stage's reference is these weights), before the model is wrapped for DDP or FSDP. An earlier stage
that trained LoRA adapters hands on its base with the adapters merged in.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from runyard.errors import RunyardError
from runyard.model.hf.export import verify_export
from runyard.model.registry import get_family
from runyard.model.stage_model import stage_config, stage_start
from runyard.spec.job import JobSpec, resolved_stage
from runyard.spec.seeds import derive_seed
from runyard.train import checkpoint
from runyard.train.lora import attach_trained_adapters, merged_state_dict
from runyard.train.stage_result import final_checkpoint, stage_dir

log = logging.getLogger(__name__)


class InitialWeightsMismatch(RunyardError):
    """The weights a stage starts from do not fit its model; the message names each tensor that differs."""


def load_initial_weights(model: torch.nn.Module, spec: JobSpec, stage_name: str, run_dir: Path,
                         vocab_size: int) -> str | None:
    """Copy stage `stage_name`'s initial weights into `model` in place; return where they came from
    (None for a random start, which leaves the model as built). `vocab_size`: the run's tokenizer's, as
    the loop builds models with it (needed to rebuild an earlier LoRA stage's base)."""
    start = stage_start(spec, stage_name)
    family = get_family(resolved_stage(spec, stage_name).model.family)
    if start.source == "random":
        return None
    if start.source == "stage":
        weights, origin = stage_result_weights(spec, start.from_stage, run_dir, vocab_size)
        load_state_checked(model, weights, origin)
    else:
        if start.source == "export":
            verify_export(start.directory)  # every file against runyard.json's checksums
        origin = f"{start.source} directory {start.directory}"
        family.load_directory_into(model, start.directory)
    log.info("stage %s: starting from %s", stage_name, origin)
    return origin


def stage_result_weights(spec: JobSpec, stage_name: str, run_dir: Path,
                         vocab_size: int) -> tuple[dict[str, torch.Tensor], str]:
    """An earlier stage's result as a plain model's state dict, and where it came from: its verified
    final checkpoint, or for a LoRA stage (whose checkpoint holds adapters only) its base, rebuilt as the
    loop built it (its seed, its own initial weights), with the adapters merged in."""
    source = resolved_stage(spec, stage_name)
    ref = final_checkpoint(stage_dir(run_dir, stage_name), source.train.steps)
    origin = f"stage {stage_name!r}'s final checkpoint {ref.path}"
    weights = checkpoint.read_model_weights(ref.path)
    if source.lora is None:
        return weights, origin
    family = get_family(source.model.family)
    with torch.random.fork_rng(devices=[]):  # rebuilding the base must not move the caller's RNG
        torch.manual_seed(derive_seed(spec.seed, "init", stage_name))  # as the loop's build_model seeds it
        base = family.build(stage_config(spec, stage_name, vocab_size))
    load_initial_weights(base, spec, stage_name, run_dir, vocab_size)
    trained_on = checkpoint.read_checkpoint(ref.path)[1].get("lora_base_sha256")
    attach_trained_adapters(base, source.lora, derive_seed(spec.seed, "lora", stage_name), weights, trained_on,
                            str(ref.path))
    return merged_state_dict(base), f"{origin} (LoRA adapters merged into their base)"


@torch.no_grad()
def load_state_checked(model: torch.nn.Module, weights: dict[str, torch.Tensor], origin: str) -> None:
    """`model.load_state_dict(weights)`, after checking every tensor's name and shape; the error names
    each one that does not fit."""
    own = model.state_dict()
    first_at: dict[tuple[int, tuple[int, ...]], str] = {}
    shared = set()  # the later names of tied tensors (a checkpoint may store them once)
    for name, t in own.items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in first_at:
            shared.add(name)
        first_at.setdefault(key, name)
    missing = sorted(set(own) - set(weights) - shared)
    unexpected = sorted(set(weights) - set(own))
    wrong = [f"{name} {tuple(weights[name].shape)} there, {tuple(t.shape)} here"
             for name, t in own.items() if name in weights and weights[name].shape != t.shape]
    if missing or unexpected or wrong:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unexpected {unexpected}"] if unexpected else [])
        raise InitialWeightsMismatch(f"{origin} does not fit this stage's model: " + "; ".join(parts + wrong))
    model.load_state_dict(weights, strict=not shared)

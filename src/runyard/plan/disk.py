"""Disk a run will write under its run directory, estimated from the spec before any work: each stage's
checkpoints (one checkpoint's size times the number kept, plus the one being written) and the export.
The data cache's estimate is the data stage's own (runyard.data.footprint).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from runyard.data.footprint import TOKENIZER_BYTES_PER_TOKEN
from runyard.plan.sizing import stage_config
from runyard.spec.job import JobSpec, resolved_stage
from runyard.system.diskspace import DiskNeed, human_bytes

CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights + AdamW's two fp32 moments
EXPORT_BYTES_PER_PARAM = 4  # fp32 safetensors


def stage_parameters(spec: JobSpec, stage: str, vocab_size: int) -> int:
    """Parameters of a stage's model, through its family in the registry."""
    family, config = stage_config(spec, resolved_stage(spec, stage), {"vocab_size": vocab_size})
    return family.sizing(config).parameters


def checkpoint_bytes(parameters: int) -> int:
    """One checkpoint: weights and optimizer state (RNG and loader state are small)."""
    return parameters * CHECKPOINT_BYTES_PER_PARAM + (1 << 20)


def checkpoints_kept(spec: JobSpec) -> int:
    """Checkpoints of one stage on disk at once: keep_last, the best one, and the one being written."""
    return spec.checkpoint.keep_last + (1 if spec.checkpoint.keep_best else 0) + 1


def export_bytes(parameters: int, vocab_size: int) -> int:
    return parameters * EXPORT_BYTES_PER_PARAM + vocab_size * TOKENIZER_BYTES_PER_TOKEN


def _used(path: Path) -> int:
    """Bytes already under `path` (a resumed stage's checkpoints count toward its need)."""
    if not path.is_dir():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_dir_needs(
    spec: JobSpec, run_dir: Path, vocab_size: int, stages_done: Collection[str] = ()
) -> list[DiskNeed]:
    """Checkpoints of every stage not yet done, and the export, under `run_dir`."""
    needs = []
    kept = checkpoints_kept(spec)
    for stage in spec.stages:
        if stage.name in stages_done:
            continue
        directory = run_dir / "stages" / stage.name / "checkpoints"
        one = checkpoint_bytes(stage_parameters(spec, stage.name, vocab_size))
        needs.append(DiskNeed(
            f"stage {stage.name} checkpoints: {kept} x {human_bytes(one)} (checkpoint.keep_last "
            f"{spec.checkpoint.keep_last}{', the best' if spec.checkpoint.keep_best else ''} and one being written)",
            directory,
            max(0, kept * one - _used(directory)),
        ))
    last = spec.stages[-1].name
    needs.append(DiskNeed("the export", run_dir / "export",
                          export_bytes(stage_parameters(spec, last, vocab_size), vocab_size)))
    return needs

"""A stage's result: the verified checkpoint at its final step. What comes after a stage (a later stage
that starts from it, the evaluation, the export) reads this and never an older checkpoint."""

from __future__ import annotations

from pathlib import Path

from runyard.errors import RunyardError
from runyard.train import checkpoint


class StageResultMissing(RunyardError):
    """A stage passed its gates, but the checkpoint at its final step is not there or not intact."""


def stage_dir(run_dir: Path, stage: str) -> Path:
    return run_dir / "stages" / stage


def final_checkpoint(sdir: Path, steps: int) -> checkpoint.CheckpointRef:
    """The stage's result: its checkpoint at the final step `steps`, verified against its checksums.
    Raises StageResultMissing when the newest good checkpoint is an earlier one (or there is none)."""
    ref = checkpoint.latest_good(sdir / "checkpoints")
    if ref is None or ref.step != steps:
        found = "no intact checkpoint" if ref is None else f"the newest intact checkpoint is step {ref.step}"
        raise StageResultMissing(f"stage {sdir.name}: its final checkpoint (step {steps}) is missing or damaged; "
                                 f"{found}")
    return ref

"""A finished stage's gates judged again from its records, with the gates of an edited spec.

Every gate but one reads the stage's metrics log (and a fine-tuning stage's `before` figures), which is
what the stage recorded whichever session finished it, so judging again gives what a run with these
gates from the start would have given. The exception is `checkpoint_roundtrip`, which compares the live
model with its reloaded checkpoint when the stage ends: the recorded result stands; a stage that ended
without that gate gets its final checkpoint's checksums verified instead.
"""

from __future__ import annotations

from pathlib import Path

from runyard.spec.job import GateSpec
from runyard.train.finetune_metrics import read_record as read_finetune_record
from runyard.train.gates import GateResult, evaluate_recorded_gates
from runyard.train.metrics import MetricsLog
from runyard.train.stage_result import StageResultMissing, final_checkpoint


def needs_rejudging(record: dict, gates: GateSpec) -> bool:
    """Whether a recorded verdict was judged by other gates (or by gates it did not record)."""
    return record.get("judged_by") != gates.model_dump(mode="json")


def rejudge(gates: GateSpec, sdir: Path, steps: int, earlier: dict | None) -> list[GateResult]:
    """The stage's gates against its records; `earlier`: its gates.json, whose checkpoint_roundtrip
    result is kept."""
    rows = MetricsLog(sdir / "metrics.jsonl").read()
    before = read_finetune_record(sdir).get("before", {}).get("metrics", {})
    results = evaluate_recorded_gates(gates.model_copy(update={"checkpoint_roundtrip": False}), rows, None, None,
                                      heldout_start=before.get("heldout_loss"))
    if gates.checkpoint_roundtrip:
        recorded = [g for g in (earlier or {}).get("gates", []) if g.get("name") == "checkpoint_roundtrip"]
        if recorded:
            g = recorded[0]
            results.append(GateResult(g["name"], bool(g["passed"]), g["value"], g["bound"], g["detail"]))
        else:
            results.append(_checksums(sdir, steps))
    return results


def _checksums(sdir: Path, steps: int) -> GateResult:
    try:
        ref = final_checkpoint(sdir, steps)
    except StageResultMissing as exc:
        return GateResult("checkpoint_roundtrip", False, False, True, str(exc))
    return GateResult("checkpoint_roundtrip", True, True, True,
                      f"{ref.path.name} passes its checksums (judged again: the stage ended without this gate, "
                      "so its reload was not compared with the live model)")

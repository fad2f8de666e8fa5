"""Stage gates: the checks a stage must pass before a later stage may start.

Each gate is evaluated from what the stage recorded (its metrics.jsonl: losses, held-out loss,
throughput) and its final checkpoint, and recorded in `stages/<stage>/gates.json` with its measured
value and its bound, so a person can see why a stage passed or stopped the run. Reading the values
from metrics.jsonl, not from the session that happens to finish the stage, makes a stage resumed
after its last step (killed between the final checkpoint and gates.json, or stopped by SIGTERM in
its last step) pass or fail exactly as the uninterrupted run would.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from runyard.errors import RunyardError
from runyard.spec.job import GateSpec
from runyard.system.files import atomic_write_json
from runyard.train import checkpoint as ckpt

GATES_FILE = "gates.json"


@dataclass(frozen=True)
class GateResult:
    name: str
    passed: bool
    value: float | bool | None
    bound: float | bool | None
    detail: str


def compared(value: float, reference: float, unit: str = "") -> str:
    """`value` against `reference` in words that say which way it lies: "13.1% below", "13.1% above" or
    "equal to" (a negative percentage never stands for the other direction)."""
    if not (math.isfinite(value) and math.isfinite(reference)) or reference == 0:
        return "above" if value > reference else "below" if value < reference else "equal to"
    change = value / reference - 1
    if abs(change) < 5e-4:
        return "equal to"
    return f"{abs(change):.1%} {'above' if change > 0 else 'below'}"


def fell_or_rose(start: float, end: float) -> str:
    """How a loss moved from `start` to `end`: "fell 7.6%", "rose 3.0%" or "did not change"."""
    if not (math.isfinite(start) and math.isfinite(end)) or start == 0:
        return f"went from {start:.4g} to {end:.4g}"
    change = end / start - 1
    if abs(change) < 5e-4:
        return "did not change"
    return f"{'rose' if change > 0 else 'fell'} {abs(change):.1%}"


def loss_drop(losses: list[float]) -> float:
    """Fractional fall of the training loss: first window's mean against the last window's."""
    window = max(1, min(10, len(losses) // 5))
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    return (first - last) / first if first > 0 else 0.0


def _moved(drop: float) -> str:
    # A drop (fraction of the start) in words: a negative drop is a rise, said as one.
    if not math.isfinite(drop):
        return f"changed by {drop}"
    return "did not change" if abs(drop) < 5e-4 else f"{'fell' if drop > 0 else 'rose'} {abs(drop):.1%}"


def checkpoint_roundtrip_exact(checkpoint_path: Path, model: torch.nn.Module) -> tuple[bool, str]:
    """Reload the stage's final checkpoint and compare every tensor bitwise with the live model."""
    tensors, _state = ckpt.read_checkpoint(checkpoint_path)
    saved = tensors["model"]
    live = model.state_dict()
    if saved.keys() != live.keys():
        return False, f"keys differ: {sorted(set(saved) ^ set(live))[:5]}"
    for name, tensor in live.items():
        other = saved[name]
        if tensor.shape != other.shape or tensor.dtype != other.dtype:
            return False, f"{name}: shape/dtype differ"
        if not torch.equal(tensor.detach().cpu(), other.cpu()):
            return False, f"{name}: values differ after reload"
    return True, f"{len(live)} tensors identical after reload of {checkpoint_path.name}"


def evaluate_gates(
    gates: GateSpec,
    losses: list[float],
    heldout_loss: float | None,
    tokens_per_s: float,
    checkpoint_path: Path | None,
    model: torch.nn.Module,
    samples_per_s: float = 0.0,
    rewards: dict[str, float] | None = None,
    heldout_start: float | None = None,
) -> list[GateResult]:
    """Each set gate against the stage's record. `rewards`: a dpo stage's last held-out reward accuracy
    and margin (`heldout_reward_accuracy`, `heldout_reward_margin`); `heldout_start`: the held-out loss
    the stage started from."""
    results: list[GateResult] = []
    rewards = rewards or {}
    for name, field, key, what in (
        ("reward_accuracy", "min_reward_accuracy", "heldout_reward_accuracy", "held-out pairs whose chosen response gets the higher reward"),
        ("reward_margin", "min_reward_margin", "heldout_reward_margin", "held-out mean reward margin (chosen - rejected)"),
    ):
        bound = getattr(gates, field)
        if bound is not None:
            value = rewards.get(key)
            ok = value is not None and math.isfinite(value) and value >= bound
            results.append(GateResult(name, ok, value, bound, what))
    if gates.require_finite:
        bad = [i for i, v in enumerate(losses) if not math.isfinite(v)]
        finite = not bad and (heldout_loss is None or math.isfinite(heldout_loss))
        detail = "all losses finite" if finite else f"non-finite loss at steps {[i + 1 for i in bad[:5]]}"
        results.append(GateResult("finite", finite, finite, True, detail))
    if gates.min_loss_drop is not None:
        drop = loss_drop(losses) if losses else 0.0
        ok = math.isfinite(drop) and drop >= gates.min_loss_drop
        results.append(
            GateResult("loss_drop", ok, drop, gates.min_loss_drop, "training loss " + _moved(drop))
        )
    if gates.max_heldout_loss is not None:
        ok = heldout_loss is not None and math.isfinite(heldout_loss) and heldout_loss <= gates.max_heldout_loss
        results.append(
            GateResult("heldout_loss", ok, heldout_loss, gates.max_heldout_loss, "held-out loss at the end")
        )
    if gates.min_heldout_loss_drop is not None:
        drop = None
        if heldout_start is not None and heldout_loss is not None and heldout_start > 0:
            drop = (heldout_start - heldout_loss) / heldout_start
        ok = drop is not None and math.isfinite(drop) and drop >= gates.min_heldout_loss_drop
        detail = ("no held-out loss to compare" if drop is None
                  else f"held-out loss {heldout_start:.4f} -> {heldout_loss:.4f} ({_moved(drop)})")
        results.append(GateResult("heldout_loss_drop", ok, drop, gates.min_heldout_loss_drop, detail))
    if gates.min_tokens_per_s is not None:
        ok = tokens_per_s >= gates.min_tokens_per_s
        results.append(
            GateResult("throughput", ok, tokens_per_s, gates.min_tokens_per_s, "steady-state tokens/s")
        )
    if gates.min_samples_per_s is not None:
        ok = samples_per_s >= gates.min_samples_per_s
        results.append(
            GateResult("throughput", ok, samples_per_s, gates.min_samples_per_s, "steady-state images/s")
        )
    if gates.checkpoint_roundtrip:
        if checkpoint_path is None:
            results.append(GateResult("checkpoint_roundtrip", False, False, True, "no checkpoint was written"))
        else:
            ok, detail = checkpoint_roundtrip_exact(checkpoint_path, model)
            results.append(GateResult("checkpoint_roundtrip", ok, ok, True, detail))
    return results


def steady_tokens_per_s(rows: list[dict], key: str = "tokens_per_s") -> float:
    """Throughput over the steady state: the mean of the recorded steps' tokens/s (or `key`: an image
    stage's samples_per_s) after the first fifth, whose steps carry warm-up costs (allocation, compile).
    0.0 when nothing was recorded."""
    values = [float(r[key]) for r in rows if key in r]
    steady = values[len(values) // 5 :] or values
    return sum(steady) / len(steady) if steady else 0.0


def evaluate_recorded_gates(
    gates: GateSpec, rows: list[dict], checkpoint_path: Path | None, model: torch.nn.Module,
    heldout_start: float | None = None,
) -> list[GateResult]:
    """The stage's gates from its metrics log `rows` (one per step, in order) and its final checkpoint.
    `heldout_start`: the held-out loss of the stage's initial weights where it was measured (a fine-tuning
    stage's `before`); else the first held-out evaluation in `rows` stands for it."""
    losses = [float(r["loss"]) for r in rows if "loss" in r]
    held = [r["heldout_loss"] for r in rows if r.get("heldout_loss") is not None]
    rewards = {}
    for key in ("heldout_reward_accuracy", "heldout_reward_margin"):
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            rewards[key] = float(values[-1])
    return evaluate_gates(gates, losses, held[-1] if held else None, steady_tokens_per_s(rows),
                          checkpoint_path, model, samples_per_s=steady_tokens_per_s(rows, "samples_per_s"),
                          rewards=rewards, heldout_start=heldout_start if heldout_start is not None else
                          (held[0] if held else None))


def write_gates(stage_dir: Path, stage: str, results: list[GateResult], gates: GateSpec | None = None) -> dict:
    """Record the stage's gate results; `gates`, the spec they were judged by (a later session with other
    gates judges the stage again from its records: runyard.train.rejudge)."""
    record = {
        "stage": stage,
        "passed": all(r.passed for r in results),
        "gates": [asdict(r) for r in results],
    }
    if gates is not None:
        record["judged_by"] = gates.model_dump(mode="json")
    stage_dir.mkdir(parents=True, exist_ok=True)
    # fsynced: a later session skips a stage whose gates.json says it passed, so it must never be torn.
    atomic_write_json(stage_dir / GATES_FILE, record)
    return record


def read_gates(stage_dir: Path) -> dict | None:
    path = stage_dir / GATES_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        record["passed"]  # noqa: B018 (the one field every reader needs)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise RunyardError(
            f"{path} is damaged ({exc}); delete it to train stage {stage_dir.name} again"
        ) from None
    return record


def format_failures(record: dict) -> str:
    failed = [g for g in record["gates"] if not g["passed"]]
    return "; ".join(f"{g['name']}: {g['detail']} (value {g['value']}, bound {g['bound']})" for g in failed)

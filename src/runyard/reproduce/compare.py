"""Compare two run directories of the same spec: loss curves, held-out metrics, weights, and what
differed in inputs, environment and hardware that could explain a difference.

The verdict is one of
- `bitwise`: every stage's curve (train loss, held-out loss, gradient norm) equal at every step, the
  final held-out metrics equal, the exported weights byte-identical;
- `within_tolerance`: the same steps, and every loss within `tolerance` (nats) of the original;
- `different`: anything else, with the first step where the curves part.
Imports no torch: a market agent or a tenant's laptop can compare two deliveries.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runyard.reproduce.lock import FACTS_FILE, LOCK_DIR
from runyard.reproduce.manifest import read_manifest
from runyard.reproduce.source import changed_files
from runyard.system.files import sha256_file

# model/hf/export.py's PROVENANCE_FILE, named here so that comparing runs does not load torch.
EXPORT_RECORD = "runyard.json"

CURVE_FIELDS = ("loss", "heldout_loss", "grad_norm")
BITWISE, WITHIN_TOLERANCE, DIFFERENT = "bitwise", "within_tolerance", "different"
DEFAULT_TOLERANCE = 0.02  # nats per token: what two healthy runs on different hardware stay within on small runs


@dataclass
class StageComparison:
    name: str
    steps_compared: int
    steps_missing: list[int]  # steps the original has and the other does not, or the reverse
    max_abs_diff: float | None  # train loss
    heldout_max_abs_diff: float | None
    first_differing_step: int | None  # first step with any difference in a compared field
    first_parting_step: int | None  # first step where the train or held-out loss differs by more than the tolerance
    bitwise: bool


@dataclass
class Comparison:
    original: str
    other: str
    tolerance: float
    verdict: str
    expected: str  # what the two runs' hardware and builds lead one to expect
    stages: list[StageComparison]
    metrics: dict[str, dict]
    weights: dict
    input_differences: list[str] = field(default_factory=list)
    environment_differences: list[str] = field(default_factory=list)
    hardware_differences: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def read_metrics(run_dir: Path, stage: str) -> list[dict]:
    path = run_dir / "stages" / stage / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    return rows


def stage_names(run_dir: Path) -> list[str]:
    stages = run_dir / "stages"
    return sorted(p.name for p in stages.iterdir() if p.is_dir()) if stages.is_dir() else []


def _by_step(rows: list[dict]) -> dict[int, dict]:
    return {int(r["step"]): r for r in rows if "step" in r}


def _diff(a: object, b: object) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float):
        return None
    if math.isnan(a) and math.isnan(b):
        return 0.0
    return abs(float(a) - float(b))


def compare_stage(name: str, original: list[dict], other: list[dict], tolerance: float) -> StageComparison:
    a, b = _by_step(original), _by_step(other)
    common = sorted(set(a) & set(b))
    missing = sorted(set(a) ^ set(b))
    max_loss = max_held = None
    first_diff = first_part = None
    for step in common:
        ra, rb = a[step], b[step]
        if first_diff is None and any(ra.get(f) != rb.get(f) for f in CURVE_FIELDS):
            first_diff = step
        for fname, is_held in (("loss", False), ("heldout_loss", True)):
            d = _diff(ra.get(fname), rb.get(fname))
            if d is None:
                continue
            if is_held:
                max_held = d if max_held is None else max(max_held, d)
            else:
                max_loss = d if max_loss is None else max(max_loss, d)
            if first_part is None and (d > tolerance or math.isnan(d)):
                first_part = step
    bitwise = bool(common) and not missing and first_diff is None
    return StageComparison(name, len(common), missing, max_loss, max_held, first_diff, first_part, bitwise)


def _final_metrics(run_dir: Path) -> dict | None:
    path = run_dir / "eval" / "report.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("metrics")


def _weights(run_dir: Path) -> str | None:
    """One digest of the exported model: over every file its runyard.json lists (sharded weights,
    config, tokenizer, a table model's own files), else of a lone export/model.safetensors."""
    export = run_dir / "export"
    try:
        files = json.loads((export / EXPORT_RECORD).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        files = None
    if isinstance(files, dict) and files:
        return hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()
    path = export / "model.safetensors"
    return sha256_file(path) if path.is_file() else None


def _lock_facts(run_dir: Path) -> dict:
    path = run_dir / LOCK_DIR / FACTS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def input_differences(ma: dict, mb: dict) -> list[str]:
    """Seeds, spec and data that differ between two manifests."""
    out = []
    seeds_a, seeds_b = ma.get("seeds") or {}, mb.get("seeds") or {}
    if seeds_a.get("spec") != seeds_b.get("spec"):
        out.append(f"seed: {seeds_a.get('spec')} vs {seeds_b.get('spec')}")
    if ma.get("spec_sha256") != mb.get("spec_sha256"):
        out.append(f"spec sha256: {str(ma.get('spec_sha256'))[:16]}... vs {str(mb.get('spec_sha256'))[:16]}...")
    files_a, files_b = ma.get("data_files") or {}, mb.get("data_files") or {}
    inputs_a = ((ma.get("data") or {}).get("inputs")) or {}
    inputs_b = ((mb.get("data") or {}).get("inputs")) or {}
    for key in sorted(set(inputs_a) | set(inputs_b)):
        if inputs_a.get(key) == inputs_b.get(key):
            continue
        fa = (files_a.get(key) or {}).get("files") if isinstance(files_a.get(key), dict) else None
        fb = (files_b.get(key) or {}).get("files") if isinstance(files_b.get(key), dict) else None
        named = f" (files: {', '.join(changed_files(fa, fb)[:10])})" if fa is not None and fb is not None else ""
        out.append(f"data {key} differs{named}")
    fp_a, fp_b = (ma.get("data") or {}).get("fingerprint"), (mb.get("data") or {}).get("fingerprint")
    if fp_a != fp_b and not any(o.startswith("data sources[") for o in out):
        out.append(f"prepared data fingerprint: {str(fp_a)[:16]}... vs {str(fp_b)[:16]}...")
    return out


def environment_differences(la: dict, lb: dict) -> list[str]:
    """Interpreter, torch build, distributions, runyard's source and numerics settings that differ."""
    if not la or not lb:
        return ["one of the runs has no environment lock (env/environment.json): environments not compared"]
    out = []
    pa, pb = la.get("python") or {}, lb.get("python") or {}
    for key in ("implementation", "version", "platform", "libc"):
        if pa.get(key) != pb.get(key):
            out.append(f"python {key}: {pa.get(key)} vs {pb.get(key)}")
    ta, tb = la.get("torch") or {}, lb.get("torch") or {}
    for key in sorted(set(ta) | set(tb)):
        if ta.get(key) != tb.get(key):
            out.append(f"torch {key}: {ta.get(key)} vs {tb.get(key)}")
    da = {d["name"]: d for d in la.get("distributions", [])}
    db = {d["name"]: d for d in lb.get("distributions", [])}
    for name in sorted(set(da) | set(db)):
        if name == "runyard":
            continue  # compared by source below: an editable checkout and a wheel of it hold the same code
        a, b = da.get(name), db.get(name)
        if a is None or b is None:
            out.append(f"{name}: {'absent' if a is None else a['version']} vs {'absent' if b is None else b['version']}")
        elif a["version"] != b["version"]:
            out.append(f"{name}: {a['version']} vs {b['version']}")
        elif a.get("content_sha256") and b.get("content_sha256") and a["content_sha256"] != b["content_sha256"]:
            out.append(f"{name} {a['version']}: installed files differ (another build of the same version)")
    ra, rb = la.get("runyard") or {}, lb.get("runyard") or {}
    if ra.get("source_sha256") != rb.get("source_sha256"):
        files = changed_files(ra.get("files") or {}, rb.get("files") or {})
        out.append(f"runyard source differs in {len(files)} file(s): {', '.join(files[:10])}")
    na, nb = la.get("numerics_env") or {}, lb.get("numerics_env") or {}
    for key in sorted(set(na) | set(nb)):
        if na.get(key) != nb.get(key):
            out.append(f"${key}: {na.get(key, '(unset)')} vs {nb.get(key, '(unset)')}")
    return out


def hardware_differences(ma: dict, mb: dict) -> list[str]:
    ha, hb = ma.get("hardware") or {}, mb.get("hardware") or {}
    out = []
    for key in ("cpu", "cores", "platform"):
        if ha.get(key) != hb.get(key):
            out.append(f"{key}: {ha.get(key)} vs {hb.get(key)}")
    ga = [g.get("name") for g in ha.get("gpus") or []]
    gb = [g.get("name") for g in hb.get("gpus") or []]
    if ga != gb:
        out.append(f"GPUs: {ga or 'none'} vs {gb or 'none'}")
    return out


def _expected(ma: dict, mb: dict, la: dict, lb: dict) -> str:
    """Bitwise is to be expected only on CPUs of the same model with the same torch build and settings."""
    on_cpu = not (ma.get("hardware") or {}).get("gpus") and not (mb.get("hardware") or {}).get("gpus")
    same_build = bool(la) and (la.get("torch") or {}) == (lb.get("torch") or {})
    same_cpu = (ma.get("hardware") or {}).get("cpu") == (mb.get("hardware") or {}).get("cpu")
    same_numerics = (la.get("numerics_env") or {}) == (lb.get("numerics_env") or {})
    return BITWISE if on_cpu and same_build and same_cpu and same_numerics else WITHIN_TOLERANCE


def compare_runs(original: Path, other: Path, tolerance: float = DEFAULT_TOLERANCE) -> Comparison:
    """Compare run directory `other` against `original`."""
    names = stage_names(original)
    for name in stage_names(other):
        if name not in names:
            names.append(name)
    stages = [compare_stage(n, read_metrics(original, n), read_metrics(other, n), tolerance) for n in names]
    fa, fb = _final_metrics(original), _final_metrics(other)
    metrics = {}
    if fa is not None or fb is not None:
        for key in sorted(set(fa or {}) | set(fb or {})):
            va, vb = (fa or {}).get(key), (fb or {}).get(key)
            metrics[key] = {"original": va, "other": vb, "abs_diff": _diff(va, vb)}
    wa, wb = _weights(original), _weights(other)
    weights = {"original_sha256": wa, "other_sha256": wb, "equal": wa is not None and wa == wb}
    ma, mb = read_manifest(original), read_manifest(other)
    la, lb = _lock_facts(original), _lock_facts(other)
    metrics_equal = all(m["original"] == m["other"] for m in metrics.values())
    loss_metrics = [m["abs_diff"] for k, m in metrics.items() if k.endswith("loss")]
    if stages and all(s.bitwise for s in stages) and metrics_equal and (weights["equal"] or (wa is None and wb is None)):
        verdict = BITWISE
    elif stages and all(not s.steps_missing and s.steps_compared and s.first_parting_step is None for s in stages) \
            and all(d is not None and d <= tolerance for d in loss_metrics) and (fa is None) == (fb is None):
        verdict = WITHIN_TOLERANCE
    else:
        verdict = DIFFERENT
    return Comparison(
        original=str(original), other=str(other), tolerance=tolerance, verdict=verdict, expected=_expected(ma, mb, la, lb),
        stages=stages, metrics=metrics, weights=weights, input_differences=input_differences(ma, mb),
        environment_differences=environment_differences(la, lb), hardware_differences=hardware_differences(ma, mb),
    )

"""Opening a run directory for a spec: new, the same spec again, or an edited one.

An edited spec continues the run when no work already done depends on what changed (runyard.spec.diff):
the stored spec is replaced, the change is recorded in the manifest, and the stages' gates are judged
again from their records as the run reaches them. A change that alters work already done is refused,
naming each differing field and what would be trained again, unless `--restart-from STAGE` says so: the
work of that stage and every later one (and the export, and the data report when the data changed) is
moved into `superseded/<n>/`, never deleted, and trained again.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from runyard.errors import SpecChanged, SpecError
from runyard.reproduce import manifest as mf
from runyard.spec.diff import SpecChange, compare
from runyard.spec.job import JobSpec, dump_spec, load_spec
from runyard.system.files import atomic_write_text, fsync_dir
from runyard.train.stage_result import stage_dir

log = logging.getLogger(__name__)

SPEC_FILE = "spec.yaml"
SUPERSEDED_DIR = "superseded"


def open_run_dir(spec: JobSpec, run_dir: Path, restart_from: str | None = None) -> SpecChange | None:
    """Create the run directory, or continue it with `spec` (see the module's docstring). Returns what
    changed against the stored spec (None for a new run directory). Rank 0 only, under the run's lock."""
    names = [s.name for s in spec.stages]
    if restart_from is not None and restart_from not in names:
        raise SpecError("--restart-from", [("--restart-from", restart_from, f"one of the spec's stages {names}")])
    spec_path = run_dir / SPEC_FILE
    if not spec_path.is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(spec_path, dump_spec(spec))
        return None
    stored = load_spec(spec_path)
    change = compare(stored, spec)
    restart = names.index(restart_from) if restart_from is not None and not _restart_done(run_dir, spec, restart_from) else None
    keep = len(names) if change.first_changed_stage is None else change.first_changed_stage
    if restart is not None:
        keep = min(keep, restart)
    elif _has_work(run_dir, names[keep:]):
        raise SpecChanged(_refusal(change, run_dir, names))
    if change.none and restart is None:
        return change
    moved = _supersede(run_dir, stored, spec, keep, data=change.every_stage and restart is not None)
    atomic_write_text(spec_path, dump_spec(spec))
    manifest = mf.read_manifest(run_dir)
    manifest.setdefault("spec_changes", []).append({
        "at": mf.now_iso(),
        "from_spec_sha256": stored.fingerprint(),
        "to_spec_sha256": spec.fingerprint(),
        "changes": [str(c) for c in change.changes],
        "restart_from": restart_from if restart is not None else None,
        "job": os.environ.get("RUNYARD_JOB_ID"),
        "moved_to": moved,
    })
    manifest["spec_sha256"] = spec.fingerprint()
    mf.write_manifest(run_dir, manifest)
    for c in change.judgement:
        log.info("spec change %s: judged again, nothing retrained", c)
    for c in change.layout:
        log.info("spec change %s: a stage in progress continues from its last checkpoint under the new layout "
                 "(equal to an uninterrupted run within fp32 tolerance, not bitwise)", c)
    if moved:
        log.warning("restarting from stage %s: the earlier work is in %s", names[keep], moved)
    return change


def _refusal(change: SpecChange, run_dir: Path, names: list[str]) -> str:
    """Each change that alters work already done, what --restart-from would train again, and the changes
    that would only be judged again."""
    first = change.first_changed_stage or 0
    again = [n for n in names[first:] if _has_work(run_dir, [n])]
    lines = [f"{run_dir} was made by another version of this spec ({run_dir / SPEC_FILE}), and these changes "
             "alter work it has already done:"]
    lines += [f"  {c} (stage {names[i]} and every later stage start from it)" for c, i in change.altering]
    lines.append(f"Continuing would train stage{'s' if len(again) > 1 else ''} {', '.join(again)} again"
                 + (" and prepare the data again" if change.every_stage else "")
                 + f". To do so, add --restart-from {names[first]} (the work done moves to "
                 f"{run_dir / SUPERSEDED_DIR}/, nothing is deleted); or pick another --run-dir.")
    if change.judgement:
        lines.append("These changes alone would continue the run (gates and the final evaluation judged again):")
        lines += [f"  {c}" for c in change.judgement]
    return "\n".join(lines)


def _has_work(run_dir: Path, names: list[str]) -> bool:
    for name in names:
        sdir = stage_dir(run_dir, name)
        if sdir.is_dir() and any(sdir.iterdir()):
            return True
    return False


def _restart_done(run_dir: Path, spec: JobSpec, stage: str) -> bool:
    """A job the control plane restarts repeats its command line, --restart-from included: the restart is
    carried out once per job (the first attempt that reached it), never again on a later attempt."""
    job = os.environ.get("RUNYARD_JOB_ID")
    if job is None:
        return False
    return any(c.get("job") == job and c.get("restart_from") == stage and c.get("to_spec_sha256") == spec.fingerprint()
               for c in mf.read_manifest(run_dir).get("spec_changes", []))


def _supersede(run_dir: Path, stored: JobSpec, spec: JobSpec, keep: int, data: bool) -> str | None:
    """Move the work that the edited spec does not keep (stages from `keep` on, stages the edited spec no
    longer has, the export and evaluation, the data report when `data`) into superseded/<n>/."""
    kept = {s.name for s in spec.stages[:keep]}
    stages = run_dir / "stages"
    moving = [p for p in sorted(stages.iterdir()) if p.name not in kept] if stages.is_dir() else []
    if keep < len(spec.stages):
        moving += [p for p in (run_dir / "export", run_dir / "eval") if p.exists()]
        if data and (run_dir / "data").exists():
            moving.append(run_dir / "data")
    if not moving:
        return None
    root = run_dir / SUPERSEDED_DIR
    root.mkdir(exist_ok=True)
    target = root / str(1 + max((int(p.name) for p in root.iterdir() if p.name.isdigit()), default=0))
    target.mkdir()
    atomic_write_text(target / SPEC_FILE, dump_spec(stored))
    for path in moving:
        dest = target / path.relative_to(run_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        path.rename(dest)  # one filesystem: a rename, no copy
    fsync_dir(run_dir)
    return str(target)

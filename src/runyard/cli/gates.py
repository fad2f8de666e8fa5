"""`runyard gates RUN_DIR [--spec SPEC]`: a run's finished stages judged again from their records, with
the stored spec's gates or an edited spec's, without training and without writing anything."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from runyard.errors import EXIT_GATE_FAILED, RunyardError
from runyard.run.continuation import SPEC_FILE
from runyard.spec.diff import compare
from runyard.spec.job import load_spec, resolved_stage
from runyard.train.gates import read_gates
from runyard.train.rejudge import rejudge
from runyard.train.stage_result import stage_dir


def register(verbs: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    p = verbs.add_parser(
        "gates",
        help="judge a run's stages again with its spec's gates (or an edited spec's), without training",
        description="Judge each finished stage of RUN_DIR again from its records (metrics.jsonl, the "
        "fine-tuning figures, the recorded checkpoint check) with the gates of the stored spec, or of "
        "--spec. Reads only; `runyard run SPEC --run-dir RUN_DIR` then continues the run with those gates. "
        "A stage that an edited spec would train differently is not judged (it is named, with the fields). "
        "Exit codes: 0 every finished stage passes, 3 one fails, 1 an error, 2 a bad spec.",
    )
    p.add_argument("run_dir", type=Path, help="the run directory")
    p.add_argument("--spec", type=Path, default=None, help="an edited spec to judge with (default: the stored one)")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    p.set_defaults(handler=cmd_gates)


def cmd_gates(args) -> int:
    run_dir = args.run_dir
    if not (run_dir / SPEC_FILE).is_file():
        raise RunyardError(f"{run_dir} is not a run directory: it has no {SPEC_FILE}")
    stored = load_spec(run_dir / SPEC_FILE)
    spec = load_spec(args.spec) if args.spec is not None else stored
    if spec.task != "language_model":
        raise RunyardError(f"runyard gates judges a language model's stages from their records; a {spec.task} "
                           "stage is judged when it trains (`runyard run --restart-from STAGE`)")
    change = compare(stored, spec)
    altered = {i: [str(c) for c, at in change.altering if at <= i] for i in range(len(spec.stages))}
    verdicts = []
    for i, s in enumerate(spec.stages):
        sdir = stage_dir(run_dir, s.name)
        record = read_gates(sdir)
        entry = {"stage": s.name, "recorded": None if record is None else record["passed"]}
        if change.first_changed_stage is not None and i >= change.first_changed_stage:
            entry.update(state="trains differently", changes=altered[i])
        elif record is None:
            entry.update(state="not finished")
        else:
            results = rejudge(s.gates, sdir, resolved_stage(spec, s.name).train.steps, record)
            entry.update(state="passed" if all(r.passed for r in results) else "failed",
                         gates=[{"name": r.name, "passed": r.passed, "value": r.value, "bound": r.bound,
                                 "detail": r.detail} for r in results])
        verdicts.append(entry)
    if args.json:
        print(json.dumps({"run_dir": str(run_dir), "spec": str(args.spec or run_dir / SPEC_FILE),
                          "stages": verdicts}, indent=2))
    else:
        _print(verdicts)
    return EXIT_GATE_FAILED if any(v["state"] == "failed" for v in verdicts) else 0


def _print(verdicts: list[dict]) -> None:
    for v in verdicts:
        was = "" if v["recorded"] is None or v["state"] not in ("passed", "failed") else (
            f" (recorded: {'passed' if v['recorded'] else 'failed'})")
        print(f"stage {v['stage']}: {v['state']}{was}")
        for g in v.get("gates", []):
            value = f"{g['value']:.4g}" if isinstance(g["value"], float) else g["value"]
            print(f"  {'pass' if g['passed'] else 'FAIL'}  {g['name']}: {value} (bound {g['bound']}); {g['detail']}")
        for c in v.get("changes", []):
            print(f"  not judged: {c} changes how it trains")

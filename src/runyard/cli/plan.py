"""The `plan` verb: size a spec, measure what it will take here and on the recommended hardware, and
weigh training against a lifetime of inference."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
from collections.abc import Sequence
from pathlib import Path

from runyard.errors import SpecError
from runyard.plan.cost import format_money
from runyard.plan.lifetime import plot_lifetime
from runyard.plan.planner import Plan, layout_lines, make_plan, traffic_from
from runyard.plan.recommend import describe_devices
from runyard.plan.records_in import check_records_in
from runyard.plan.sizing import human_bytes
from runyard.plan.weights_in import check_weights_in
from runyard.run.execute import default_run_dir
from runyard.run.preflight import preflight
from runyard.spec.job import load_spec
from runyard.system.files import atomic_write_json

DESCRIPTION = """\
Plan a spec before any work: the data's facts and the model family they call for; per stage its parameters,
tokens (or samples) and FLOPs, its wall time here (data preparation, training, evaluation, checkpoints, the
final evaluation and export) and its memory (framework, model state, activations, evaluation batch, loader);
the training hardware chosen by need (the cheapest available kind, a CPU included, that holds the run and
finishes within a day, with the seed's table printed as a check); time, energy (kWh) and cost (the spec's
`costs`) on that hardware by the device table; and the requirement (accelerators, devices, duration) a market
or scheduler acts on, which --requirement-out writes for `runyard market demand --requirement`.

What is measured and what is estimated: this machine's matmul rate and disk are measured; every stage
is calibrated here. A language model's stages and the CNN's take real training steps of the stage's own
model at its micro-batch for a time budget (--budget-s, about 3 s a stage), and its text data a sample
run through the data stage's own steps. A table or images are read and checked in full by the run's own
reader, and that reading is timed; trees and the linear model are real fits of two row samples of the
table (time = rounds x (a + b x rows), the rounds early stopping keeps). The fixed costs of a table or
image run (start-up and imports, environment lock, reports and plots, export and ONNX) are measured once
per machine by a tiny real run and cached ($RUNYARD_PLAN_CACHE). Each calibration prints what it measured
and its spread across repeats.
--no-calibrate measures nothing (the device table and stated rates; a table or images are still read).

With --traffic (or the spec's `traffic` section) it also prints the inference cost per day on the
serving hardware and the day cumulative inference overtakes the training cost, as a table and a PNG. Every
kind in the device table, a CPU core included, is a candidate and the cheapest day at the traffic's peak
wins. A table or image model's capacity is its POST /v1/predict measured here on loopback (one row and
1,000-row requests, one core; cached per machine) and scaled to GPUs by the device table; a language
model's is its decoding measured here on a CPU, else the device table's roofline. The plan prints the
figure it used and how it was found. Before any of it, the sources must resolve (a path or glob that matches no file is an error, exit 2),
the initial weights and every sft/dpo record must be usable (data.on_bad_record: error lists every bad
record, exit 2), a table or images must be usable as the run will read them (no target column, one class,
a column mixing numbers and text, a missing value a policy refuses, an empty class folder, images of
different sizes without data.images.resize, an image that does not decode: exit 2), and the disk must hold
the data cache, the checkpoints and the export."""


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of requests per day, got {text!r}") from None
    if value < 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be 0 or more requests per day, got {text}")
    return value


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def register(verbs: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    p = verbs.add_parser(
        "plan",
        help="size a spec: time, memory, hardware, energy, cost, requirement; training vs inference",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("spec", type=Path, help="job spec (YAML)")
    p.add_argument("--traffic", type=_non_negative, default=None, metavar="REQUESTS_PER_DAY",
                   help="expected serving traffic (overrides the spec's traffic.requests_per_day)")
    units = p.add_mutually_exclusive_group()
    units.add_argument("--tokens-per-request", type=_at_least_one, default=None, metavar="N",
                       help="language models: tokens per request, prompt and completion (default: the spec's, "
                       "else the context length)")
    units.add_argument("--rows-per-request", type=_at_least_one, default=None, metavar="N",
                       help="tabular and image models: rows or images per request (default: the spec's, else 1)")
    p.add_argument("--png", type=Path, default=None, metavar="PATH",
                   help="where the training-vs-inference plot goes (default: <spec name>-lifetime.png here)")
    p.add_argument("--requirement-out", type=Path, default=None, metavar="FILE",
                   help="write the requirement as JSON, for `runyard market demand --requirement FILE`")
    p.add_argument("--no-calibrate", action="store_true",
                   help="measure nothing: time from the device table and stated rates (faster, rougher)")
    p.add_argument("--budget-s", type=float, default=3.0, metavar="S",
                   help="calibration time per stage, seconds (default 3; at least one real step runs)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(handler=cmd_plan)


def _serving_probe():
    """The /v1/predict probe (run/serving_probe.py) when the serving stack is installed; without it (a base
    install: the probe serves through uvicorn) the plan's serving capacity uses the stated figures and says so."""
    if any(importlib.util.find_spec(name) is None for name in ("uvicorn", "fastapi")):
        return None
    return importlib.import_module("runyard.run.serving_probe").predict_probe


def cmd_plan(args) -> int:
    spec = load_spec(args.spec)
    _check_units(spec.task, args)
    run_dir = default_run_dir(spec)
    pre = preflight(spec, run_dir)  # sources resolve (or exit 2), and the disk estimates
    check_weights_in(spec)  # the initial weights' directories, tokenizers and chat templates (or exit 2)
    scans = check_records_in(spec)  # every sft/dpo record parsed and checked (or exit 2, listing the bad ones)
    traffic = traffic_from(spec, args.traffic, args.tokens_per_request, args.rows_per_request)
    plan = make_plan(spec, pre.files, run_dir, calibrate=not args.no_calibrate, traffic=traffic,
                     budget_s=args.budget_s, serving_probe=_serving_probe())
    png = None
    if plan.lifetime is not None:
        png = plot_lifetime(plan.lifetime, args.png or Path(f"{spec.name}-lifetime.png"))
    if args.requirement_out:
        atomic_write_json(args.requirement_out, plan.requirement)
    if args.json:
        out = {**plan.to_dict(), "preflight": pre.to_dict(), "lifetime_png": str(png) if png else None}
        print(json.dumps(out, indent=2))
        return 0
    records = [f"records of stage {name}: {scan.records:,} checked, "
               + (f"{scan.bad_total:,} bad, left out (on_bad_record: skip)" if scan.bad_total else "none bad")
               for name, scan in scans.items()]
    for line in pre.lines() + records + plan_lines(plan):
        print(line)
    if png is not None:
        print(f"plot: {png}")
    if args.requirement_out:
        print(f"requirement written to {args.requirement_out}")
    return 0


def _check_units(task: str, args) -> None:
    if args.tokens_per_request is not None and task != "language_model":
        raise SpecError("plan command line", [("--tokens-per-request", args.tokens_per_request,
                                               f"--rows-per-request for a {task} spec (tokens are a language model's)")])
    if args.rows_per_request is not None and task == "language_model":
        raise SpecError("plan command line", [("--rows-per-request", args.rows_per_request,
                                               "--tokens-per-request for a language_model spec")])
    if args.budget_s <= 0:
        raise SpecError("plan command line", [("--budget-s", args.budget_s, "a positive number of seconds")])


def _seconds(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def plan_lines(plan: Plan) -> list[str]:
    """The plan as `runyard plan` prints it."""
    m, d = plan.machine, plan.data
    cur = plan.training_cost.currency
    here = "measured" if m.calibrated else "device table"
    out = [
        f"data: {d.facts.describe()}; preparation ~{_seconds(d.seconds)} ("
        + ", ".join(f"{k} {_seconds(v)}" for k, v in d.parts.items()) + f"; {d.how})",
        f"family: {plan.family.family or '(none registered)'}: {plan.family.why}",
        f"this machine: {describe_devices(m.kind, m.devices)}, matmul "
        f"{m.matmul_flops / 1e9:,.1f} GFLOP/s ({here}), disk {m.disk_write_bytes_s / 1e6:,.0f} MB/s, framework "
        f"{human_bytes(m.framework_rss_bytes)} resident",
    ]
    for s in plan.stages:
        p = s.plan
        phases = ", ".join(f"{k} {_seconds(v)}" for k, v in s.phases.items())
        out.append(
            f"stage {p.stage}: {p.family}, {p.parameters / 1e6:.2f}M params ({p.non_embedding_parameters / 1e6:.2f}M "
            f"non-embedding), {p.tokens / 1e6:.2f}M {p.unit}s, {p.training_flops:.3g} FLOPs; here ~{_seconds(s.seconds)} "
            f"({phases}; {s.how}); memory ~{human_bytes(s.memory.total)} (framework "
            f"{human_bytes(s.memory.framework)}, model state {human_bytes(s.memory.states)}, activations "
            f"{human_bytes(s.memory.activations)}, evaluation {human_bytes(s.memory.evaluation)}, loader "
            f"{human_bytes(s.memory.loader)}; {s.memory.how})"
        )
    if plan.final_phases:
        out.append("final: " + ", ".join(f"{k} {_seconds(v)}" for k, v in plan.final_phases.items()))
    if plan.fixed is not None:
        out.append(f"fixed costs of the run: ~{_seconds(plan.fixed.seconds)} ("
                   + ", ".join(f"{k} {_seconds(v)}" for k, v in plan.fixed.parts.items()) + f"; {plan.fixed.how})")
    out.append(f"total here: ~{_seconds(plan.total_seconds)}; peak memory ~{human_bytes(plan.peak_memory_bytes)} "
               f"({plan.memory_how})")
    hc = plan.here_cost
    out.append(f"energy and cost here: {hc.device_hours:,.3f} device-hours of {m.kind}, {hc.energy_kwh:,.4f} kWh, "
               f"{format_money(hc.minor_units, cur)} at {format_money(hc.price_per_device_hour, cur)}/device-hour")
    t, c = plan.training, plan.training_cost
    out.append(f"recommended training: {t.describe()} ({t.why})")
    out.append(f"  on it: ~{_seconds(plan.training_seconds)} (training by the device table; data preparation and the "
               f"final phase as here), {c.energy_kwh:,.3f} kWh, {format_money(c.minor_units, cur)} "
               f"({c.capacity} at {format_money(c.price_per_device_hour, cur)}/device-hour"
               + (", reserved discount applied" if c.capacity == "reserved" else "") + ")")
    out += layout_lines(plan)
    if plan.lifetime is not None:
        out += ["", *plan.lifetime.lines(), ""]
    out.append("requirement: " + json.dumps(plan.requirement))
    out += [f"warning: {w}" for w in plan.warnings]
    return out

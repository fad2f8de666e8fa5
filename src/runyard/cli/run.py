"""Verbs of a run's life: run, train, resume, generate, show (plan: cli/plan.py; serve: cli/serve.py)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler

from runyard.cli.readers import say_if_live
from runyard.cli.run_progress import describe_stage, finished_export, stage_progress
from runyard.errors import RunyardError, SpecError
from runyard.model.hf.export import export_eos_ids, load_export
from runyard.plan.layout_choice import check_named_layout
from runyard.reproduce.manifest import read_manifest
from runyard.run.continuation import SPEC_FILE, open_run_dir
from runyard.run.execute import default_run_dir, execute_run
from runyard.serve.engine import Generator
from runyard.spec.job import load_spec
from runyard.spec.tracking import TRACKING_FLAG_HELP, with_tracking_flags
from runyard.system import rundir
from runyard.system.progress import NO_PROGRESS_HELP, on_terminal
from runyard.train.launch import launch, run_worker, under_launcher

ONE_WRITER = (
    " One writer per run directory: while a run, train or resume writes it, another is refused with the "
    "writer's pid and host (the lock dies with its holder); generate, serve and show say when a run is live."
)
RUN_DIR_HELP = "run directory (default: runs/<spec name>, or $RUNYARD_RUNS_DIR/<spec name>)"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_launch_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distributed launch (torchrun)")
    g.add_argument("--nproc", type=_positive_int, default=None, help="worker processes on this node (default: the spec's resources.nproc)")
    g.add_argument("--nnodes", type=_positive_int, default=1, help="nodes in the job (multi-node: same command on each node)")
    g.add_argument("--node-rank", type=int, default=0, help="this node's rank among --nnodes")
    g.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous for multi-node jobs")
    g.add_argument("--max-restarts", type=int, default=0, help="restart the workers up to K times after a worker dies, resuming from the last good checkpoint")


def _add_restart_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--restart-from", metavar="STAGE", default=None,
                   help="train STAGE and every later stage again: their checkpoints, the export and evaluation "
                   "(and the data report, when the data changed) move to RUN_DIR/superseded/N/, nothing is "
                   "deleted. Needed when an edited spec changes work already done; under the control plane "
                   "it is carried out once per job, not again on a restarted attempt")


def _add_tracking_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracking", action="append", default=None, metavar="mlflow[=URI]|tensorboard",
                   help=TRACKING_FLAG_HELP)


def _tracked(spec, flags: list[str] | None):
    """The spec with --tracking applied (workers under torchrun are handed the same flags)."""
    if not flags:
        return spec
    return spec.model_copy(update={"tracking": with_tracking_flags(spec.tracking, flags)})


def register(verbs: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    for verb, evaluate, help_text, description in (
        (
            "run",
            True,
            "run a spec end to end: data, gated stages, evaluation, export",
            "Run (or continue) a job spec end to end: prepare the data, train each stage in order (a stage "
            "whose gates fail stops the run, exit 3), evaluate on held-out data, export the model, and print "
            "a summary. Re-running on an existing run directory continues where it stopped. Exit codes: 0 done "
            "and fit to ship, 1 an error, 2 the spec, its data or its initial weights were rejected before any "
            "work, 3 a stage's gates failed, 4 stopped by a signal after a checkpoint (resume continues it), 5 "
            "killed for going past its memory limit, 7 finished and exported but not fit to ship (the reasons "
            "are printed and in eval/report.md). An edited spec continues an existing run directory when no "
            "work done depends on what changed (gates, the verdict's bounds, prompts, a stage not trained "
            "yet): stages are judged again from their records (`runyard gates` shows the verdict without "
            "training); a change to work done is refused, naming each field, unless --restart-from says so.",
        ),
        (
            "train",
            False,
            "train a spec's stages (no evaluation or export)",
            "Prepare the data and train the spec's stages with their gates, without the final evaluation "
            "and export. Same options as `run`.",
        ),
    ):
        p = verbs.add_parser(verb, help=help_text, description=description + ONE_WRITER)
        p.add_argument("spec", type=Path, help="job spec (YAML)")
        p.add_argument("--run-dir", type=Path, default=None, help=RUN_DIR_HELP)
        p.add_argument("--stage", default=None, help=f"{verb} only this stage (earlier stages must have passed)")
        p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
        _add_restart_option(p)
        _add_tracking_option(p)
        _add_launch_options(p)
        p.set_defaults(handler=cmd_run, evaluate=evaluate)

    p = verbs.add_parser(
        "resume",
        help="continue a stopped run from its last good checkpoint",
        description="Continue the run in RUN_DIR with the spec stored there, from the newest checkpoint "
        "that passes its checksums. Passed stages are not trained again (a passed stage whose final "
        "checkpoint is damaged is retrained from its last good checkpoint first). Exit codes as `run`'s: 7 "
        "when the finished run is not fit to ship." + ONE_WRITER,
    )
    p.add_argument("run_dir", type=Path, help="the run directory")
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    _add_restart_option(p)
    _add_tracking_option(p)
    _add_launch_options(p)
    p.set_defaults(handler=cmd_resume, evaluate=True, stage=None)

    p = verbs.add_parser(
        "generate",
        help="sample a completion from a run's exported model",
        description="Load RUN_DIR/export (safetensors, tokenizer, config; no pickle) and complete a prompt.",
    )
    p.add_argument("run_dir", type=Path, help="run directory (or its export/ directory)")
    p.add_argument("--prompt", required=True, help="text to complete")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.set_defaults(handler=cmd_generate)

    p = verbs.add_parser(
        "show",
        help="summarise a run directory",
        description="Print a run's spec hash, manifest, stages with their gates, and evaluation verdict.",
    )
    p.add_argument("run_dir", type=Path, help="the run directory")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=cmd_show)


def _setup_logging() -> None:
    """Rich's handler on a terminal; plain one-line records elsewhere (a log file must not wrap a line
    at 80 columns, and each record keeps its time and level for grep)."""
    if on_terminal():
        handler: logging.Handler = RichHandler(show_path=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])


def _launching(args, spec) -> bool:
    """Whether this command starts workers via torchrun (more than one asked for, and not a worker yet)."""
    nproc = args.nproc if args.nproc is not None else spec.resources.nproc
    return not under_launcher() and (nproc > 1 or args.nnodes > 1 or args.max_restarts > 0)


def _restart_in_launcher(args, spec, run_dir: Path) -> str | None:
    """The --restart-from that execute_run is to carry out. Under torchrun the launcher carries it out
    itself, before its workers start, so that workers restarted by --max-restarts never move their own
    work aside again."""
    if not args.restart_from or not _launching(args, spec):
        return args.restart_from
    if args.node_rank != 0:  # node 0's launcher holds the run directory
        return None
    with rundir.writing(run_dir):
        open_run_dir(spec, run_dir, args.restart_from)
    return None


def _maybe_launch(args, spec, worker_argv: list[str], run_dir: Path | None = None) -> int | None:
    """When more than one worker is asked for and we are not a worker yet, start them via torchrun."""

    nproc = args.nproc if args.nproc is not None else spec.resources.nproc
    if not _launching(args, spec):
        return None
    return launch(
        worker_argv,
        nproc,
        run_dir=run_dir,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        max_restarts=args.max_restarts,
    )


def cmd_run(args) -> int:

    spec = _tracked(load_spec(args.spec), args.tracking)
    run_dir = args.run_dir or default_run_dir(spec)
    worker_argv = [args.verb, str(args.spec), "--run-dir", str(run_dir)]
    worker_argv += [f"--tracking={flag}" for flag in args.tracking or []]
    if args.stage:
        worker_argv += ["--stage", args.stage]
    if args.no_progress:
        worker_argv.append("--no-progress")
    if not under_launcher():  # before any work, as `runyard plan` checks it (a worker's launcher did)
        check_named_layout(spec)
    restart_from = _restart_in_launcher(args, spec, run_dir)
    launched = _maybe_launch(args, spec, worker_argv, run_dir)
    if launched is not None:
        return launched
    _setup_logging()

    def work() -> int:
        summary = execute_run(
            spec, run_dir, argv=sys.argv, only_stage=args.stage, show_progress=not args.no_progress,
            evaluate=args.evaluate, restart_from=restart_from,
        )
        _print_summary(summary)
        not_fit = summary.not_fit()
        if not_fit is not None:
            raise not_fit  # exit 7 (EXIT_NOT_FIT), after the summary: a script or CI notices
        return 0

    return run_worker(work)  # under torchrun: an outcome (exit 3, 4) is reported, not restarted


def cmd_resume(args) -> int:

    spec_path = args.run_dir / SPEC_FILE
    if not spec_path.is_file():
        raise RunyardError(f"{args.run_dir} is not a run directory: it has no {SPEC_FILE}")
    spec = _tracked(load_spec(spec_path), args.tracking)
    worker_argv = ["resume", str(args.run_dir)] + (["--no-progress"] if args.no_progress else [])
    worker_argv += [f"--tracking={flag}" for flag in args.tracking or []]
    restart_from = _restart_in_launcher(args, spec, args.run_dir)
    launched = _maybe_launch(args, spec, worker_argv, args.run_dir)
    if launched is not None:
        return launched
    _setup_logging()

    def work() -> int:
        summary = execute_run(spec, args.run_dir, argv=sys.argv, show_progress=not args.no_progress,
                              restart_from=restart_from)
        _print_summary(summary)
        not_fit = summary.not_fit()
        if not_fit is not None:
            raise not_fit  # exit 7 (EXIT_NOT_FIT), after the summary: a script or CI notices
        return 0

    return run_worker(work)


def _print_summary(summary) -> None:

    if int(os.environ.get("RANK", "0")) != 0:
        return
    console = Console(soft_wrap=True)  # long lines and samples stay whole when the output is not a terminal
    console.print(f"\n[bold]run directory[/bold]: {summary.run_dir.resolve()}")
    for s in summary.stages:
        console.print(
            f"  stage {s['name']}: {s['steps']} steps, final train loss {s['final_loss']:.3f}, "
            f"gates {'passed' if s['gates_passed'] else 'FAILED'}"
        )
    if summary.prediction is not None:
        p = summary.prediction
        line = ", ".join(f"{k} {v:.4f} (baseline {p['baseline'][k]:.4f})" for k, v in p["metrics"].items()
                         if v is not None and p["baseline"].get(k) is not None)
        console.print(f"[bold]test split[/bold] ({p['rows']} rows): {line}")
        console.print(f"fit to ship: {'yes' if summary.fit_to_ship else 'no'} (see eval/report.md)")
    if summary.metrics is not None:
        m = summary.metrics
        console.print(
            f"[bold]held-out perplexity[/bold] {m.heldout_perplexity:.2f} "
            f"(loss {m.heldout_loss:.3f})  vs  unigram baseline {m.unigram_perplexity:.2f} "
            f"(loss {m.unigram_loss:.3f});  train/held-out gap {m.gap:+.3f}"
        )
        console.print(f"fit to ship: {'yes' if summary.fit_to_ship else 'no'} (see eval/report.md)")
        for i, s in enumerate(summary.samples, 1):
            console.print(f"\n[bold]sample {i}[/bold] prompt {s['prompt']!r}:")
            console.print(s["prompt"] + s["completion"], markup=False, highlight=False)


def cmd_generate(args) -> int:

    # Checked here so a bad option is a usage error (exit 2), not a traceback from the sampler.
    problems = [
        (opt, value, expected)
        for opt, value, bad, expected in (
            ("--max-tokens", args.max_tokens, args.max_tokens < 0, "0 or more"),
            ("--temperature", args.temperature, args.temperature < 0, "0 (greedy) or more"),
            ("--top-k", args.top_k, args.top_k is not None and args.top_k < 1, "1 or more"),
            ("--top-p", args.top_p, args.top_p is not None and not 0 < args.top_p <= 1, "in (0, 1]"),
        )
        if bad
    ]
    if problems:
        raise SpecError("generate command line", problems)
    say_if_live(args.run_dir)
    export_dir = finished_export(args.run_dir)
    model, _cfg, tokenizer = load_export(export_dir)
    text = Generator(model, tokenizer, eos_ids=export_eos_ids(export_dir, tokenizer)).generate(
        args.prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    print(args.prompt + text)
    return 0


def cmd_show(args) -> int:

    run_dir = args.run_dir
    if not (run_dir / SPEC_FILE).is_file():
        raise RunyardError(f"{run_dir} is not a run directory: it has no {SPEC_FILE}")
    spec = load_spec(run_dir / SPEC_FILE)
    say_if_live(run_dir)
    manifest = read_manifest(run_dir)
    stages = stage_progress(run_dir, spec)
    report_path = run_dir / "eval" / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else None
    summary = {
        "run": spec.name,
        "run_dir": str(run_dir.resolve()),
        "spec_sha256": manifest.get("spec_sha256"),
        "started_at": manifest.get("started_at"),
        "finished_at": manifest.get("finished_at"),
        "git_commit": (manifest.get("code") or {}).get("git_commit"),
        "sessions": len(manifest.get("sessions", [])),
        "live": (holder := rundir.live_holder(run_dir)) is not None,
        "writer": holder.describe() if holder else None,
        "stages": stages,
        "fit_to_ship": report["fit_to_ship"] if report else None,
        "heldout_perplexity": report["metrics"]["heldout_perplexity"] if report and "metrics" in report else None,
        "unigram_perplexity": report["metrics"]["unigram_perplexity"] if report and "metrics" in report else None,
        "test_metrics": report["prediction"]["metrics"] if report and "prediction" in report else None,
        "exported": (run_dir / "export" / "runyard.json").is_file(),  # its provenance record, written last
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for key, value in summary.items():
        if key == "stages":
            for s in value:
                print(f"  stage {s['name']}: {describe_stage(s)}")
        else:
            print(f"{key}: {value}")
    return 0

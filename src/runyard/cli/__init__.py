"""The one command, `runyard`. Each verb group lives in its own module of this package and
registers its sub-parsers here; nothing outside runyard.cli parses a command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from runyard import __version__
from runyard.errors import EXIT_BAD_SPEC, EXIT_FAILURE, RunyardError
from runyard.system.diskspace import free_bytes, human_bytes, is_disk_full, mount_point

# Every top-level verb: the module that registers it, the extra its dependencies come from (None: the
# base install, the trainer), and its one-line help. `runyard --help` lists them without importing any
# module, and a command imports only its own verb's module: the trainer never loads the market's or the
# server's stack, and `runyard spec` never loads torch. tests/cli/test_verbs.py checks this table
# against what the modules register. A module's verbs are contiguous and in its own order.
VERBS: dict[str, tuple[str, str | None, str]] = {
    "run": ("runyard.cli.run", None, "run a spec end to end: data, gated stages, evaluation, export"),
    "train": ("runyard.cli.run", None, "train a spec's stages (no evaluation or export)"),
    "resume": ("runyard.cli.run", None, "continue a stopped run from its last good checkpoint"),
    "generate": ("runyard.cli.run", None, "sample a completion from a run's exported model"),
    "show": ("runyard.cli.run", None, "summarise a run directory"),
    "gates": (
        "runyard.cli.gates", None,
        "judge a run's stages again with its spec's gates (or an edited spec's), without training",
    ),
    "plan": (
        "runyard.cli.plan", None,
        "size a spec: time, memory, hardware, energy, cost, requirement; training vs inference",
    ),
    "serve": ("runyard.cli.serve", "serve", "serve a run's exported model over an OpenAI-compatible HTTP API"),
    "export-gguf": (
        "runyard.cli.export_gguf", "gguf", "write a run's exported decoder as a GGUF file for llama.cpp and Ollama",
    ),
    "spec": ("runyard.cli.spec", None, "the job spec's reference (Markdown, JSON Schema) and a starting spec"),
    "prepare": ("runyard.cli.data", None, "run the data stage alone and print its report"),
    "hydrate": ("runyard.cli.data", None, "copy a prepared dataset from its store into the local cache"),
    "env": ("runyard.cli.reproduce", None, "the environment lock of a run: write it, bundle its wheels, build it; prune the built ones"),
    "reproduce": (
        "runyard.cli.reproduce", None, "rebuild a run's environment, rerun its spec, and report whether the result held",
    ),
    "compare": ("runyard.cli.reproduce", None, "compare two run directories of the same spec"),
    "control": ("runyard.cli.control", "control", "run the provider's control plane (a local job scheduler)"),
    "submit": ("runyard.cli.control", "control", "queue a job spec on the control plane"),
    "queue": ("runyard.cli.control", "control", "list the control plane's jobs"),
    "job": ("runyard.cli.control", "control", "inspect or act on one job"),
    "market": ("runyard.cli.market", "market", "the open compute market: serve it, administer it, or trade on it"),
    "maintain": (
        "runyard.cli.maintain", "market",
        "keep a model served on a standing lease fit: drift buys its retraining, the retrained model is rolled out",
    ),
}


class MissingExtra(RunyardError):
    """A verb whose dependencies (the base install's or an extra's) are not installed."""


def verb_of(argv: list[str]) -> str | None:
    """The top-level verb a command line names: its first word that is not an option."""
    return next((word for word in argv if not word.startswith("-")), None)


def import_verb_module(verb: str, module_name: str | None = None) -> ModuleType:
    """The module that registers `verb` (its entry in VERBS), or `module_name`: a group of the verb's own that
    is loaded only when the command line names it (`runyard market serve`)."""
    try:
        return importlib.import_module(module_name or VERBS[verb][0])
    except ModuleNotFoundError as exc:
        raise missing_dependency(verb, exc) from exc


def missing_dependency(verb: str | None, exc: ModuleNotFoundError) -> Exception:
    """A third-party module a verb needs is not installed: say which, and what to install. (A runyard
    module that is missing is a broken install: that error goes up as it is.)"""
    if not exc.name or exc.name.split(".")[0] == "runyard" or verb not in VERBS:
        return exc
    extra = VERBS[verb][1]
    package = f"runyard[{extra}]" if extra else "runyard"
    role = f"the {extra!r} extra" if extra else "the trainer's dependencies (a base install)"
    return MissingExtra(
        f"`runyard {verb}` needs {role}, and {exc.name.split('.')[0]} is not installed: pip install '{package}'"
    )


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for this command line: the named verb's module registers its verbs for real; every
    other verb is listed by name and help only (so `runyard --help` shows them all)."""
    parser = argparse.ArgumentParser(
        prog="runyard",
        description=(
            "Train a model from raw data to an evaluated, reproducible, served artefact. "
            "A run goes: spec -> plan -> data -> staged training (gated) -> evaluation -> export."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"runyard {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    words = sys.argv[1:] if argv is None else argv
    wanted = verb_of(words)
    loaded = import_verb_module(wanted) if wanted in VERBS else None
    for verb, (module_name, _, help_text) in VERBS.items():
        if loaded is not None and module_name == loaded.__name__:
            if verb not in verbs.choices:
                # The whole command line goes along: a verb with groups of its own (`market`) loads only
                # the group it names, as this table does for the verbs.
                loaded.register(verbs, words)
        else:
            verbs.add_parser(verb, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    verb = verb_of(sys.argv[1:] if argv is None else argv)
    try:
        try:
            args = build_parser(argv).parse_args(argv)
            code = args.handler(args)
        except ModuleNotFoundError as exc:  # a role's stack imported lazily by the handler
            raise missing_dependency(verb, exc) from exc
    except RunyardError as exc:
        print(f"runyard: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("runyard: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        print(f"runyard: {disk_full_message(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    return int(code or 0)


def disk_full_message(exc: BaseException) -> str:
    """A full disk that no write site translated (they raise DiskFull): say so plainly, with what is known."""
    filename = getattr(exc, "filename", None)
    where = f" writing {filename}" if filename else ""
    place = filename or "."
    return (
        f"no space left on the device{where}: {human_bytes(free_bytes(place))} free on {mount_point(place)} "
        f"({type(exc).__name__}: {exc}). Free some space; `runyard plan SPEC` estimates what a run needs."
    )


def exit_bad_usage(message: str) -> int:
    print(f"runyard: {message}", file=sys.stderr)
    return EXIT_BAD_SPEC

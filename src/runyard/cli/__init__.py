"""The one command, `runyard`. Each verb group lives in its own module of this package and
registers its sub-parsers here; nothing outside runyard.cli parses a command line."""

from __future__ import annotations

import argparse
import importlib
import sys

from runyard import __version__
from runyard.diskspace import free_bytes, human_bytes, is_disk_full, mount_point
from runyard.errors import EXIT_BAD_SPEC, EXIT_FAILURE, RunyardError

# Modules that add verbs, in the order they appear in `runyard --help`.
VERB_MODULES = [
    "runyard.cli.run",
    "runyard.cli.plan",
    "runyard.cli.serve",
    "runyard.cli.spec",
    "runyard.cli.data",
    "runyard.cli.reproduce",
    "runyard.cli.control",
    "runyard.cli.market",
]


def build_parser() -> argparse.ArgumentParser:
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
    for name in VERB_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that verb group is not built yet
                continue
            raise
        module.register(verbs)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.handler(args)
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

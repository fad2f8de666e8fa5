"""Verbs about the job spec itself: `runyard spec reference` and `runyard spec init`."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from runyard.errors import RunyardError
from runyard.spec.job import TASKS, parse_spec
from runyard.spec.reference import (
    MARKDOWN_FILE,
    SCHEMA_FILE,
    entry_text,
    json_schema_text,
    markdown_reference,
)
from runyard.spec.templates import render_template
from runyard.system.files import atomic_write_text


def register(verbs: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    p = verbs.add_parser(
        "spec",
        help="the job spec's reference (Markdown, JSON Schema) and a starting spec",
        description="The job spec's reference, generated from runyard's own models, and commented starting "
        "specs. See `runyard spec reference --help` and `runyard spec init --help`.",
    )
    sub = p.add_subparsers(dest="spec_verb", metavar="SPEC_VERB", required=True)

    r = sub.add_parser(
        "reference",
        help="print the spec reference (Markdown or JSON Schema), or one field's entry",
        description="Print the job spec's reference: every field with its type, bounds, default and meaning. "
        "With FIELD (a dotted path such as data.filters.min_words, or a section such as data.filters), "
        "print that entry only. --format json prints the JSON Schema that editors use to complete and "
        "check a spec's YAML. --write-docs DIR writes both files (spec.md, spec.schema.json), as committed "
        "in docs/.",
    )
    r.add_argument("field", nargs="?", default=None, help="a field or section path (default: everything)")
    r.add_argument("--format", choices=("markdown", "json"), default="markdown", help="markdown (default) or json")
    r.add_argument("-o", "--output", type=Path, default=None, help="write to this file instead of stdout")
    r.add_argument("--write-docs", type=Path, default=None, metavar="DIR",
                   help=f"write DIR/{MARKDOWN_FILE} and DIR/{SCHEMA_FILE}")
    r.set_defaults(handler=cmd_reference)

    i = sub.add_parser(
        "init",
        help="write a commented starting spec for a task",
        description="Write a starting job spec for --task, every field commented with its meaning. It loads "
        "and runs as written (its data is this Python's standard library); point data.sources at your own "
        "files. Without PATH it is printed.",
    )
    i.add_argument("path", nargs="?", type=Path, default=None, help="file to write (default: stdout)")
    i.add_argument("--task", choices=TASKS, default=TASKS[0], help=f"what the run trains (default {TASKS[0]})")
    i.add_argument("--name", default=None, help="the run's name (default: PATH's stem, or my-run)")
    i.add_argument("--force", action="store_true", help="overwrite PATH if it exists")
    i.set_defaults(handler=cmd_init)


def _emit(text: str, output: Path | None) -> None:
    if output is None:
        sys.stdout.write(text)
    else:
        atomic_write_text(output, text)
        print(f"wrote {output}", file=sys.stderr)


def cmd_reference(args: argparse.Namespace) -> int:
    if args.write_docs is not None:
        atomic_write_text(args.write_docs / MARKDOWN_FILE, markdown_reference())
        atomic_write_text(args.write_docs / SCHEMA_FILE, json_schema_text())
        print(f"wrote {args.write_docs / MARKDOWN_FILE} and {args.write_docs / SCHEMA_FILE}", file=sys.stderr)
        return 0
    if args.field is not None:
        _emit(entry_text(args.field), args.output)
    elif args.format == "json":
        _emit(json_schema_text(), args.output)
    else:
        _emit(markdown_reference(), args.output)
    return 0


def _default_name(path: Path | None) -> str:
    if path is None:
        return "my-run"
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", path.stem).strip("-.") or "my-run"
    return slug[:100]


def cmd_init(args: argparse.Namespace) -> int:
    if args.path is not None and args.path.exists() and not args.force:
        raise RunyardError(f"{args.path} exists; pass --force to overwrite it")
    name = args.name or _default_name(args.path)
    text = render_template(args.task, name, str(args.path) if args.path else "SPEC")
    parse_spec(yaml.safe_load(text), "the starting spec")  # a bad --name is refused here, like any spec error
    _emit(text, args.path)
    return 0

"""The documentation's examples are real: every `runyard ...` command shown in a shell block of README.md or
a docs/ page parses with runyard's own argparse parser (a renamed verb or flag fails here, naming the page,
the line and the command), every YAML spec example validates with runyard's own spec loader (a renamed or
misplaced field fails here, naming the page, the line and the field), every repository path a shown command
names exists, and every relative link between the pages points at a file. Nothing is executed and nothing
is fetched."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from runyard.cli import build_parser
from runyard.errors import SpecError
from runyard.spec.job import parse_spec
from runyard.spec.templates import TEMPLATES

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console", "shell-session"}
SPEC_LANGUAGES = {"yaml", "yml"}
# A YAML example naming these is a whole spec and is validated as it stands; any other is a part of one.
WHOLE_SPEC_KEYS = {"name", "data"}
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}
# Paths of this repository that a command may name: each must exist.
REPO_PATH = re.compile(r"^(?:\./)?(?:examples|docs|scripts|benchmarks|\.ci)/[^\s*?{}<>$]*$")
# Markdown links [text](target) and images ![alt](target); the target ends at a space or ')'.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    text: str
    words: tuple[str, ...]

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}: {self.text}"


def code_blocks(page: Path) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of each fenced code block of a Markdown page."""
    blocks, current = [], None
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        match = FENCE.match(line)
        if current is None:
            if match:
                current = (match.group(1), match.group(2).lower(), number + 1, [])
        elif (
            match
            and match.group(1).startswith(current[0][0])
            and len(match.group(1)) >= len(current[0])
            and not match.group(2)
        ):
            blocks.append((current[1], current[2], current[3]))
            current = None
        else:
            current[3].append(line)
    assert current is None, (
        f"{page.relative_to(REPO)}: a code block opened on line {current[2] - 1} never closes"
    )
    return blocks


def logical_lines(first: int, lines: list[str]) -> list[tuple[int, str]]:
    """A shell block's lines with `\\` continuations joined and `$ ` prompts removed, each with its line number."""
    joined, start, parts = [], None, []
    for number, line in enumerate(lines, start=first):
        if start is None:
            start = number
            line = re.sub(r"^\s*[$%] ", "", line)
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        joined.append((start, " ".join(part.strip() for part in parts)))
        start, parts = None, []
    if parts:
        joined.append((start, " ".join(part.strip() for part in parts)))
    return joined


def split_words(text: str) -> list[str] | None:
    """Shell words with comments dropped and control operators as words of their own (None: not shell)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:
        return None


def simple_commands(words: list[str]) -> list[list[str]]:
    """The simple commands of a shell line (split at `&&`, `||`, `;`, `|`), each without its `VAR=value`
    prefixes and `env`."""
    commands, current = [], []
    for word in [*words, ";"]:
        if word in OPERATORS or set(word) <= set(";&|"):
            if current:
                commands.append(current)
            current = []
            continue
        if not current and (ENV_ASSIGNMENT.match(word) or word == "env"):
            continue
        current.append(word)
    return commands


def runyard_args(command: list[str]) -> list[str] | None:
    """The arguments after `runyard` (also `.venv/bin/runyard`, `python -m runyard`), or None for another program."""
    program = command[0]
    if program == "runyard" or program.endswith("/bin/runyard"):
        return command[1:]
    if re.fullmatch(r"(\S*/)?python3?(\.\d+)?", program) and command[1:3] == ["-m", "runyard"]:
        return command[3:]
    return None


def shown_commands() -> list[Command]:
    """Every simple command in the shell blocks of README.md and docs/*.md."""
    commands = []
    for page in PAGES:
        for language, first, lines in code_blocks(page):
            if language not in SHELL_LANGUAGES:
                continue
            for number, text in logical_lines(first, lines):
                words = split_words(text)
                if words is None:
                    assert not re.search(r"(^|[\s;&|])runyard\s", text), (
                        f"{page.relative_to(REPO)}:{number}: not shell: {text}"
                    )
                    continue  # output shown after a command
                for command in simple_commands(words):
                    commands.append(Command(page, number, text.strip(), tuple(command)))
    return commands


@dataclass(frozen=True)
class SpecExample:
    page: Path
    line: int
    raw: dict

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def spec_examples() -> list[SpecExample]:
    """Every YAML block of README.md and docs/*.md that holds a mapping (a block of comments alone, such as
    the schema modeline, holds nothing to check)."""
    examples = []
    for page in PAGES:
        for language, first, lines in code_blocks(page):
            if language not in SPEC_LANGUAGES:
                continue
            raw = yaml.safe_load("\n".join(lines))
            if raw is None:
                continue
            assert isinstance(raw, dict), f"{page.relative_to(REPO)}:{first}: a YAML example that is not a mapping"
            examples.append(SpecExample(page, first, raw))
    return examples


def merged(base: dict, part: dict) -> dict:
    """`part` laid over `base`: mappings merge key by key, anything else (a list of stages, a value) replaces."""
    out = dict(base)
    for key, value in part.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def spec_problem(raw: dict, where: str) -> str | None:
    """None when runyard's spec loader accepts the example, else its SpecError (each field, value and what
    was expected). A part of a spec is laid over the `runyard spec init` template of its task (the
    language model's when it names none), so it is checked in a whole spec, cross-field checks included."""
    whole = raw if raw.keys() >= WHOLE_SPEC_KEYS else merged(TEMPLATES[raw.get("task", "language_model")]("docs"), raw)
    try:
        parse_spec(whole, where)
    except SpecError as exc:
        return str(exc)
    return None


def refuse_abbreviations(parser: argparse.ArgumentParser) -> None:
    """argparse accepts any unambiguous prefix of a flag (`--max-restart`); the pages must spell flags whole,
    so a flag renamed to a longer name still fails here."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in set(action.choices.values()):
                refuse_abbreviations(subparser)


def parse_error(args: list[str]) -> str | None:
    """None when runyard's real parser accepts this command line, else argparse's message. Only parses:
    the verb's handler is never called (`--help` and `--version` print and stop, as they would)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            parser = build_parser(args)
            refuse_abbreviations(parser)
            parser.parse_args(args)
    except SystemExit as stop:
        if stop.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {stop.code}"
    except argparse.ArgumentError as exc:
        return str(exc)
    return None


SPEC_EXAMPLES = spec_examples()
COMMANDS = shown_commands()
RUNYARD_COMMANDS = [c for c in COMMANDS if runyard_args(list(c.words)) is not None]


def test_every_code_block_names_its_language():
    """So no shell block escapes the checks below by being unlabelled (trees and output are `text`)."""
    unnamed = [
        f"{page.relative_to(REPO)}:{first - 1}"
        for page in PAGES
        for language, first, _ in code_blocks(page)
        if not language
    ]
    assert not unnamed, f"code blocks without a language: {unnamed}"


def test_the_pages_show_runyard_commands():
    pages = {c.page.name for c in RUNYARD_COMMANDS}
    assert "README.md" in pages and len(RUNYARD_COMMANDS) > 40, sorted(pages)


@pytest.mark.parametrize("command", RUNYARD_COMMANDS, ids=lambda c: f"{c.page.name}:{c.line}")
def test_each_runyard_command_parses_with_the_real_parser(command):
    error = parse_error(runyard_args(list(command.words)))
    assert error is None, f"{command.where()}\n  runyard's parser refuses it: {error}"


def test_the_pages_show_spec_examples():
    assert len(SPEC_EXAMPLES) >= 2, [e.where() for e in SPEC_EXAMPLES]


@pytest.mark.parametrize("example", SPEC_EXAMPLES, ids=lambda e: f"{e.page.name}:{e.line}")
def test_each_spec_example_validates_with_the_real_spec_loader(example):
    problem = spec_problem(example.raw, example.where())
    assert problem is None, f"{example.where()}: the spec example is refused by runyard's spec loader:\n{problem}"


@pytest.mark.parametrize(
    "text, wrong",
    [
        ("stages:\n  - name: sft\n    kind: sft\n    sft: {task_metrik: exact_match}\n", "stages[0].sft.task_metrik"),
        ("model:\n  init: {from: huggingface, path: models/x}\n", "model.init"),
        ("stages:\n  - name: a\n    model: {init: {from: stage, name: b}}\n  - name: b\n", "stages[0].model.init.name"),
        ("name: whole\ndata: {sources: [{path: a.txt}]}\nmodel: {d_modle: 64}\n", "model.d_modle"),
    ],
    ids=["renamed-key", "value-out-of-choices", "cross-field", "whole-spec"],
)
def test_a_drifted_spec_example_is_caught(text, wrong):
    """A renamed key, a value out of its choices, a cross-field mistake (a stage that starts from a later
    one), and in a whole spec a misspelt field: each is refused, naming the field."""
    assert wrong in (spec_problem(yaml.safe_load(text), "docs/example.md:1") or "")


def test_each_repository_path_a_command_names_exists():
    missing = []
    for command in COMMANDS:
        program, *rest = command.words
        words = [program, *rest] if runyard_args(list(command.words)) is not None or "/" in program else []
        # Not `source`: what it reads may be generated (.ci/env).
        if program in {"bash", "sh", "python", "python3"}:
            words = list(command.words)
        for word in words:
            path = word.split("=", 1)[1] if word.startswith("-") and "=" in word else word
            if REPO_PATH.match(path) and not (REPO / path).exists():
                missing.append(f"{command.where()}\n  no such file: {path}")
    assert not missing, "\n".join(missing)


def test_the_readme_commands_exist():
    shown = {c.words[0] for c in COMMANDS if c.page.name == "README.md"}
    assert {"scripts/demo.sh", "scripts/test.sh"} <= shown
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert (REPO / script).is_file(), script


def test_every_relative_link_points_at_a_file():
    broken = []
    for page in PAGES:
        in_code = False
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
            if FENCE.match(line):
                in_code = not in_code
            if in_code:
                continue
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue  # a URL (https:, mailto:) or an anchor on the same page
                path = target.split("#", 1)[0]
                if not (page.parent / path).exists():
                    broken.append(f"{page.relative_to(REPO)}:{number}: {target}")
    assert not broken, "links to no file:\n" + "\n".join(broken)


def test_the_site_lists_every_page():
    """mkdocs.yml's nav names every docs/*.md page (mkdocs --strict also refuses a page left out)."""
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    missing = [
        page.name for page in PAGES[1:] if not re.search(rf":\s*{re.escape(page.name)}\s*$", nav, re.M)
    ]
    assert not missing, f"docs pages not in mkdocs.yml's nav: {missing}"


@pytest.mark.parametrize(
    "args, wrong",
    [
        (["run", "examples/stdlib-code.yaml", "--stages", "smoke"], "unrecognized arguments"),
        (["trian", "SPEC"], "invalid choice"),
        (["market", "leases", "--no-such-flag"], "unrecognized arguments"),
        (["run", "SPEC", "--max-restart", "3"], "unrecognized arguments"),  # a prefix of --max-restarts
    ],
)
def test_a_renamed_verb_or_flag_is_caught(args, wrong):
    assert wrong in (parse_error(args) or "")


def test_line_continuations_prompts_comments_and_env_prefixes():
    lines = logical_lines(
        10,
        [
            "$ RUNYARD_FAULT_SEED=3 runyard run SPEC \\",
            "    --nproc 2   # two workers",
            "a && runyard show RUN_DIR; runyard queue",
        ],
    )
    assert lines == [
        (10, "RUNYARD_FAULT_SEED=3 runyard run SPEC --nproc 2   # two workers"),
        (12, "a && runyard show RUN_DIR; runyard queue"),
    ]
    commands = [simple_commands(split_words(text)) for _, text in lines]
    assert commands == [
        [["runyard", "run", "SPEC", "--nproc", "2"]],
        [["a"], ["runyard", "show", "RUN_DIR"], ["runyard", "queue"]],
    ]

"""The CLI's verb table: `runyard --help` lists every verb without importing its module, a command imports
only its own verb's module, and the table says exactly what the modules register."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from runyard.cli import VERBS, MissingExtra, build_parser, import_verb_module, verb_of


def registered_by(module_name: str) -> list[tuple[str, str]]:
    parser = argparse.ArgumentParser()
    verbs = parser.add_subparsers()
    importlib.import_module(module_name).register(verbs, [])
    return [(action.dest, action.help) for action in verbs._choices_actions]


def test_the_table_is_what_the_modules_register_in_their_order():
    for library in ("fastapi", "sqlalchemy", "httpx"):  # every role's stack (absent in the trainer's venv)
        pytest.importorskip(library)
    modules = list(dict.fromkeys(module for module, _, _ in VERBS.values()))
    expected = [pair for module in modules for pair in registered_by(module)]
    assert [(verb, help_text) for verb, (_, _, help_text) in VERBS.items()] == expected


def test_top_level_help_lists_every_verb_and_imports_none_of_their_modules():
    probe = (
        "import sys\n"
        "from runyard.cli import VERBS, build_parser\n"
        "text = build_parser(['--help']).format_help()\n"
        "missing = [v for v in VERBS if v not in text]\n"
        "loaded = sorted({m for m, _, _ in VERBS.values()} & set(sys.modules))\n"
        "heavy = sorted({'torch', 'fastapi', 'sqlalchemy', 'uvicorn'} & set(sys.modules))\n"
        "print(missing, loaded, heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] [] []"


@pytest.mark.parametrize("words, absent", [
    (["spec"], ["torch", "fastapi", "sqlalchemy"]),
    (["train"], ["fastapi", "sqlalchemy", "uvicorn", "httpx", "alembic"]),
    (["market"], ["torch"]),
    # a tenant's trading verb loads neither the store nor the server the administration verbs need
    (["market", "demand"], ["torch", "fastapi", "sqlalchemy", "uvicorn", "alembic"]),
], ids=["spec-absent0", "train-absent1", "market-absent2", "market-demand-absent3"])  # ids as before the cases took words
def test_a_command_loads_only_its_own_stack(words, absent):
    if words[0] == "market":
        pytest.importorskip("sqlalchemy")
    probe = (
        "import sys\n"
        f"from runyard.cli import build_parser\n"
        f"build_parser({[*words, '--help']!r})\n"
        f"print(sorted(set({absent!r}) & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_verb_is_the_first_word_that_is_not_an_option():
    assert verb_of(["--version"]) is None
    assert verb_of(["-h", "train", "spec.yaml"]) == "train"
    assert verb_of(["plan", "--json", "x"]) == "plan"


def test_the_named_verb_parses_for_real():
    args = build_parser(["show", "some/run"]).parse_args(["show", "some/run"])
    assert callable(args.handler)


def test_a_market_group_not_named_is_listed_and_the_named_one_parses():
    pytest.importorskip("sqlalchemy")
    trading = ["market", "demand", "--kinds", "l4", "--devices", "1", "--duration-s", "60", "--max-price", "5"]
    parser = build_parser(trading)
    assert callable(parser.parse_args(trading).handler)
    listed = parser.format_help() + next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["market"].format_help()
    assert "serve" in listed and "admin" in listed  # the administration verbs, by name and help
    serving = ["market", "serve", "--db", "m.db", "--port", "1"]
    assert build_parser(serving).parse_args(serving).port == 1
    admin = ["market", "admin", "token", "ops", "--db", "m.db"]
    assert build_parser(admin).parse_args(admin).name == "ops"


def test_a_missing_extra_names_the_extra(monkeypatch):
    real_import = importlib.import_module

    def without_fastapi(name, *rest):
        if name == "runyard.cli.serve":
            raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")
        return real_import(name, *rest)

    monkeypatch.setattr(importlib, "import_module", without_fastapi)
    with pytest.raises(MissingExtra, match=r"`runyard serve` needs the 'serve' extra, and fastapi is not installed"):
        import_verb_module("serve")


def _every_subparser(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _every_subparser(sub, (*path, name))


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_verb_and_sub_verb_has_a_help_that_renders(verb):
    """argparse formats help with %: a description with its own % (a fee's "100 = 1%") once crashed
    `runyard market admin fee --help`."""
    for library in ("fastapi", "sqlalchemy", "httpx"):
        pytest.importorskip(library)
    for path, parser in _every_subparser(build_parser([verb, "--help"])):
        if path and path[0] != verb:
            continue
        assert parser.format_help().strip(), f"runyard {' '.join(path)} --help is empty"

"""`runyard prepare` and `runyard hydrate` through the real command-line entry point."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from runyard.cli import data as data_cli
from runyard.errors import EXIT_BAD_SPEC, RunyardError
from tests.data.data_fixtures import write_corpus


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="runyard")
    data_cli.register(parser.add_subparsers(dest="verb", required=True), argv)
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except RunyardError as exc:
        return exc.exit_code


def write_spec(tmp_path: Path, corpus: Path, **data) -> Path:
    spec = {
        "name": "t",
        "seed": 3,
        "data": {
            "sources": [{"path": str(corpus / "*.txt")}],
            "tokenizer": {"vocab_size": 300},
            "workers": 1,
            "shard_tokens": 1024,
            **data,
        },
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_prepare_then_hydrate(tmp_path: Path, capsys):
    corpus = write_corpus(tmp_path / "corpus", n_docs=30)
    spec = write_spec(tmp_path, corpus, store={"url": str(tmp_path / "store")})
    assert (
        run_cli(
            [
                "prepare",
                str(spec),
                "--cache-dir",
                str(tmp_path / "c"),
                "--no-progress",
                "--report-dir",
                str(tmp_path / "rep"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "Data report" in out and "published to" in out
    assert (tmp_path / "rep" / "report.md").exists()
    assert run_cli(["hydrate", str(spec), "--cache-dir", str(tmp_path / "node"), "--no-progress"]) == 0
    assert "MB/s" in capsys.readouterr().out
    assert list((tmp_path / "node" / "datasets").glob("*/prepared.json"))


def test_bad_spec_exits_2(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "data": {"sources": [{"path": "x", "format": "csv"}]}}))
    assert run_cli(["prepare", str(path)]) == EXIT_BAD_SPEC


def test_example_prose_spec(tmp_path: Path, monkeypatch, capsys):
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    rep = tmp_path / "rep"
    code = run_cli(
        [
            "prepare",
            "examples/data/prose-notes.yaml",
            "--cache-dir",
            str(tmp_path / "c"),
            "--report-dir",
            str(rep),
            "--no-progress",
        ]
    )
    assert code == 0
    stats = json.loads((rep / "report.json").read_text())
    assert stats["read"]["bad_records"] == 1
    assert stats["removed"] == {"too_few_words": 1, "top_ngram_repetition": 1}
    assert stats["dedup"]["exact_removed"] == 1
    assert stats["pii"]["email"] > 0 and stats["pii"]["phone"] > 0 and stats["pii"]["ip_address"] > 0

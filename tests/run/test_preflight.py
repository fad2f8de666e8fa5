"""Before any work: sources that match nothing fail in `plan`, the disk estimates hold what is really
written, and the spec is checked against its prepared data with errors that suggest a fix and
warnings that name the field."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from runyard import cli
from runyard.data.footprint import data_cache_bytes
from runyard.data.pipeline import prepare_data
from runyard.data.sources import list_input_files
from runyard.errors import EXIT_BAD_SPEC, SpecError
from runyard.model.config import ModelConfig
from runyard.model.transformer import Transformer
from runyard.plan.datacheck import check_spec_against_data
from runyard.plan.disk import checkpoint_bytes, checkpoints_kept, run_dir_needs, stage_parameters
from runyard.run.preflight import preflight, resolve_sources
from runyard.spec.data import DataSpec
from runyard.spec.job import parse_spec
from runyard.train.checkpoint import write_checkpoint
from tests.data.data_fixtures import write_corpus


def spec_with(sources: list[dict], **extra) -> dict:
    return {"name": "t", "data": {"sources": sources, "workers": 1, **extra.pop("data", {})}, **extra}


def test_a_source_that_matches_nothing_is_a_spec_error_naming_it(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    spec = parse_spec(spec_with([
        {"path": str(tmp_path / "*.txt")},
        {"path": str(tmp_path / "**" / "*.rst")},
        {"path": str(tmp_path / "*.txt"), "exclude": ["*/a.txt"]},
        {"path": "docs-that-moved/*.md"},
    ]))
    with pytest.raises(SpecError) as info:
        resolve_sources(spec.data)
    problems = {path: (value, expected) for path, value, expected in info.value.problems}
    assert set(problems) == {"data.sources[1].path", "data.sources[2].path", "data.sources[3].path"}
    assert "matched none" in problems["data.sources[1].path"][1]
    assert "matches 1 but data.sources[2].exclude ['*/a.txt'] leaves none" in problems["data.sources[2].path"][1]
    assert f"relative to {Path.cwd()}" in problems["data.sources[3].path"][1]
    assert all("(see docs/spec.md#data.sources.path)" in e for _v, e in problems.values())


def test_plan_fails_on_a_glob_that_matches_nothing_and_reports_disk_otherwise(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(spec_with([{"path": str(tmp_path / "nothing" / "*.txt")}])))
    assert cli.main(["plan", str(bad)]) == EXIT_BAD_SPEC
    err = capsys.readouterr().err
    assert "data.sources[0].path" in err and "matched none" in err
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(spec_with([{"path": "{stdlib}/json/*.py"}])))
    assert cli.main(["plan", str(good), "--json"]) == 0
    pre = json.loads(capsys.readouterr().out)["preflight"]
    assert pre["sources"][0]["files"] >= 3 and pre["disk"][0]["fits"] is True
    whats = [n["what"] for n in pre["disk"][0]["needs"]]
    assert whats[0].startswith("the data cache") and any("stage main checkpoints" in w for w in whats)


def test_checkpoint_estimate_holds_a_real_checkpoint(tmp_path):
    spec = parse_spec(spec_with([{"path": "x"}], model={"d_model": 64, "n_layers": 2, "n_heads": 4}))
    params = stage_parameters(spec, "main", 512)
    model = Transformer(ModelConfig.from_spec(spec.model, 512))
    assert params == model.num_parameters()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).float().sum().backward()
    optimizer.step()  # the moments exist only after a step
    path = write_checkpoint(tmp_path / "ck", 1, {"model": model.state_dict(), "optim": optimizer.state_dict()}, {})
    written = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert written <= checkpoint_bytes(params) <= 1.2 * written + (1 << 20)


def test_run_dir_needs_count_kept_checkpoints_and_what_a_resumed_stage_has(tmp_path):
    spec = parse_spec(spec_with([{"path": "x"}], stages=[{"name": "a"}, {"name": "b"}],
                                checkpoint={"keep_last": 3, "keep_best": False}))
    one = checkpoint_bytes(stage_parameters(spec, "a", 4096))
    needs = {n.what.split(":")[0]: n for n in run_dir_needs(spec, tmp_path, 4096)}
    assert checkpoints_kept(spec) == 4 and needs["stage a checkpoints"].bytes == 4 * one
    existing = tmp_path / "stages" / "a" / "checkpoints" / "step_00000010"
    existing.mkdir(parents=True)
    (existing / "model.pt").write_bytes(b"\0" * 1000)
    resumed = {n.what.split(":")[0]: n for n in run_dir_needs(spec, tmp_path, 4096, stages_done={"b"})}
    assert resumed["stage a checkpoints"].bytes == 4 * one - 1000 and "stage b checkpoints" not in resumed
    assert resumed["the export"].bytes > 0


def test_data_cache_estimate_holds_what_preparation_writes(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=30)
    spec = DataSpec.model_validate({"sources": [{"path": str(corpus / "*.txt")}], "tokenizer": {"vocab_size": 300},
                                    "workers": 1, "shard_tokens": 1024})
    estimate = data_cache_bytes(spec, list_input_files(spec.sources))
    prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "cache", progress=False)
    written = sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert written <= estimate <= 4 * written + (1 << 20), (written, estimate)


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    corpus = write_corpus(root / "corpus", n_docs=24, words=(60, 120))
    return {"sources": [{"path": str(corpus / "*.txt")}], "tokenizer": {"vocab_size": 300}, "workers": 1,
            "shard_tokens": 1024, "heldout_fraction": 0.1, "cache_dir": str(root / "cache")}


def _prepared(spec):
    return prepare_data(spec.data, seed=spec.seed, report_dir=None, progress=False)


def test_a_heldout_split_shorter_than_the_context_suggests_a_fix(small_dataset):
    spec = parse_spec({"name": "t", "data": small_dataset, "model": {"context_length": 4096}})
    prepared = _prepared(spec)
    with pytest.raises(SpecError) as info:
        check_spec_against_data(spec, prepared)
    (held,) = [e for p, v, e in info.value.problems if "held-out split" in e]
    assert "context_length + 1 = 4,097" in held and "lower model.context_length to at most" in held
    assert "raise data.heldout_fraction from 0.1 to about" in held or "add documents" in held


def test_values_the_run_cannot_honour_are_warned_by_field(small_dataset, caplog):
    spec = parse_spec({"name": "t", "data": {**small_dataset, "tokenizer": {"vocab_size": 60000}},
                       "model": {"vocab_size": 70000, "context_length": 16}, "eval": {"final_batches": 10000}})
    prepared = _prepared(spec)
    with caplog.at_level(logging.WARNING, logger="runyard.plan.datacheck"):
        warnings = check_spec_against_data(spec, prepared)
    fields = {field: message for field, _value, message in warnings}
    assert prepared.vocab_size < 60000 and "asked for 60,000 tokens" in fields["data.tokenizer.vocab_size"]
    assert f"{70000 - prepared.vocab_size:,} embedding rows" in fields["model.vocab_size"]
    assert "fewer are scored" in fields["eval.final_batches"] and "eval.final_batches" in caplog.text


def test_a_heldout_document_the_fraction_did_not_give_is_warned(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=4, words=(200, 300))
    data = {"sources": [{"path": str(corpus / "*.txt")}], "tokenizer": {"vocab_size": 300}, "workers": 1,
            "shard_tokens": 1024, "heldout_fraction": 0.01, "cache_dir": str(tmp_path / "cache")}
    spec = parse_spec({"name": "t", "data": data, "model": {"context_length": 16}})
    warnings = check_spec_against_data(spec, _prepared(spec))
    (message,) = [m for f, _v, m in warnings if f == "data.heldout_fraction"]
    assert "expects 0.04 held-out documents of 4; the split holds out one" in message


def test_preflight_lists_sources_and_disk(tmp_path):
    spec = parse_spec(spec_with([{"path": "{stdlib}/json/*.py"}], train={"steps": 5}))
    pre = preflight(spec, tmp_path / "run", cache_dir=tmp_path / "cache")
    lines = "\n".join(pre.lines())
    assert "source data.sources[0] '{stdlib}/json/*.py'" in lines and "fits" in lines
    assert any(f == "schedule.warmup_steps" for f, _v, _m in pre.warnings)  # default warmup 20 > 5 steps

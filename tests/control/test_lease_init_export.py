"""A lease job that starts from an export: the agent lays the export the demand carries out in the lease's
folder (its URLs for the launcher to fetch), points every `model.init` that names a model directory at
that copy, and refuses, naming the field, a spec whose `model.init` names a directory the demand does not
carry."""

from __future__ import annotations

import pytest

from runyard.control.lease_job import LeaseFolder, LeaseJobRefused, runnable_spec, write_init_export
from runyard.market.jobs import encode_files

INIT = {"export_files": encode_files({"model.safetensors": b"w" * 10, "tokenizer/tokenizer.json": b"{}"}),
        "export_urls": {"big.bin": "https://data.example.org/big.bin"}}


def spec(**model) -> dict:
    return {"name": "again", "model": model, "data": {"sources": [{"path": "traffic/*.jsonl"}]}}


@pytest.fixture
def folder(tmp_path) -> LeaseFolder:
    folder = LeaseFolder(tmp_path / "lease-1").create()
    (folder.files / "traffic").mkdir()
    (folder.files / "traffic" / "a.jsonl").write_text('{"text": "x"}\n')
    return folder


def test_the_carried_export_is_laid_out_and_model_init_points_at_it(folder):
    fetch = write_init_export(folder, INIT)
    assert (folder.init_export / "model.safetensors").read_bytes() == b"w" * 10
    assert (folder.init_export / "tokenizer" / "tokenizer.json").read_bytes() == b"{}"
    assert fetch == {"https://data.example.org/big.bin": "init-export/big.bin"}
    raw = spec(init={"from": "export", "path": "/home/lab/runs/served/export"})
    raw["stages"] = [{"name": "main", "model": {"init": {"from": "export", "path": "/home/lab/runs/served/export"}}},
                     {"name": "sft", "model": {"init": {"from": "stage", "name": "main"}}}]
    run = runnable_spec(raw, folder, [], init_export=True)
    assert run["model"]["init"] == {"from": "export", "path": "../init-export"}
    assert run["stages"][0]["model"]["init"]["path"] == "../init-export"
    assert run["stages"][1]["model"]["init"] == {"from": "stage", "name": "main"}  # not a directory: unchanged
    assert raw["model"]["init"]["path"] == "/home/lab/runs/served/export"  # the tenant's spec is not touched
    # From the lease's work folder (the job's cwd is files/), the path reaches the copy.
    assert (folder.files / run["model"]["init"]["path"] / "model.safetensors").is_file()
    write_init_export(folder, None)  # a job without one: an earlier copy goes
    assert not folder.init_export.exists()


def test_a_model_init_the_demand_does_not_carry_is_refused_by_name(folder):
    for init in ({"from": "export", "path": "/home/lab/export"}, {"from": "hf", "path": "models/llama"}):
        with pytest.raises(LeaseJobRefused, match=r"model\.init\.path .* does not carry.*--init-export"):
            runnable_spec(spec(init=init), folder, [])
    staged = {**spec(), "stages": [{"name": "main", "model": {"init": {"from": "export", "path": "/x"}}}]}
    with pytest.raises(LeaseJobRefused, match=r"stages\[0\]\.model\.init\.path '/x'"):
        runnable_spec(staged, folder, [])
    two = {**spec(init={"from": "export", "path": "/a"}),
           "stages": [{"name": "main", "model": {"init": {"from": "export", "path": "/b"}}}]}
    with pytest.raises(LeaseJobRefused, match="names 2 model directories"):
        runnable_spec(two, folder, [], init_export=True)
    assert runnable_spec(spec(), folder, [])["model"] == {}  # no init: nothing to carry


def test_a_bad_init_export_is_refused_before_anything_is_written(folder):
    with pytest.raises(ValueError, match="relative path"):
        write_init_export(folder, {"export_files": {"../escape": "eA=="}})
    assert not folder.init_export.exists() and not (folder.root / "escape").exists()

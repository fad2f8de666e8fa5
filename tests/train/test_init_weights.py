"""`model.init`: a stage starts from an earlier stage's final weights, an export or a Hugging Face
directory, with exactly those weights; and every spec that cannot run on its weights is a spec error
naming the field, the file and the value, before any work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from runyard.data.pipeline import PreparedData
from runyard.data.shards import ShardWriter, write_index
from runyard.errors import EXIT_BAD_SPEC, SpecError
from runyard.model import hf
from runyard.model.hf.export import export_model
from runyard.model.stage_model import stage_config
from runyard.model.transformer import Transformer
from runyard.plan.weights_in import check_weights_in, weights_tokenizer_dir
from runyard.spec.job import parse_spec, resolved_stage
from runyard.train import checkpoint, parallel
from runyard.train.init_weights import InitialWeightsMismatch, load_state_checked
from runyard.train.loop import build_setup, train_stage
from runyard.train.stage_result import StageResultMissing
from tests.model.hf_models import hf_model, save_hf_model, write_tokenizer

CTX = parallel.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
VOCAB = 97


def spec_with(model: dict | None = None, stages: list | None = None, data: dict | None = None):
    return parse_spec({
        "name": "init", "seed": 3, "data": {"sources": [{"path": "unused"}], **(data or {})},
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "context_length": 16, **(model or {})},
        "optim": {"lr": 0.01}, "schedule": {"warmup_steps": 1}, "train": {"steps": 3, "batch_size": 2},
        "eval": {"interval": 3, "batches": 1}, "checkpoint": {"interval": 3},
        "stages": stages or [{"name": "main"}],
    })


@pytest.fixture()
def hf_dir(tmp_path) -> Path:
    return save_hf_model(hf_model("llama"), tmp_path / "llama")


def problems(spec) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        check_weights_in(spec)
    assert info.value.exit_code == EXIT_BAD_SPEC
    return {path: f"{value!r} {expected}" for path, value, expected in info.value.problems}


def test_a_stage_from_hf_takes_the_weights_shape_and_the_specs_training_settings(hf_dir):
    spec = spec_with({"d_model": None, "n_layers": None, "n_heads": None, "dropout": 0.1,
                      "init": {"from": "hf", "path": str(hf_dir)}})
    check_weights_in(spec)
    cfg = stage_config(spec, "main", vocab_size=5)  # the tokenizer's size matters only for random starts
    assert cfg.same_shape(hf.read_config(hf_dir)) and cfg.dropout == 0.1 and cfg.context_length == 64
    assert weights_tokenizer_dir(spec) == hf_dir


def test_a_spec_that_contradicts_its_weights_is_a_spec_error_naming_field_and_file(hf_dir):
    found = problems(spec_with({"init": {"from": "hf", "path": str(hf_dir)}, "vocab_size": 999, "d_model": 64,
                                "context_length": 128}))
    assert "999" in found["model.vocab_size"] and f"{hf_dir}/config.json: vocab_size = 320" in found["model.vocab_size"]
    assert f"{hf_dir}/config.json: hidden_size = 32" in found["model.d_model"]
    assert "at most the context" in found["model.context_length"] and "max_position_embeddings = 64" in found[
        "model.context_length"]
    assert "model.n_layers" not in found  # 2 in the spec, 2 in the weights


def edited_config(directory: Path, **changes) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return directory


def written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path.parent


def removed(path: Path) -> Path:
    path.unlink()
    return path.parent


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d.parent / "absent", "an existing model directory"),
        (lambda d: written(d / "config.json", "{"), "config.json: is not readable JSON"),
        (lambda d: edited_config(d, architectures=["GPTNeoXForCausalLM"]), "field 'architectures'"),
        (lambda d: edited_config(d, hidden_act="relu"), "field 'hidden_act': = 'relu' is not supported"),
        (lambda d: removed(d / "tokenizer_config.json"), "tokenizer_config.json is missing"),
        (lambda d: removed(d / "tokenizer.json"), "tokenizer.json is missing"),
        (lambda d: written(d / "tokenizer_config.json", '{"eos_token": "<nope>"}'), "no end-of-document token '<nope>'"),
    ],
    ids=["missing", "malformed", "architecture", "config-value", "no-tokenizer-config", "no-tokenizer", "bad-eos"],
)
def test_bad_model_directories_are_spec_errors_naming_the_file(hf_dir, damage, message):
    target = damage(hf_dir)
    found = problems(spec_with({"init": {"from": "hf", "path": str(target)}}))
    assert message in found["model.init.path"], found


def test_stages_share_one_tokenizer_and_data_tokenizer_path_may_not_contradict_it(tmp_path, hf_dir):
    other = save_hf_model(hf_model("qwen2"), tmp_path / "qwen")
    write_tokenizer(other, eos="<|endoftext|>", bos=None)
    found = problems(spec_with(stages=[{"name": "a", "model": {"init": {"from": "hf", "path": str(hf_dir)}}},
                                       {"name": "b", "model": {"init": {"from": "hf", "path": str(other)}}}]))
    assert "the same tokenizer as" in found["stages[1].model.init.path"]

    elsewhere = tmp_path / "tok"
    write_tokenizer(elsewhere, eos="<|endoftext|>", bos=None)
    found = problems(spec_with({"init": {"from": "hf", "path": str(hf_dir)}},
                               data={"tokenizer": {"path": str(elsewhere / "tokenizer.json")}}))
    assert "brings its tokenizer" in found["data.tokenizer.path"]
    check_weights_in(spec_with({"init": {"from": "hf", "path": str(hf_dir)}},
                               data={"tokenizer": {"path": str(hf_dir / "tokenizer.json")}}))  # the same one: fine
    resaved = tmp_path / "resaved" / "tokenizer.json"  # the same tokenizer, written out differently
    resaved.parent.mkdir()
    Tokenizer.from_file(str(hf_dir / "tokenizer.json")).save(str(resaved), pretty=False)
    (resaved.parent / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    assert resaved.read_bytes() != (hf_dir / "tokenizer.json").read_bytes()
    check_weights_in(spec_with({"init": {"from": "hf", "path": str(hf_dir)}}, data={"tokenizer": {"path": str(resaved)}}))


def test_an_export_is_a_starting_point_and_a_plain_hf_directory_is_not_an_export(tmp_path, hf_dir):
    model = hf.load_model(hf_dir)
    out = export_model(model, model.cfg, hf_dir / "tokenizer.json", tmp_path / "export",
                       tokenizer_config=json.loads((hf_dir / "tokenizer_config.json").read_text()))
    spec = spec_with({"init": {"from": "export", "path": str(out)}, "d_model": None, "n_heads": None})
    check_weights_in(spec)
    assert stage_config(spec, "main", 5).same_shape(model.cfg)
    found = problems(spec_with({"init": {"from": "export", "path": str(hf_dir)}}))
    assert "runyard.json is missing" in found["model.init.path"]


def test_a_stage_from_a_stage_must_keep_its_shape(hf_dir):
    spec = spec_with(stages=[{"name": "a"}, {"name": "b", "model": {"init": {"from": "stage", "name": "a"},
                                                                     "n_layers": 3}}])
    with pytest.raises(SpecError) as info:
        stage_config(spec, "b", VOCAB)
    (path, value, expected), = info.value.problems
    assert path == "stages[1].model.n_layers" and value == 3 and "stage 'a''s model: num_hidden_layers = 2" in expected
    # A chain reaches the weights at its root: b continues a, which starts from the HF model.
    chain = spec_with({"d_model": None, "n_heads": None},
                      stages=[{"name": "a", "model": {"init": {"from": "hf", "path": str(hf_dir)}}},
                              {"name": "b", "model": {"init": {"from": "stage", "name": "a"}, "context_length": 32}}])
    check_weights_in(chain)
    assert stage_config(chain, "b", VOCAB).same_shape(hf.read_config(hf_dir))


# --- the weights a stage starts with ------------------------------------------------------------------------


def write_split(root: Path, name: str, docs: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(30, 120, size=docs)
    writer = ShardWriter(root, name, 1024, np.dtype(np.uint16))
    writer.add_tokens(rng.integers(1, VOCAB, size=int(lengths.sum())).astype(np.uint16), lengths)
    write_index(root / f"{name}.json", writer.finish(), dtype=np.dtype(np.uint16), vocab_size=VOCAB, eos_id=0,
                shard_tokens=1024, num_documents=docs)
    return root / f"{name}.json"


@pytest.fixture()
def prepared(tmp_path) -> PreparedData:
    root = tmp_path / "data"
    root.mkdir()
    return PreparedData(tokenizer_path=root / "unused.json", vocab_size=VOCAB, eos_id=0,
                        train_index=write_split(root, "train", 40, 0), heldout_index=write_split(root, "heldout", 10, 1),
                        fingerprint="test", stats={}, input_fingerprints={})


def test_continuing_a_stage_starts_from_its_final_weights_exactly(tmp_path, prepared):
    spec = spec_with(stages=[{"name": "a", "gates": {"min_loss_drop": None}},
                             {"name": "b", "model": {"init": {"from": "stage", "name": "a"}}}])
    run_dir = tmp_path / "run"
    with pytest.raises(StageResultMissing, match="stage a: its final checkpoint"):
        build_setup(spec, resolved_stage(spec, "b"), prepared, CTX, run_dir=run_dir)
    train_stage(spec, resolved_stage(spec, "a"), prepared, run_dir / "stages" / "a", CTX, show_progress=False)
    final = checkpoint.read_model_weights(checkpoint.latest_good(run_dir / "stages" / "a" / "checkpoints").path)

    start = build_setup(spec, resolved_stage(spec, "b"), prepared, CTX, run_dir=run_dir).model.state_dict()
    assert sorted(start) == sorted(final) and all(torch.equal(start[k], final[k]) for k in final)
    random = build_setup(spec, resolved_stage(spec, "b"), prepared, CTX).model.state_dict()  # what b would be alone
    assert not torch.equal(random["tok_emb.weight"], final["tok_emb.weight"])


def test_a_lora_stage_trains_on_its_init_weights_and_hands_on_its_merged_result(tmp_path, prepared):
    """b trains LoRA adapters over a's final weights (its checkpoint holds adapters only); c continues b
    and starts from b's base with the adapters merged in, exactly the model b's training ended with."""
    off = {"min_loss_drop": None}
    spec = spec_with(stages=[
        {"name": "a", "gates": off},
        {"name": "b", "model": {"init": {"from": "stage", "name": "a"}}, "gates": off,
         "lora": {"rank": 2, "alpha": 4, "targets": ["q_proj", "down_proj"]}},
        {"name": "c", "model": {"init": {"from": "stage", "name": "b"}}, "gates": off},
    ])
    run_dir = tmp_path / "run"
    train_stage(spec, resolved_stage(spec, "a"), prepared, run_dir / "stages" / "a", CTX, show_progress=False)
    a = checkpoint.read_model_weights(checkpoint.latest_good(run_dir / "stages" / "a" / "checkpoints").path)
    b = train_stage(spec, resolved_stage(spec, "b"), prepared, run_dir / "stages" / "b", CTX, show_progress=False)
    saved = checkpoint.read_model_weights(b.checkpoint)
    assert saved and all(k.startswith("adapters.") for k in saved), "b's checkpoint holds its adapters only"
    merged = b.model.state_dict()
    assert torch.equal(merged["blocks.0.ffn.w_gate_up.weight"], a["blocks.0.ffn.w_gate_up.weight"]), "not a target"
    assert not torch.equal(merged["blocks.0.ffn.w_down.weight"], a["blocks.0.ffn.w_down.weight"]), "a target"

    start = build_setup(spec, resolved_stage(spec, "c"), prepared, CTX, run_dir=run_dir).model.state_dict()
    assert sorted(start) == sorted(merged) and all(torch.equal(start[k], merged[k]) for k in merged)


def test_a_stage_from_hf_starts_from_exactly_its_weights(hf_dir, prepared, tmp_path):
    spec = spec_with({"d_model": None, "n_heads": None, "init": {"from": "hf", "path": str(hf_dir)}})
    model = build_setup(spec, resolved_stage(spec, "main"), prepared, CTX, run_dir=tmp_path).model
    theirs = hf.load_model(hf_dir)
    assert all(torch.equal(v, theirs.state_dict()[k]) for k, v in model.state_dict().items())


def test_weights_that_do_not_fit_are_named_tensor_by_tensor():
    model = Transformer(stage_config(spec_with(), "main", VOCAB))
    weights = dict(model.state_dict())
    weights["norm.weight"] = torch.ones(7)
    del weights["blocks.0.attn.wo.weight"]
    weights["extra.bias"] = torch.zeros(1)
    with pytest.raises(InitialWeightsMismatch, match=r"missing \['blocks\.0\.attn\.wo\.weight'\]; unexpected "
                                                     r"\['extra\.bias'\]; norm\.weight \(7,\) there, \(32,\) here"):
        load_state_checked(model, weights, "the test's weights")


"""`runyard serve` on the command line: help, option checks before any loading, a real server
process answering the OpenAI client, and vLLM where it can run."""

from __future__ import annotations

import importlib.util
import os
import signal

import numpy as np
import openai
import pytest
import torch

from runyard.cli import main
from runyard.model import get_family
from runyard.model.hf.export import export_model
from runyard.serve.batch_engine import BatchEngine
from runyard.serve.drift import DriftReference
from runyard.serve.feature_drift import FeatureReference
from runyard.serve.predict_export import KIND_IMAGE, export_predictor, image_drift_features
from runyard.serve.sampling import SamplingParams
from runyard.spec.job import parse_spec
from tests.serve.served import start_served


def runyard(capsys, *args: str) -> tuple[int, str, str]:
    """The command line, in this process: (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's --help and usage errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture()
def export(tmp_path, tokenizer, tokenizer_path, make_model):
    model = make_model(tokenizer)
    out = export_model(model, model.cfg, tokenizer_path, tmp_path / "run" / "export", extra_config={"run_name": "tiny"})
    return out


def test_help_names_the_options(capsys):
    code, out, _ = runyard(capsys, "serve", "--help")
    assert code == 0
    for option in ("--kv-cache-mb", "--max-queue", "--engine", "--log-requests", "--retrain-spec", "--control"):
        assert option in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--retrain-spec", "spec.yaml"], "--retrain-spec and --control go together"),
        (["--retrain-spec", "spec.yaml", "--control", "http://127.0.0.1:9"], "needs --log-requests"),
        (["--drift-sustain", "-1"], "--drift-sustain must be >= 0"),
    ],
)
def test_contradictory_options_exit_2_before_loading(capsys, export, extra, message):
    code, _, err = runyard(capsys, "serve", str(export.parent), *extra)
    assert code == 2, err
    assert message in err


def test_retraining_needs_a_drift_reference(capsys, export, tmp_path):
    code, _, err = runyard(capsys, "serve", str(export), "--retrain-spec", "s.yaml", "--control", "http://127.0.0.1:9",
                           "--log-requests", str(tmp_path / "t"))
    assert code == 2 and "no drift reference" in err


def test_a_bad_retrain_spec_is_refused_at_startup(capsys, export, tmp_path, tokenizer):
    DriftReference(torch.ones(tokenizer.get_vocab_size(), dtype=torch.int64).numpy()).save(export)
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: x\nmodel: {d_model: -4}\n")
    code, _, err = runyard(capsys, "serve", str(export), "--retrain-spec", str(spec), "--control", "http://127.0.0.1:9",
                           "--log-requests", str(tmp_path / "t"))
    assert code == 2 and "model.d_model" in err


@pytest.fixture()
def image_export(tmp_path):
    """A tiny CNN's export: a model `runyard serve` answers at POST /v1/predict."""
    family = get_family("cnn")
    spec = parse_spec({"task": "image_classification", "name": "img", "data": {"sources": [{"path": "digits", "format": "sklearn"}]},
                       "model": {"family": "cnn", "cnn": {"channels": [4], "hidden": 8}}})
    config = family.config_from_spec(spec.model, shape=(1, 6, 6), n_classes=3, mean=[0.5], std=[0.25])
    torch.manual_seed(0)
    model = family.build(config).eval()
    pixels = np.random.default_rng(0).random((20, 1, 6, 6)).astype(np.float32)
    features, names = image_drift_features(pixels)
    reference = FeatureReference.build(features, names, ["numeric"] * len(names), [0] * len(names), seed=1)
    with torch.no_grad():
        expected = torch.softmax(model(torch.from_numpy(pixels)).double(), -1).numpy()
    out = tmp_path / "run" / "export"
    export_predictor(model, config, "cnn", out, kind=KIND_IMAGE, task=spec.task,
                     schema={"kind": "image", "shape": [1, 6, 6], "classes": ["a", "b", "c"], "resize": None},
                     reference=reference, check_x=pixels, expected=expected)
    return out


@pytest.mark.parametrize(
    ("extra", "flags"),
    [
        (["--retrain-spec", "spec.yaml", "--control", "http://127.0.0.1:9"], "--retrain-spec, --control"),
        (["--retrain-min-logged", "5"], "--retrain-min-logged"),
        (["--drift-sustain", "5", "--max-batch", "8"], "--drift-sustain, --max-batch"),
    ],
)
def test_language_model_options_on_an_image_server_exit_2_naming_them(capsys, image_export, extra, flags):
    code, _, err = runyard(capsys, "serve", str(image_export), *extra)
    assert code == 2, err
    assert f"cannot act on {flags} " in err and str(image_export) in err


def test_retraining_a_table_or_image_server_is_refused_because_its_inputs_have_no_labels(capsys, image_export):
    code, _, err = runyard(capsys, "serve", str(image_export), "--retrain-spec", "spec.yaml", "--control",
                           "http://127.0.0.1:9", "--log-requests", "traffic")
    assert code == 2 and "--log-requests" not in err.split("(")[0]  # logging is accepted, retraining is not
    assert "logged rows and images carry no labels" in err


def test_a_bad_false_alarm_rate_is_a_usage_error(capsys, export):
    code, _, err = runyard(capsys, "serve", str(export), "--drift-false-alarm-rate", "1.5")
    assert code == 2 and "--drift-false-alarm-rate" in err and "must be a rate in (0, 0.5)" in err


def test_missing_export_is_a_clear_error(capsys, tmp_path):
    code, _, err = runyard(capsys, "serve", str(tmp_path / "nothing"))
    assert code == 1 and "does not exist" in err


@pytest.mark.slow
def test_served_process_answers_the_openai_client_and_stops_on_sigterm(export):
    proc, url = start_served(export.parent)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]  # the run's name
        r = client.completions.create(model="tiny", prompt="def ", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode is not None


needs_vllm = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None, reason="needs a CUDA GPU and vllm"
)


@needs_vllm
def test_vllm_engine_serves_a_hugging_face_directory(tmp_path, tokenizer, tokenizer_path):
    from transformers import LlamaConfig, LlamaForCausalLM  # optional extra: only where vLLM runs

    config = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)
    hf_dir = tmp_path / "hf"
    LlamaForCausalLM(config).save_pretrained(hf_dir)
    (hf_dir / "tokenizer.json").write_bytes(tokenizer_path.read_bytes())
    proc, url = start_served(hf_dir, "--engine", "vllm", timeout_s=600, poll_s=1, env=dict(os.environ))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        r = client.completions.create(model=client.models.list().data[0].id, prompt="def ", max_tokens=8,
                                      temperature=0.7, seed=3)
        again = client.completions.create(model=r.model, prompt="def ", max_tokens=8, temperature=0.7, seed=3)
        assert r.choices[0].text == again.choices[0].text and r.usage.completion_tokens == 8
        chunks = list(client.completions.create(model=r.model, prompt="def ", max_tokens=8, temperature=0, stream=True))
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_cuda_matches_cpu_greedy_prefix(tokenizer, make_model):
    model = make_model(tokenizer)
    prompt = tokenizer.encode("def add(a, b):").ids
    cpu = BatchEngine(model, tokenizer).generate([prompt], [SamplingParams(max_tokens=4, temperature=0)])[0]
    gpu_engine = BatchEngine(make_model(tokenizer), tokenizer, device="cuda")
    assert gpu_engine.dtype == torch.bfloat16 and gpu_engine.pool.dtype == torch.bfloat16
    gpu = gpu_engine.generate([prompt], [SamplingParams(max_tokens=4, temperature=0)])[0]
    assert gpu.token_ids[:1] == cpu.token_ids[:1]

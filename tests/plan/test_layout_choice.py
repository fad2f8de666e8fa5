"""The plan picks the parallel layout (plan/layout_choice.py) for a table of model sizes and hardware, with its
reasons; the memory it chooses by is checked against arithmetic written out here (Llama shapes, 16 bytes a
trained parameter, Korthikanti et al.'s ~34 values a token and channel kept per block); a layout the spec names
that the hardware cannot hold is a spec error naming both figures, from the API, from `runyard plan`, and from
`runyard run` and `runyard train` before any work."""

import json

import pytest
import yaml

from runyard import cli
from runyard.errors import EXIT_BAD_SPEC, SpecError
from runyard.model.config import ModelConfig
from runyard.model.decoder import DecoderFamily
from runyard.plan.devices import GIB, Cluster, device, usable_memory
from runyard.plan.layout_choice import Layout, check_named_layout, choose_layout, stage_facts, stage_layout
from runyard.plan.planner import layout_warnings
from runyard.plan.recommend import Hardware
from runyard.plan.sizing import count_parameters, lora_parameters, replica_memory
from runyard.spec.finetune import LoRASpec
from runyard.spec.job import parse_spec
from runyard.train.lora import apply_lora

VOCAB = 128256
SHAPES = {  # Llama 3.2 1B, Llama 3 8B and 70B, and a wide shallow model at a long context
    "1b": dict(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192, tie_embeddings=True),
    "8b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, tie_embeddings=False),
    "70b": dict(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672, tie_embeddings=False),
    "wide": dict(d_model=8192, n_layers=4, n_heads=64, n_kv_heads=8, ffn_hidden=8192, tie_embeddings=True),
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, tie_embeddings=True),
}
VOCABS = {"wide": 1024, "tiny": 300}


def spec_dict(shape: str, context: int, micro_batch: int, **more) -> dict:
    vocab = VOCABS.get(shape, VOCAB)
    out = {"name": "layout", "data": {"sources": [{"path": "x"}], "tokenizer": {"vocab_size": vocab}},
           "model": {**SHAPES[shape], "context_length": context, "vocab_size": vocab},
           "train": {"steps": 10, "batch_size": micro_batch}}
    out.update(more)
    return out


def choice(shape, context, micro_batch, kind, devices, **more):
    spec = parse_spec(spec_dict(shape, context, micro_batch, **more))
    return stage_layout(spec, "main", Hardware(kind, devices, "test"), {"vocab_size": VOCABS.get(shape, VOCAB)})


def by_hand(shape: str, context: int, micro_batch: int, recompute_all: bool) -> int:
    """Bytes one unsharded replica holds training: 16 a parameter, and per block 34 x d x tokens values (2 bytes
    each in the paper's count, 4 in fp32) or, recomputed, its fp32 input plus one block live again; the logits
    and their softmax in fp32."""
    s = SHAPES[shape]
    cfg = ModelConfig(vocab_size=VOCABS.get(shape, VOCAB), context_length=context, **s)
    params, _ = count_parameters(cfg)
    tokens, d = micro_batch * context, s["d_model"]
    block = 34 * d * tokens * 4 // 2
    logits = tokens * cfg.vocab_size * 4 * 2
    blocks = s["n_layers"] * tokens * d * 4 + block if recompute_all else s["n_layers"] * block
    return 16 * params + blocks + logits


def test_1b_full_training_on_one_24gb_device_needs_full_activation_checkpointing():
    c = choice("1b", 2048, 1, "l4", 1)
    assert c.chosen == Layout(activation_checkpointing="full")
    assert [s.layout.activation_checkpointing for s in c.steps] == ["none", "selective", "full"]
    assert [s.fits for s in c.steps] == [False, False, True]
    available = usable_memory(device("l4"))
    assert available == int(24 * GIB * 0.9) - GIB // 2
    # The chooser's figures are the hand count's, and they fall either side of the device's memory.
    assert c.steps[0].memory.total == pytest.approx(by_hand("1b", 2048, 1, recompute_all=False), rel=1e-6)
    assert c.steps[2].memory.total == pytest.approx(by_hand("1b", 2048, 1, recompute_all=True), rel=1e-6)
    assert c.steps[0].memory.total > available >= c.steps[2].memory.total
    reasons = c.reasons()
    assert reasons[0].startswith("one process (no data parallelism), activation checkpointing none: 24.6 GiB per "
                                 "device of 21.1 GiB usable (too big")
    assert "activation checkpointing full: 20.9 GiB per device of 21.1 GiB usable (fits" in reasons[2]
    assert c.interconnect is None


def test_8b_on_8_h100s_is_fsdp_and_adds_activation_checkpointing_at_a_longer_context():
    c = choice("8b", 4096, 1, "h100-80gb", 8)
    assert c.chosen == Layout(dp_shard=8)
    assert [s.layout.parallel for s in c.steps] == ["ddp", "fsdp"]
    ddp, fsdp = c.steps
    params, _ = count_parameters(ModelConfig(vocab_size=VOCAB, context_length=4096, **SHAPES["8b"]))
    assert ddp.memory.weights == 4 * params and fsdp.memory.weights == 4 * params // 8
    assert fsdp.memory.optimizer == 8 * params // 8 and fsdp.memory.activations == ddp.memory.activations
    assert ddp.memory.total == pytest.approx(by_hand("8b", 4096, 1, recompute_all=False), rel=1e-6)
    assert "DDP over 8, activation checkpointing none: 157.6 GiB per device of 71.5 GiB usable (too big" in c.reasons()[0]
    assert "FSDP over 8, activation checkpointing none: 52.9 GiB per device of 71.5 GiB usable (fits" in c.reasons()[1]

    longer = choice("8b", 8192, 2, "h100-80gb", 8)
    assert longer.chosen == Layout(dp_shard=8, activation_checkpointing="full")
    assert [(s.layout.parallel, s.layout.activation_checkpointing, s.fits) for s in longer.steps] == [
        ("ddp", "none", False), ("fsdp", "none", False), ("fsdp", "selective", False), ("fsdp", "full", True)]


def test_70b_on_two_nodes_of_8_h100s_fits_no_layout_runyard_trains_and_names_pipeline_parallel():
    c = choice("70b", 4096, 1, "h100-80gb", 16)
    assert c.cluster == Cluster("h100-80gb", 8, 2)
    assert c.chosen is None and c.interconnect is None
    by_layout = {s.layout.describe(): s for s in c.steps}
    fsdp_full = by_layout["FSDP over 16, activation checkpointing full"]
    assert not fsdp_full.fits and fsdp_full.memory.total > fsdp_full.available
    tp = by_layout["tp 16, activation checkpointing full"]
    assert "span 2 nodes" in tp.refused
    pp = by_layout["pp 2 x tp 8, activation checkpointing full"]
    assert pp.refused == "runyard does not train pipeline parallel yet"
    last = c.reasons()[-1]
    assert last.startswith("no layout runyard trains holds stage main on 2 nodes x 8 x h100-80gb (nvlink within a "
                           "node, infiniband across nodes); the smallest runyard trains, FSDP over 16, activation "
                           "checkpointing full, needs 81.7 GiB per device of 71.5 GiB")
    assert c.fsdp_devices is not None and c.fsdp_devices > 16
    assert f"would fit on {c.fsdp_devices} devices" in last
    # ... and that many devices do hold it, one fewer does not.
    memory = replica_memory(parse_spec(spec_dict("70b", 4096, 1)), "main", {"vocab_size": VOCAB})
    assert memory.per_device(c.fsdp_devices, 1, "full").total <= fsdp_full.available
    assert memory.per_device(c.fsdp_devices - 1, 1, "full").total > fsdp_full.available


def test_a_wide_model_at_a_long_context_takes_tensor_parallel_on_nvlink_and_is_refused_it_on_pcie():
    c = choice("wide", 8192, 16, "h100-80gb", 8)
    assert c.chosen == Layout(tp=8, activation_checkpointing="full")
    # Data parallel, FSDP and FSDP with recomputation came first; then tp with the stage's own setting.
    assert [(s.layout.parallel, s.layout.activation_checkpointing, s.fits) for s in c.steps] == [
        ("ddp", "none", False), ("fsdp", "none", False), ("fsdp", "selective", False), ("fsdp", "full", False),
        ({"tp": 8}, "none", False), ({"tp": 8}, "selective", False), ({"tp": 8}, "full", True)]
    fsdp_full, tp_full = c.steps[3].memory, c.steps[6].memory
    assert tp_full.activations < fsdp_full.activations and tp_full.weights > fsdp_full.weights
    assert c.interconnect == "nvlink"
    assert c.reasons()[-1] == "tensor parallel needs nvlink within the node: written into the requirement"

    pcie = choice("wide", 8192, 16, "l40s", 8)
    assert pcie.chosen is None
    assert all("NVLink-class" in s.refused for s in pcie.steps if s.layout.tp > 1)


def test_a_small_model_on_cpu_processes_stays_data_parallel():
    spec = parse_spec(spec_dict("tiny", 32, 4, resources={"device": "cpu", "nproc": 2}))
    memory = replica_memory(spec, "main", {"vocab_size": 300})
    one = choose_layout(memory, Cluster("cpu", 1), stage_facts(spec, "main", {"vocab_size": 300}))
    two = choose_layout(memory, Cluster("cpu", 2), stage_facts(spec, "main", {"vocab_size": 300}))
    assert one.chosen == Layout() and one.chosen.describe().startswith("one process")
    assert two.chosen == Layout(dp_replicate=2) and two.chosen.parallel == "ddp"
    assert len(two.steps) == 1 and two.interconnect is None


def test_lora_trains_only_adapters_so_an_8b_base_stays_data_parallel():
    stage = {"name": "main", "lora": {"rank": 16, "targets": ["q_proj", "v_proj", "gate_proj", "down_proj"]}}
    full = choice("8b", 4096, 1, "h100-80gb", 8)
    lora = choice("8b", 4096, 1, "h100-80gb", 8, stages=[stage])
    assert lora.chosen == Layout(dp_replicate=8)
    step = lora.steps[0]
    assert step.memory.gradients * 2 == step.memory.optimizer < 1 * GIB  # adapters only
    assert step.memory.weights > full.steps[0].memory.weights  # the whole fp32 base, plus the adapters


def test_lora_parameters_are_those_apply_lora_adds():
    cfg = ModelConfig(vocab_size=300, context_length=32, **SHAPES["tiny"])
    spec = LoRASpec(rank=4, targets=["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"])
    adapters = apply_lora(DecoderFamily().build(cfg), spec, seed=0)
    assert lora_parameters(cfg, spec.rank, spec.targets) == sum(p.numel() for p in adapters.parameters())


def test_a_layout_the_spec_names_that_the_hardware_cannot_hold_is_a_spec_error_naming_the_figures():
    requirement = {"accelerator_kinds": ["h100-80gb"], "device_count": 8}
    spec = parse_spec(spec_dict("8b", 4096, 1, resources={"parallel": "ddp", "requirement": requirement}))
    with pytest.raises(SpecError) as err:
        stage_layout(spec, "main", Hardware("h100-80gb", 8, "test"), {"vocab_size": VOCAB})
    text = str(err.value)
    assert "resources.parallel" in text and "stage main needs 157.6 GiB per device" in text
    assert f"a h100-80gb has 71.5 GiB usable ({usable_memory(device('h100-80gb')):,} bytes)" in text
    # The same layout named with FSDP fits, and is reported as the spec's, not chosen.
    fsdp = parse_spec(spec_dict("8b", 4096, 1, resources={"parallel": "fsdp", "requirement": requirement}))
    c = stage_layout(fsdp, "main", Hardware("h100-80gb", 8, "test"), {"vocab_size": VOCAB})
    assert c.explicit and c.chosen == Layout(dp_shard=8) and "as resources.parallel names it" in c.describe()


@pytest.fixture
def plan_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RUNYARD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def _spec_file(path, spec: dict):
    spec = {**spec, "data": {"sources": [{"path": "{stdlib}/json/*.py"}], "tokenizer": spec["data"]["tokenizer"],
                             "workers": 1}}
    path.write_text(yaml.safe_dump(spec))
    return path


def test_runyard_plan_prints_the_layout_and_writes_nvlink_into_the_requirement(plan_dir, capsys):
    requirement = {"accelerator_kinds": ["h100-80gb"], "device_count": 8}
    path = _spec_file(plan_dir / "wide.yaml", spec_dict("wide", 8192, 16, resources={"requirement": requirement}))
    assert cli.main(["plan", str(path), "--no-calibrate", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["requirement"]["min_interconnect"] == "nvlink"
    (layout,) = plan["layouts"]
    assert layout["chosen"]["parallel"] == {"tp": 8} and layout["interconnect"] == "nvlink"
    assert [s["fits"] for s in layout["steps"]][-1] is True
    assert cli.main(["plan", str(path), "--no-calibrate"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "layout: stage main: tp 8, activation checkpointing full on 8 x h100-80gb (nvlink within a node) (chosen)" \
        in lines


def test_runyard_plan_refuses_a_named_layout_that_cannot_fit(plan_dir, capsys):
    requirement = {"accelerator_kinds": ["h100-80gb"], "device_count": 8}
    path = _spec_file(plan_dir / "8b.yaml", spec_dict("8b", 4096, 1, resources={"parallel": "ddp",
                                                                                "requirement": requirement}))
    assert cli.main(["plan", str(path), "--no-calibrate"]) == EXIT_BAD_SPEC
    err = capsys.readouterr().err
    assert "stage main needs 157.6 GiB per device" in err and "71.5 GiB usable" in err


@pytest.mark.parametrize("verb", ["run", "train"])
def test_runyard_run_refuses_a_named_layout_that_cannot_fit_before_any_work(plan_dir, capsys, verb):
    """The same spec error as `runyard plan`, before a run directory, a data stage or a worker exists."""
    requirement = {"accelerator_kinds": ["h100-80gb"], "device_count": 8}
    path = _spec_file(plan_dir / "8b.yaml", spec_dict("8b", 4096, 1, resources={"parallel": "ddp",
                                                                                "requirement": requirement}))
    assert cli.main(["plan", str(path), "--no-calibrate"]) == EXIT_BAD_SPEC
    planned = capsys.readouterr().err
    run_dir = plan_dir / "run"
    assert cli.main([verb, str(path), "--run-dir", str(run_dir), "--no-progress"]) == EXIT_BAD_SPEC
    err = capsys.readouterr().err
    assert "stage main needs 157.6 GiB per device" in err and "71.5 GiB usable" in err
    assert f"({usable_memory(device('h100-80gb')):,} bytes)" in err
    assert err == planned
    assert not run_dir.exists() and not (plan_dir / "cache").exists()


def test_a_named_layout_that_fits_or_no_named_layout_passes_the_runs_check():
    requirement = {"accelerator_kinds": ["h100-80gb"], "device_count": 8}
    check_named_layout(parse_spec(spec_dict("8b", 4096, 1, resources={"parallel": "fsdp", "requirement": requirement})))
    check_named_layout(parse_spec(spec_dict("8b", 4096, 1, resources={"requirement": requirement})))  # the plan chooses


def test_tensor_parallel_splits_the_blocks_parameters_and_keeps_the_rest_whole():
    cfg = ModelConfig(vocab_size=VOCAB, context_length=4096, **SHAPES["70b"])
    memory = replica_memory(parse_spec(spec_dict("70b", 4096, 1)), "main", {"vocab_size": VOCAB})
    d, kv, layers = cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg.n_layers
    per_block = d * (d + 2 * kv) + d * d + 3 * d * cfg.ffn_hidden + 2 * d  # q, k, v, o; gate, up, down; norms
    assert memory.block_parameters == layers * per_block
    whole = memory.parameters - memory.block_parameters  # embedding, head, final norm
    assert whole == 2 * VOCAB * d + d
    assert memory.per_device(tp=8).weights == 4 * (whole + memory.block_parameters // 8)


def test_the_plan_warns_when_stages_want_different_layouts_or_the_requirement_refuses_nvlink(plan_dir, capsys):
    stages = [{"name": "main"}, {"name": "tune", "lora": {"rank": 8}}]
    spec = parse_spec(spec_dict("8b", 4096, 1, stages=stages))
    layouts = [stage_layout(spec, s, Hardware("h100-80gb", 8, "test"), {"vocab_size": VOCAB}) for s in ("main", "tune")]
    assert [c.chosen.parallel for c in layouts] == ["fsdp", "ddp"]
    (warning,) = layout_warnings(spec, layouts)
    assert warning.startswith("the stages' layouts differ (stage main: FSDP over 8") and "stage tune: DDP over 8" in warning

    requirement = {"accelerator_kinds": ["h100-80gb"], "device_count": 8, "min_interconnect": "ethernet"}
    path = _spec_file(plan_dir / "wide.yaml", spec_dict("wide", 8192, 16, resources={"requirement": requirement}))
    assert cli.main(["plan", str(path), "--no-calibrate", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["requirement"]["min_interconnect"] == "ethernet"  # the spec's own field is kept, and flagged
    assert ("tensor parallel needs nvlink within a node, and resources.requirement.min_interconnect accepts ethernet"
            in plan["warnings"])

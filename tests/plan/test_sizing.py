import pytest

from runyard.model.config import ModelConfig
from runyard.model.transformer import Transformer
from runyard.plan.sizing import count_parameters, flops_per_token, plan_run
from runyard.spec import parse_spec


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("kv", [1, 2, 4])
def test_parameter_count_from_shape_matches_the_built_model(tie, kv):
    cfg = ModelConfig(vocab_size=300, d_model=64, n_layers=3, n_heads=4, n_kv_heads=kv, ffn_hidden=96,
                      context_length=32, tie_embeddings=tie)
    total, non_embedding = count_parameters(cfg)
    model = Transformer(cfg)
    assert total == model.num_parameters()
    assert non_embedding == model.num_parameters(non_embedding=True)
    assert flops_per_token(cfg) == pytest.approx(model.flops_per_token())


def test_plan_raises_requirement_duration_to_the_estimate():
    spec = parse_spec({
        "name": "p", "data": {"sources": [{"path": "x"}]},
        "train": {"steps": 1000, "batch_size": 8},
        "resources": {"requirement": {"duration_s": 60}},
    })
    plan = plan_run(spec, vocab_size=4096, tokens_per_s=100.0)
    tokens = plan["stages"][0]["tokens"]
    assert tokens == 1000 * 8 * 256
    assert plan["requirement"]["duration_s"] > tokens / 100.0
    assert plan["training_flops"] == pytest.approx(plan["stages"][0]["flops_per_token"] * tokens)

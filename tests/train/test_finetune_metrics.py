"""Fine-tuning metrics and gates: the task checkers, the reward gates, the before/after section."""

from __future__ import annotations

import torch

from runyard.spec.job import GateSpec
from runyard.train.finetune_metrics import finetune_markdown, python_syntax, task_metric
from runyard.train.gates import evaluate_recorded_gates


def test_checkers():
    prompt = 'def add(a, b):\n    """Sum."""'
    assert python_syntax(prompt, "    return a + b\n", "")
    assert not python_syntax(prompt, "    return a +\n", "")
    assert not python_syntax(prompt, "\n       \n    # nothing\n", ""), "the docstring alone is no answer"
    assert python_syntax("def f():", "    pass\n", "") and not python_syntax("def f():", "\n", "")
    result = task_metric("exact_match", [{"prompt": "p", "response": " x\n"}, {"prompt": "p", "response": "y"}], ["x", "z"])
    assert result == {"name": "exact_match", "score": 0.5, "prompts": 2}


def test_reward_gates_read_the_last_heldout_figures():
    rows = [{"step": 1, "loss": 0.7, "tokens_per_s": 1.0, "heldout_loss": 0.69, "heldout_reward_accuracy": 0.9,
             "heldout_reward_margin": 0.5},
            {"step": 2, "loss": 0.6, "tokens_per_s": 1.0, "heldout_loss": 0.6, "heldout_reward_accuracy": 0.55,
             "heldout_reward_margin": 0.2}]
    gates = GateSpec(min_loss_drop=None, checkpoint_roundtrip=False, min_reward_accuracy=0.6, min_reward_margin=0.1)
    results = {g.name: g for g in evaluate_recorded_gates(gates, rows, None, torch.nn.Linear(1, 1))}
    assert not results["reward_accuracy"].passed and results["reward_accuracy"].value == 0.55
    assert results["reward_margin"].passed and results["reward_margin"].value == 0.2


def test_before_and_after_side_by_side():
    record = {"kind": "sft", "parameters": {"trainable": 10, "total": 100, "train_state_bytes": 120,
                                            "full_train_state_bytes": 1200},
              "before": {"metrics": {"heldout_loss": 3.5}, "samples": [{"prompt": "def f():", "reference": "  pass",
                                                                         "answer": "zzz"}]},
              "after": {"metrics": {"heldout_loss": 1.25}, "samples": [{"prompt": "def f():", "reference": "  pass",
                                                                        "answer": "  pass"}]}}
    text = "\n".join(finetune_markdown({"tune": record}))
    assert "| heldout_loss | 3.5000 | 1.2500 |" in text
    assert "Trainable parameters: 10 of 100 (10.00%)" in text
    assert text.index("Base model:") < text.index("zzz") < text.index("Fine-tuned:") < text.rindex("  pass")

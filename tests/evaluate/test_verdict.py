"""The fit-to-ship verdict without bounds in the spec: beating the unigram baseline by a stated margin,
and a flag for a held-out loss that stopped improving well before the end of a stage."""

from __future__ import annotations

import json
import math

from runyard.evaluate.heldout import summarise
from runyard.evaluate.report import stalled_heldout, verdict, write_report
from runyard.spec.job import EvalSpec


def ppl_metrics(heldout_ppl: float, unigram_ppl: float):
    return summarise(math.log(heldout_ppl), math.log(heldout_ppl) - 0.05, math.log(unigram_ppl), 1000)


def test_barely_beating_the_unigram_baseline_is_not_fit_to_ship_by_default():
    # The 60-step run: perplexity 735 against the baseline's 760.
    v = verdict(ppl_metrics(735, 760), EvalSpec())
    assert not v.fit_to_ship
    (reason,) = v.reasons
    assert "0.5% below the unigram baseline" in reason and "at least 10% (eval.unigram_margin)" in reason


def test_a_real_gain_over_the_baseline_is_fit_to_ship_and_says_why():
    # The stdlib demo: perplexity ~55 against ~725.
    v = verdict(ppl_metrics(55, 725), EvalSpec())
    assert v.fit_to_ship and v.reasons == []
    assert any("39.2% below the unigram baseline" in p for p in v.passed)


def test_a_loss_above_the_baseline_is_said_to_be_above_it():
    # The sft-only run: a held-out loss 13.1% above the unigram baseline was printed "-13.1% below".
    v = verdict(summarise(5.09, 5.0, 4.5, 1000), EvalSpec())
    (reason,) = v.reasons
    assert "13.1% above the unigram baseline" in reason and "is -" not in reason
    assert "below the unigram" not in reason


def test_comparison_words_say_which_way():
    from runyard.train.gates import compared, fell_or_rose

    assert compared(5.09, 4.5) == "13.1% above"
    assert compared(4.5, 5.0) == "10.0% below"
    assert compared(3.0, 3.0) == "equal to"
    assert fell_or_rose(7.64, 5.09) == "fell 33.4%"
    assert fell_or_rose(5.0, 5.5) == "rose 10.0%"


def test_the_margin_is_a_spec_field():
    assert verdict(ppl_metrics(735, 760), EvalSpec(unigram_margin=0)).fit_to_ship
    assert not verdict(ppl_metrics(760, 760), EvalSpec(unigram_margin=0)).fit_to_ship  # equal is not beating
    assert verdict(ppl_metrics(735, 760), EvalSpec(must_beat_unigram=False)).fit_to_ship
    assert not verdict(ppl_metrics(55, 725), EvalSpec(unigram_margin=0.5)).fit_to_ship


def rows(heldout: list[tuple[int, float]], steps: int) -> list[dict]:
    evals = dict(heldout)
    return [{"step": s, "loss": 3.0, **({"heldout_loss": evals[s]} if s in evals else {})} for s in range(1, steps + 1)]


def test_a_held_out_loss_that_stopped_improving_early_is_flagged():
    curve = [(20, 4.0), (40, 3.5), (60, 3.4), (80, 3.45), (100, 3.6)]
    (flag,) = stalled_heldout({"main": rows(curve, 100)}, 0.2)
    assert "stage main" in flag and "step 60 of 100" in flag and "best 3.400" in flag
    assert "2 evaluations since" in flag and "rose to 3.600" in flag and "memorising" in flag


def test_a_loss_still_improving_or_a_late_best_is_not_flagged():
    improving = [(20, 4.0), (40, 3.5), (60, 3.4), (80, 3.3), (100, 3.2)]
    late_best = [(20, 4.0), (40, 3.5), (60, 3.4), (90, 3.3), (100, 3.31)]
    assert stalled_heldout({"main": rows(improving, 100), "other": rows(late_best, 100)}, 0.2) == []
    assert stalled_heldout({"main": rows([(20, 4.0), (40, 3.0)], 100)}, 0.2) == []  # too few evaluations
    assert stalled_heldout({"main": rows([(20, 4.0), (40, 3.0), (60, 3.1), (100, 3.2)], 100)}, None) == []


def test_flags_reach_the_report_without_changing_the_verdict(tmp_path):
    metrics = ppl_metrics(55, 725)
    stage_rows = rows([(20, 4.0), (40, 3.5), (60, 3.4), (80, 3.45), (100, 3.6)], 100)
    for r in stage_rows:
        r["lr"] = 0.01
    result = verdict(metrics, EvalSpec(), {"main": stage_rows})
    assert result.fit_to_ship and len(result.flags) == 1
    report = write_report(tmp_path, "r", metrics, result, [], {"main": stage_rows},
                          [{"name": "main", "steps": 100, "final_loss": 3.0, "heldout_loss": 3.6,
                            "tokens_per_s": 10.0, "gates_passed": True}])
    assert report["flags"] == result.flags
    assert json.loads((tmp_path / "report.json").read_text())["passed"] == result.passed
    md = (tmp_path / "report.md").read_text()
    assert "**FIT TO SHIP**" in md and "- **flag**: stage main" in md and "- held: held-out loss" in md


def finetune_record(before: dict, after: dict) -> dict:
    return {"before": {"metrics": before}, "after": {"metrics": after}}


def test_an_sft_run_is_judged_on_its_own_response_loss_and_task_metric():
    from runyard.evaluate.report import finetune_verdict

    # The run: the held-out response loss fell from 7.64 to 5.09; the task share rose.
    record = finetune_record({"heldout_loss": 7.64, "task_python_syntax": 0.0},
                             {"heldout_loss": 5.09, "task_python_syntax": 11 / 16})
    v = finetune_verdict("sft", "sft", record, EvalSpec())
    assert v.fit_to_ship and v.reasons == []
    assert any("response loss 5.0900 is 33.4% below its initial weights' 7.6400" in p for p in v.passed)
    assert any("task metric python_syntax 0.688" in p for p in v.passed)
    assert not finetune_verdict("sft", "sft", record, EvalSpec(min_response_loss_drop=0.5)).fit_to_ship
    assert not finetune_verdict("sft", "sft", record, EvalSpec(min_task_score=0.9)).fit_to_ship
    worse = finetune_record({"heldout_loss": 5.0, "task_exact_match": 0.5}, {"heldout_loss": 5.2, "task_exact_match": 0.25})
    v = finetune_verdict("tune", "sft", worse, EvalSpec())
    assert not v.fit_to_ship and len(v.reasons) == 2
    assert "4.0% above its initial weights'" in v.reasons[0]
    assert finetune_verdict("tune", "sft", worse, EvalSpec(min_response_loss_drop=None, min_task_score=0.0)).fit_to_ship


def test_a_dpo_run_is_judged_on_reward_accuracy_and_margin():
    from runyard.evaluate.report import finetune_verdict

    record = finetune_record({"heldout_reward_accuracy": 0.0, "heldout_reward_margin": 0.0},
                             {"heldout_reward_accuracy": 0.75, "heldout_reward_margin": 0.34})  # the demo's
    assert finetune_verdict("dpo", "dpo", record, EvalSpec()).fit_to_ship
    chance = finetune_record({"heldout_reward_accuracy": 0.0, "heldout_reward_margin": 0.0},
                             {"heldout_reward_accuracy": 0.4, "heldout_reward_margin": -0.1})
    v = finetune_verdict("dpo", "dpo", chance, EvalSpec())
    assert not v.fit_to_ship and any("eval.min_reward_accuracy" in r for r in v.reasons)
    assert any("eval.min_reward_margin" in r for r in v.reasons)
    assert not finetune_verdict("dpo", "dpo", {}, EvalSpec()).fit_to_ship  # no figures: not judged fit


def test_a_missing_figure_is_a_stated_reason_not_a_crash():
    from runyard.evaluate.report import finetune_verdict

    # A dpo record without reward accuracy (before and after): the bound cannot be judged, and says so.
    record = finetune_record({"heldout_reward_margin": 0.0}, {"heldout_reward_margin": 0.3})
    v = finetune_verdict("prefs", "dpo", record, EvalSpec())
    assert not v.fit_to_ship
    assert v.reasons == ["stage prefs recorded no held-out reward accuracy (stages/prefs/finetune.json), so "
                         "eval.min_reward_accuracy cannot be judged; fit to ship needs the figure"]
    assert any("eval.min_reward_margin" in p for p in v.passed)
    # Reward accuracy after but not before: judged, the missing initial figure shown as '-'.
    v = finetune_verdict("prefs", "dpo", finetune_record({"heldout_reward_margin": 0.0}, {"heldout_reward_accuracy": 0.8,
                                                                "heldout_reward_margin": 0.3}), EvalSpec())
    assert v.fit_to_ship and "(initial weights -)" in v.passed[0]
    # No bound set: a missing figure is not asked for.
    loose = EvalSpec(min_reward_accuracy=None)
    assert finetune_verdict("prefs", "dpo", record, loose).fit_to_ship
    # sft without the response loss after training, under eval.min_response_loss_drop.
    v = finetune_verdict("chat", "sft", finetune_record({"heldout_loss": 7.6}, {"task_exact": 0.5}), EvalSpec())
    assert not v.fit_to_ship and "recorded no held-out response loss" in v.reasons[0]

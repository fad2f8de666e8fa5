"""Tabular training: runyard's LightGBM stage against plain LightGBM with the same parameters on the same
split.

runyard's side is the stage as a run fits it (`runyard.train.tabular_stage.fit_stage`): the family's
config from the spec, `lightgbm.train` with early stopping on the validation split and every round's
losses recorded, then the metrics file and the stage's model directory written (fsynced, checksummed).
The peer is what a LightGBM user writes: the same Datasets, the same parameters (the very dict runyard
passes, `TreesConfig.params`), the same early stopping, and the model saved to a file. Both score the same
test split; their held-out metric must be equal (the same model), and runyard's time at most 1.1x.

Data: scikit-learn's breast cancer table (the example, 569 rows: fixed costs dominate) and a generated
table (`make_classification`, no download; 20,000 rows x 40 features by default: boosting dominates).

Run: python benchmarks/tabular_throughput.py [--rows N] [--threads N] [--repeats N] [--record]   (needs runyard[predict])
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import lightgbm as lgb
import numpy as np
from sklearn.datasets import make_classification
from sklearn.metrics import log_loss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, Samples, add_common_args, interleaved, paired_ratio  # noqa: E402

from runyard.data.tabular import prepare_table  # noqa: E402
from runyard.model import get_family  # noqa: E402
from runyard.model.trees import tree_datasets  # noqa: E402
from runyard.spec.job import parse_spec, resolved_stage  # noqa: E402
from runyard.train.tabular_stage import fit_stage, table_facts  # noqa: E402

SEED = 7


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=20_000, help="rows of the generated table")
    p.add_argument("--features", type=int, default=40, help="features of the generated table")
    # One thread by default: on a shared machine LightGBM's OpenMP threads spin-wait for each other, and
    # two threads on two busy cores ran 20-45x slower than one (67.8 s against 1.5 s for the same fit).
    p.add_argument("--threads", type=int, default=1, help="LightGBM threads, the same on both sides (default 1)")
    add_common_args(p, repeats=5)
    return p.parse_args(argv)


def spec_for(source: dict, target: str, trees: dict, threads: int):
    return parse_spec({"task": "tabular_classification", "name": "bench", "seed": SEED,
                       "data": {"sources": [source], "heldout_fraction": 0.2, "table": {"target": target}},
                       "model": {"family": "lightgbm", "trees": trees}, "resources": {"threads": threads}})


def generated_csv(directory: Path, rows: int, features: int) -> Path:
    x, y = make_classification(n_samples=rows, n_features=features, n_informative=features // 2, random_state=0)
    path = directory / "generated.csv"
    header = ",".join([f"f{i}" for i in range(features)] + ["label"])
    np.savetxt(path, np.column_stack([x, y]), delimiter=",", header=header, comments="", fmt="%.6g")
    return path


def compare(report: Report, name: str, spec, repeats: int, workdir: Path) -> None:
    threads = spec.resources.threads
    prepared = prepare_table(spec.data, spec.task, seed=1)
    stage = resolved_stage(spec, "main")
    fitted = {}

    def runyard_fit() -> None:
        fitted["runyard"] = fit_stage(stage, prepared, workdir / f"{name}-stage", SEED, threads).model

    config = get_family("lightgbm").config_from_spec(stage.model, table=table_facts(prepared))
    params = config.params(SEED, threads)

    def plain_fit() -> None:
        train, valid = tree_datasets(config, prepared.train.x, prepared.train.y, prepared.valid.x, prepared.valid.y)
        booster = lgb.train(params, train, num_boost_round=config.num_boost_round, valid_sets=[valid],
                            callbacks=[lgb.early_stopping(config.early_stopping_rounds, verbose=False)])
        booster.save_model(str(workdir / f"{name}-plain.txt"), num_iteration=booster.best_iteration)
        fitted["plain"] = booster

    def fresh(_name: str) -> None:  # untimed: a run fits into an empty stage directory, the peer a new file
        shutil.rmtree(workdir / f"{name}-stage", ignore_errors=True)
        (workdir / f"{name}-plain.txt").unlink(missing_ok=True)

    times = interleaved({"runyard": runyard_fit, "lightgbm": plain_fit}, repeats, before=fresh)
    ours = fitted["runyard"].predict(prepared.test.x)[:, 1]
    theirs = fitted["plain"].predict(prepared.test.x, num_iteration=fitted["plain"].best_iteration)
    ll_ours, ll_theirs = log_loss(prepared.test.y, ours), log_loss(prepared.test.y, theirs)
    print(f"{name}: {prepared.train.rows} training rows; runyard {times['runyard'].spread()} s, "
          f"lightgbm {times['lightgbm'].spread()} s; test log loss {ll_ours:.6f} vs {ll_theirs:.6f}; "
          f"predictions identical: {np.array_equal(ours, theirs)}")
    report.ratio(f"{name}_fit_time_vs_lightgbm", paired_ratio(times["runyard"], times["lightgbm"]),
                 "plain lightgbm.train, same params, split and early stopping, model saved", "<=", 1.1,
                 {"runyard_s": times["runyard"].values, "lightgbm_s": times["lightgbm"].values})
    same = paired_ratio(Samples([ll_ours]), Samples([ll_theirs]))
    report.ratio(f"{name}_test_log_loss_vs_lightgbm", same, "plain lightgbm's test log loss", "<=", 1.0,
                 {"runyard": ll_ours, "lightgbm": ll_theirs,
                  "identical_predictions": bool(np.array_equal(ours, theirs))})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = Report("tabular_throughput", args, packages=["lightgbm", "scikit-learn"])
    trees = {"learning_rate": 0.05, "num_leaves": 15, "min_data_in_leaf": 10, "num_boost_round": 1000,
             "early_stopping_rounds": 50}
    with tempfile.TemporaryDirectory(prefix="runyard-tabular-bench-") as tmp:
        work = Path(tmp)
        compare(report, "breast_cancer", spec_for({"path": "breast_cancer", "format": "sklearn"}, "diagnosis", trees, args.threads),
                args.repeats, work)
        csv = generated_csv(work, args.rows, args.features)
        compare(report, f"generated_{args.rows}x{args.features}",
                spec_for({"path": str(csv), "format": "csv"}, "label", {**trees, "num_leaves": 31}, args.threads),
                args.repeats, work)
    report.note(f"{args.threads} LightGBM thread(s) on both sides; the machine is shared (see the load average)")
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())

"""A model's lineage by name: a retraining of NAME runs as NAME-retrain-STAMP, so what each retraining
costs counts in the lineage of the model it retrains (model_costs.py). Kept apart from the store, so
that the serving side's retrainers name their runs without importing the market's database layer."""

from __future__ import annotations

import re
import time

RETRAINING = re.compile(r"-retrain-\d{8}T\d{6}$")


def retraining_name(model: str, at: float) -> str:
    """The name a retraining of `model` runs under (a run's and a spec's name), from the moment it was decided."""
    return f"{model}-retrain-{time.strftime('%Y%m%dT%H%M%S', time.gmtime(at))}"


def lineage_of(name: str) -> str:
    """The model a run's name belongs to: the name, less every retraining mark."""
    while RETRAINING.search(name):
        name = RETRAINING.sub("", name)
    return name

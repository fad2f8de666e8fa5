"""What each task reads and which model family suits its data.

A `DataSummary` is the kind of data, rows, features, classes (plan/task_data.py's `summarize_data` makes
one with the run's own readers; the run makes one from its prepared data). `recommend_family(task, summary)` puts the family runyard.model.choice picks
for it (the rule `runyard plan` recommends by too) in words. The run uses both when a spec leaves
`model.family` out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from runyard.data.tabular import PreparedTable
from runyard.model.choice import choose_family, no_family_message
from runyard.model.registry import FamilyUnavailable
from runyard.spec.checks import IMAGE_TASK, LANGUAGE_MODEL


@dataclass(frozen=True)
class DataSummary:
    """What a spec's data is, as far as choosing a model and sizing a run need: `kind` is text, table or
    images; `rows` documents, table rows or images; `features` table columns or pixels x channels."""

    task: str
    kind: str
    rows: int
    features: int
    classes: int | None = None
    numeric_features: int | None = None
    categorical_features: int | None = None
    image_shape: tuple[int, int, int] | None = None  # channels, height, width
    bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Recommendation:
    family: str
    reason: str


def recommend_family(task: str, summary: DataSummary | None = None) -> Recommendation:
    """The model family for `task` and its data, with the reason in words; the choice is
    runyard.model.choice's (the rule `runyard plan` recommends by too). FamilyUnavailable when no
    installed family trains the task."""
    choice = choose_family(task, summary.rows if summary is not None else None)
    if choice.family is None:
        raise FamilyUnavailable(no_family_message(task))
    why = choice.family.why_recommended
    if choice.wanting_more_rows:
        passed_over = ", ".join(f.name for f in choice.wanting_more_rows)
        return Recommendation(choice.family.name, f"a table of {summary.rows} rows (< {choice.fewest_rows_wanted}): "
                              f"too few for {passed_over}; {why}")
    if task == LANGUAGE_MODEL:
        data = "text"
    elif task == IMAGE_TASK:
        data = "images"
    else:
        data = f"{summary.rows} rows x {summary.features} features" if summary else "a table"
    return Recommendation(choice.family.name, f"{data}: {why}")


def table_summary(task: str, prepared: PreparedTable) -> DataSummary:
    """A prepared table's summary: all its rows (every split), its feature columns by kind, its classes."""
    kinds = [f.kind for f in prepared.schema.features]
    rows = prepared.train.rows + prepared.valid.rows + prepared.test.rows
    classes = len(prepared.schema.classes) if prepared.schema.classes else None
    return DataSummary(task, "table", rows=rows, features=len(kinds), classes=classes,
                       numeric_features=kinds.count("numeric"), categorical_features=kinds.count("categorical"))

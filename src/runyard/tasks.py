"""What each task reads and which model family suits its data.

`summarize_data(spec)` looks at a spec's data without preparing it (a table is read, an image folder is
listed and one image decoded, a text corpus is only measured) and returns a `DataSummary`: the kind of
data, rows, features, classes. `recommend_family(task, summary)` picks the family from it, with the reason
in words. The run uses both when a spec leaves `model.family` out, and `runyard plan` can show them.

The rule follows the usual advice: simple, low-dimensional data rarely needs a deep network (trees for a
table, and a linear model when rows are too few for trees to learn from held-out data), while images and
text do (a CNN, a transformer).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from runyard.data.images import read_images
from runyard.data.sources import list_source_files
from runyard.data.tabular import prepare_table
from runyard.spec_checks import IMAGE_TASK, LANGUAGE_MODEL, TABULAR_TASKS

# Below this many rows a table gets the linear model: too few for trees with a validation split to
# early-stop on (each leaf needs min_data_in_leaf rows, the validation split a useful size).
MIN_ROWS_FOR_TREES = 100


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
    """The model family for `task` and its data (the rule in this module's docstring)."""
    if task == LANGUAGE_MODEL:
        return Recommendation("decoder", "text: a decoder transformer (the one language-model family)")
    if task == IMAGE_TASK:
        return Recommendation("cnn", "images: a convolutional network learns local patterns a flat model cannot")
    if task not in TABULAR_TASKS:
        raise ValueError(f"unknown task {task!r}")
    if summary is not None and summary.rows < MIN_ROWS_FOR_TREES:
        return Recommendation("linear", f"a table of {summary.rows} rows (< {MIN_ROWS_FOR_TREES}): too few for "
                              "gradient-boosted trees to early-stop on held-out rows; a regularised linear model")
    rows = f"{summary.rows} rows x {summary.features} features" if summary else "a table"
    return Recommendation("lightgbm", f"{rows}: low-dimensional tabular data, where gradient-boosted trees are "
                          "the strong default (no deep network needed; CPU is enough to train and serve)")


def summarize_data(spec: Any) -> DataSummary:
    """The spec's data summarised without preparing it (see the module's docstring)."""
    task = spec.task
    if task in TABULAR_TASKS:
        return _summarize_table(spec)
    if task == IMAGE_TASK:
        return _summarize_images(spec)
    files = [f for i, s in enumerate(spec.data.sources) for f in list_source_files(s, i)]
    return DataSummary(task, "text", rows=len(files), features=0, bytes=sum(f.size for f in files))


def _summarize_table(spec: Any) -> DataSummary:
    # The run's own reader, so the summary sees the same columns, types and cleaning.
    prepared = prepare_table(spec.data, spec.task, seed=0)
    kinds = [f.kind for f in prepared.schema.features]
    rows = prepared.train.rows + prepared.valid.rows + prepared.test.rows
    classes = len(prepared.schema.classes) if prepared.schema.classes else None
    return DataSummary(spec.task, "table", rows=rows, features=len(kinds), classes=classes,
                       numeric_features=kinds.count("numeric"), categorical_features=kinds.count("categorical"))


def _summarize_images(spec: Any) -> DataSummary:
    images = read_images(spec.data)
    n, c, h, w = images.pixels.shape
    return DataSummary(spec.task, "images", rows=n, features=c * h * w, classes=len(images.class_names),
                       image_shape=(c, h, w), bytes=int(images.pixels.nbytes))


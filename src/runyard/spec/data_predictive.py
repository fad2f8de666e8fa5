"""The `data.table` and `data.images` sections of a job spec: how the tabular and image tasks read, clean
and split their data. spec/data.py embeds them in `DataSpec`; spec/checks.py checks that a spec's task and
its sections agree.
"""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

log = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TableSpec(_Strict):
    """A table (tasks `tabular_classification` and `tabular_regression`): CSV or Parquet files (all with the
    same columns, read in order) or a data set scikit-learn ships. Column types are inferred (numbers,
    else categories) and reported; a column mixing numbers and text is an error naming it."""

    target: str = Field(description="the column to predict")
    features: list[str] | None = Field(
        default=None,
        description="the feature columns; null: every column except target, split_key and drop",
    )
    drop: list[str] = Field(default_factory=list, description="columns left out of the features (ids, leaks)")
    categorical: list[str] = Field(
        default_factory=list,
        description="columns read as categories even though they hold numbers (codes); text and boolean columns "
        "are categories anyway",
    )
    missing_numeric: Literal["native", "median", "drop_rows", "error"] = Field(
        default="native",
        description="a missing numeric value: `native` (kept missing: the trees learn where to send it; the linear "
        "model imputes the training median), `median` (the training median, for every family), `drop_rows` "
        "(the row is removed, counted) or `error`",
    )
    missing_categorical: Literal["category", "drop_rows", "error"] = Field(
        default="category",
        description="a missing categorical value: `category` (its own category, `<missing>`), `drop_rows` or `error`",
    )
    dedup: Literal["none", "rows", "key"] = Field(
        default="none",
        description="exact duplicates: `none` (every row kept: distinct respondents may give identical answers), "
        "`rows` (a row repeating an earlier row in every column read, dropped ones included, is removed) or `key` "
        "(a row whose dedup_key columns repeat an earlier row's is removed; the first is kept). The data report "
        "counts the exact duplicate rows either way",
    )
    dedup_key: list[str] | None = Field(
        default=None,
        description="with dedup `key`: the columns that identify a row (a respondent id, an order number)",
    )
    split_key: str | None = Field(
        default=None,
        description="a column whose equal values always land in the same split (a patient, a customer), so no "
        "key is both trained and tested on; null: rows are split one by one",
    )
    stratify: bool = Field(
        default=True,
        description="classification: split each class in proportion, so every split keeps the class balance "
        "(ignored with split_key and for regression)",
    )
    validation_fraction: float = Field(
        default=0.15,
        gt=0,
        lt=0.5,
        description="fraction of the training rows set aside for early stopping and the held-out loss during "
        "training (data.heldout_fraction is the test split, scored once at the end)",
    )
    max_categories: int = Field(
        default=1000,
        ge=2,
        description="most distinct values a categorical feature may have; more is an error naming the column (an "
        "id, most likely: drop it)",
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy_drop_duplicates(cls, data: object) -> object:
        # drop_duplicates (a boolean, once defaulting to true) became dedup; the old key still reads, mapped.
        if isinstance(data, dict) and "drop_duplicates" in data:
            data = dict(data)
            old = data.pop("drop_duplicates")
            if "dedup" in data:
                raise ValueError("drop_duplicates is the old name of dedup: give dedup only")
            if not isinstance(old, bool):
                raise ValueError(f"drop_duplicates (deprecated: use dedup: rows | none | key) is true or false, got {old!r}")
            data["dedup"] = "rows" if old else "none"
            log.warning("data.table.drop_duplicates is deprecated: read as dedup: %s (write that instead)", data["dedup"])
        return data

    @model_validator(mode="after")
    def _columns_distinct(self) -> TableSpec:
        if self.dedup == "key" and not self.dedup_key:
            raise ValueError("dedup: key needs dedup_key, the columns that identify a row")
        if self.dedup != "key" and self.dedup_key:
            raise ValueError(f"dedup_key {self.dedup_key} is used only with dedup: key (dedup is {self.dedup!r})")
        if self.target in self.drop or (self.features and self.target in self.features):
            raise ValueError(f"the target {self.target!r} cannot also be a feature or dropped")
        if self.split_key is not None and self.split_key == self.target:
            raise ValueError("split_key cannot be the target")
        return self


class ImagesSpec(_Strict):
    """Images (task `image_classification`): a folder per class (PNG or JPEG, decoded by Pillow), `.npz`
    arrays, or a data set scikit-learn ships (`digits`)."""

    channels: Literal[1, 3] | None = Field(
        default=None,
        description="1 (grey) or 3 (RGB): images are converted to it; null: 1 if every image is grey, else 3",
    )
    resize: list[int] | None = Field(
        default=None,
        description="[height, width] every image is resized to (bilinear); null: every image must already have "
        "the same size (a different one is an error naming the file)",
    )
    max_value: float | None = Field(
        default=None,
        gt=0,
        description="pixel values are divided by this to lie in [0, 1]; null: 255 for 8-bit images, 16 for "
        "scikit-learn's digits, 1 for float arrays already in [0, 1]",
    )
    npz_images: str = Field(default="x", description="the array of images in an .npz source: [N, H, W] or [N, H, W, C]")
    npz_labels: str = Field(default="y", description="the array of integer labels in an .npz source; a negative label is a missing target")
    class_names: list[str] | None = Field(
        default=None,
        description="names of the labels 0, 1, ... of an .npz source; null: the label numbers as text",
    )
    drop_duplicates: bool = Field(default=True, description="remove images whose pixels and label repeat an earlier image's, counted")
    validation_fraction: float = Field(
        default=0.15,
        gt=0,
        lt=0.5,
        description="fraction of the training images set aside for the held-out loss during training and its gates",
    )

    @field_validator("resize")
    @classmethod
    def _two_sizes(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (len(v) != 2 or any(s < 1 for s in v)):
            raise ValueError("resize is [height, width], two positive integers")
        return v

"""Spec sections of the tabular and image tasks' model families and of their fit-to-ship thresholds:
`model.trees` (LightGBM), `model.linear` (scikit-learn's logistic or ridge regression), `model.cnn` (a
small convolutional network trained by runyard's loop) and `eval.prediction`.

spec/sections.py embeds them in `model` and `eval`; the data side (`data.table`, `data.images`) lives in
runyard.spec.data_predictive. Every field carries a description (the spec reference is built from them).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TreesSpec(_Strict):
    """Gradient-boosted trees through LightGBM (family `lightgbm`), for tabular tasks. Boosting stops early
    when the validation split's loss has not improved for `early_stopping_rounds` rounds; the model keeps
    the best round. Names are LightGBM's own parameters."""

    num_boost_round: int = Field(default=500, ge=1, description="most boosting rounds (trees per class); early stopping usually ends sooner")
    learning_rate: float = Field(default=0.05, gt=0, le=1, description="shrinkage applied to each tree's contribution")
    num_leaves: int = Field(default=31, ge=2, description="most leaves per tree")
    max_depth: int = Field(default=-1, ge=-1, description="most depth per tree; -1 means no limit (num_leaves bounds it)")
    min_data_in_leaf: int = Field(default=20, ge=1, description="fewest training rows in a leaf")
    feature_fraction: float = Field(default=1.0, gt=0, le=1, description="fraction of features each tree may split on (drawn per tree)")
    bagging_fraction: float = Field(default=1.0, gt=0, le=1, description="fraction of rows each bagging round draws (with bagging_freq > 0)")
    bagging_freq: int = Field(default=0, ge=0, description="draw a new bagging sample every this many rounds; 0 turns bagging off")
    lambda_l1: float = Field(default=0.0, ge=0, description="L1 regularisation of leaf values")
    lambda_l2: float = Field(default=0.0, ge=0, description="L2 regularisation of leaf values")
    max_bin: int = Field(default=255, ge=2, description="most histogram bins per numeric feature")
    early_stopping_rounds: int | None = Field(
        default=50,
        ge=1,
        description="stop when the validation loss has not improved for this many rounds; null trains every round",
    )


class LinearSpec(_Strict):
    """A linear model through scikit-learn (family `linear`): logistic regression for classification,
    ridge regression for regression, after median imputation, standardisation and one-hot categories. It
    is also the baseline the trees are compared with in the evaluation report."""

    l2: float = Field(default=1.0, gt=0, description="L2 penalty strength: ridge's alpha, or 1/C of logistic regression")
    max_iter: int = Field(default=1000, ge=1, description="most solver iterations (logistic regression)")


class CnnAugmentSpec(_Strict):
    """Random changes to each training image (one affine warp: shift, rotation, scale, and a mirror if
    asked), drawn from the stage's data seed and the image's place in the training stream, so a run
    repeats them and a resumed run draws the same ones. Held-out, test and served images are never
    changed. Off by default (all zero, no flip): on the held-out-font glyph benchmark
    (benchmarks/image_throughput.py) shift 0.1, rotate 10 and scale 0.1 with label smoothing 0.1 scored
    0.30 and 0.45 where the plain recipe scored 0.35 and 0.49 (150 and 400 steps): a short run
    underfits, and augmentation slows it further. Longer runs may gain from it."""

    shift: float = Field(default=0.0, ge=0, lt=0.5, description="most shift, as a fraction of the height and width (each drawn uniformly in ±shift)")
    rotate: float = Field(default=0.0, ge=0, le=180, description="most rotation in degrees (drawn uniformly in ±rotate)")
    scale: float = Field(default=0.0, ge=0, lt=0.5, description="most zoom in or out, as a fraction (the scale is drawn uniformly in 1 ± scale)")
    horizontal_flip: bool = Field(
        default=False,
        description="mirror half the images left to right; off by default: it changes what glyphs and digits mean",
    )


class CnnSpec(_Strict):
    """A small convolutional network for images (family `cnn`): blocks of 3x3 convolution, batch norm, ReLU
    and 2x2 max pooling, then global average pooling, a hidden layer and the classifier. Pixels are
    normalised inside the model with the training split's per-channel mean and std, so the export takes
    images as they come. Trained by runyard's loop (optim, schedule, train apply); augmentation and label
    smoothing are options (off by default: measured, they cost a short run accuracy)."""

    channels: list[int] = Field(
        default_factory=lambda: [32, 64],
        min_length=1,
        max_length=8,
        description="output channels of each convolution block; each block halves height and width (while they exceed 1)",
    )
    kernel_size: int = Field(default=3, ge=1, le=11, description="convolution kernel size (odd; padding keeps the size)")
    hidden: int = Field(default=128, ge=1, description="width of the hidden layer before the classifier")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="dropout before the classifier during training")
    batch_norm: bool = Field(default=True, description="batch normalisation after each convolution")
    label_smoothing: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="the training loss's target puts this much probability evenly over every class (1 - it on the "
        "label); the held-out and test losses are the plain cross-entropy",
    )
    augment: CnnAugmentSpec = Field(
        default_factory=CnnAugmentSpec,
        description="random shifts, rotations and zoom of the training images (all zero, the default: none)",
    )

    @field_validator("channels")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(c < 1 for c in v):
            raise ValueError("every block needs at least 1 channel")
        return v

    @field_validator("kernel_size")
    @classmethod
    def _odd(cls, v: int) -> int:
        if v % 2 == 0:
            raise ValueError("an odd kernel size keeps the image size with symmetric padding")
        return v


class PredictionEvalSpec(_Strict):
    """Fit to ship for tabular and image tasks: the held-out (test) split's metrics against these bounds
    (null turns one off), and against a stated baseline (classification: predicting the training split's
    class frequencies; regression: its mean)."""

    min_accuracy: float | None = Field(default=None, ge=0, le=1, description="fit to ship only if accuracy is at least this (classification)")
    min_f1: float | None = Field(default=None, ge=0, le=1, description="fit to ship only if F1 (averaged as f1_average says) is at least this (classification)")
    min_roc_auc: float | None = Field(default=None, ge=0, le=1, description="fit to ship only if ROC AUC (one-vs-rest, macro, with more than two classes) is at least this (classification)")
    max_log_loss: float | None = Field(default=None, gt=0, description="fit to ship only if log loss (nats per row) is at most this (classification)")
    max_rmse: float | None = Field(default=None, gt=0, description="fit to ship only if the root mean squared error is at most this, in target units (regression)")
    max_mae: float | None = Field(default=None, gt=0, description="fit to ship only if the mean absolute error is at most this, in target units (regression)")
    min_r2: float | None = Field(default=None, le=1, description="fit to ship only if R² (coefficient of determination) is at least this (regression)")
    must_beat_baseline: bool = Field(
        default=True,
        description="fit to ship only if the model's loss (log loss, or RMSE for regression) is at least baseline_margin "
        "below the baseline's",
    )
    baseline_margin: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="fraction by which the loss must fall below the baseline's for must_beat_baseline: 0.1 means at least 10% lower",
    )
    f1_average: Literal["auto", "binary", "macro", "weighted"] = Field(
        default="auto",
        description="how F1 is averaged over classes: `binary` (the positive class: the second in sorted order), `macro`, "
        "`weighted`, or `auto` (binary with two classes, else macro)",
    )
    calibration_bins: int = Field(default=10, ge=2, le=100, description="bins of predicted probability in the calibration plot")

"""Starting specs, one per task: `runyard spec init --task T` writes one, commented from the models'
own field descriptions so the comments say what the reference says.

A template is a function of the run's name returning the values to write (a nested mapping in the
spec's shape); `TEMPLATES` maps each task of `runyard.spec.job.TASKS` to one. The tabular and image templates
read data sets scikit-learn ships (runyard[predict]), so they too run as written. Every template loads as
it is written (a test checks each one).
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import yaml
from pydantic import BaseModel

from runyard.spec.job import JobSpec
from runyard.spec.paths import field_model
from runyard.spec.sections import StageSpec

_STAGE_OVERRIDES = ("model", "optim", "schedule", "train")
_WIDTH = 100


def _language_model(name: str) -> dict[str, Any]:
    return {
        "task": "language_model",
        "name": name,
        "seed": 0,
        "data": {
            "sources": [
                # Real text on every machine, so the spec runs as written; point it at your own files.
                {"path": "{stdlib}/*.py", "format": "text", "exclude": []},
            ],
            "heldout_fraction": 0.05,
            "tokenizer": {"vocab_size": 4096, "min_frequency": 2},
            "filters": {
                "min_chars": 1,
                "max_duplicate_line_fraction": 0.9,
                "min_words": None,
                "max_symbol_word_ratio": None,
                "max_top_ngram_fraction": None,
            },
            "pii": {"enabled": False},
            "dedup": {"exact": True, "near": True, "threshold": 0.8},
        },
        "model": {"d_model": 128, "n_layers": 4, "n_heads": 4, "context_length": 128},
        "optim": {"lr": 0.003, "weight_decay": 0.1, "grad_clip": 1.0},
        "schedule": {"warmup_steps": 20, "decay": "cosine"},
        "train": {"steps": 200, "batch_size": 16, "grad_accum": 1},
        "stages": [
            {
                "name": "smoke",
                "model": {"d_model": 64, "n_layers": 2},
                "train": {"steps": 30},
                "schedule": {"warmup_steps": 5},
                "gates": {"min_loss_drop": 0.1},
            },
            {"name": "main", "gates": {"min_loss_drop": 0.2, "max_heldout_loss": None}},
        ],
        "eval": {
            "interval": 50,
            "final_batches": 16,
            "max_heldout_perplexity": None,
            "must_beat_unigram": True,
            "unigram_margin": 0.1,
            "prompts": ["def ", "import "],
        },
        "checkpoint": {"interval": 50, "keep_last": 2},
        "resources": {"device": "auto", "precision": "auto", "nproc": 1},
    }


def _tabular(task: str, dataset: str, target: str) -> Callable[[str], dict[str, Any]]:
    def template(name: str) -> dict[str, Any]:
        return {
            "task": task,
            "name": name,
            "seed": 0,
            "data": {
                # A table scikit-learn ships; point it at your own CSV or Parquet files (format: csv).
                "sources": [{"path": dataset, "format": "sklearn"}],
                "heldout_fraction": 0.2,
                "table": {
                    "target": target,
                    "drop": [],
                    "categorical": [],
                    "missing_numeric": "native",
                    "missing_categorical": "category",
                    "split_key": None,
                    "validation_fraction": 0.15,
                },
            },
            # family null: trees for 100 rows or more, a linear model below (recorded in the manifest).
            "model": {"family": None, "trees": {"learning_rate": 0.05, "num_leaves": 15, "early_stopping_rounds": 50}},
            "stages": [{"name": "main", "gates": {"min_loss_drop": 0.1}}],
            "eval": {"prediction": {"must_beat_baseline": True, "baseline_margin": 0.1}},
            "resources": {"device": "cpu", "threads": 2},
        }

    return template


def _image_classification(name: str) -> dict[str, Any]:
    return {
        "task": "image_classification",
        "name": name,
        "seed": 0,
        "data": {
            # scikit-learn's 8x8 digits; point it at a folder with a subfolder of images per class
            # (format: image_folder) or an .npz file.
            "sources": [{"path": "digits", "format": "sklearn"}],
            "heldout_fraction": 0.2,
            "images": {"channels": None, "resize": None, "validation_fraction": 0.15},
        },
        # Augmentation and label smoothing are off: in a run this short they cost accuracy (measured on
        # glyphs in unseen fonts); for a long run try shift 0.1, rotate 10, scale 0.1, label_smoothing 0.1
        # (no flips: a mirrored glyph or digit is another character).
        "model": {"family": "cnn", "cnn": {
            "channels": [16, 32], "hidden": 64, "batch_norm": True, "label_smoothing": 0.0,
            "augment": {"shift": 0.0, "rotate": 0.0, "scale": 0.0, "horizontal_flip": False},
        }},
        "optim": {"lr": 0.003, "weight_decay": 0.01},
        "schedule": {"warmup_steps": 10, "decay": "cosine"},
        "train": {"steps": 150, "batch_size": 64},
        "stages": [{"name": "main", "gates": {"min_loss_drop": 0.3}}],
        "eval": {"interval": 25, "batches": 4, "prediction": {"min_accuracy": 0.9}},
        "checkpoint": {"interval": 50, "keep_last": 2},
        "resources": {"device": "auto", "nproc": 1},
    }


TEMPLATES: dict[str, Callable[[str], dict[str, Any]]] = {
    "language_model": _language_model,
    "tabular_classification": _tabular("tabular_classification", "breast_cancer", "diagnosis"),
    "tabular_regression": _tabular("tabular_regression", "diabetes", "progression"),
    "image_classification": _image_classification,
}

_HEADER = """\
# A runyard job spec ({task}), written by `runyard spec init`. Fields left out take their defaults;
# every field is described in docs/spec.md (or `runyard spec reference FIELD`).
# Check it with `runyard plan {file}`; run it with `runyard run {file}`.
# Editors: a first line `# yaml-language-server: $schema=PATH/docs/spec.schema.json` gives completion.
"""


def render_template(task: str, name: str, file_name: str = "SPEC") -> str:
    """The commented YAML of `task`'s starting spec for a run called `name`."""
    values = TEMPLATES[task](name)
    lines = _HEADER.format(task=task, file=file_name).splitlines()
    lines.append("")
    _emit_mapping(values, JobSpec, 0, lines, top=True)
    return "\n".join(lines) + "\n"


def _comment(text: str, indent: int) -> list[str]:
    prefix = " " * indent + "# "
    return textwrap.wrap(text, _WIDTH - len(prefix), initial_indent=prefix, subsequent_indent=prefix)


def _scalar(value: Any) -> str:
    return yaml.safe_dump([value], default_flow_style=True, width=1 << 16).strip()[1:-1]


def _section_of(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    if model is StageSpec and key in _STAGE_OVERRIDES:
        return field_model(JobSpec.model_fields[key].annotation)
    return field_model(model.model_fields[key].annotation)


def _emit_mapping(
    values: dict[str, Any],
    model: type[BaseModel],
    indent: int,
    lines: list[str],
    top: bool = False,
    comments: bool = True,
) -> None:
    pad = " " * indent
    for key, value in values.items():
        info = model.model_fields[key]
        sub = _section_of(model, key)
        if top and lines[-1] != "":
            lines.append("")
        doc = info.description or ""
        if top and sub is not None:
            doc = " ".join(inspect.cleandoc(sub.__doc__ or "").split())
        if comments:
            lines += _comment(doc, indent)
        if sub is not None and isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            # A stage's overrides repeat fields documented in their top-level section.
            overrides = model is StageSpec and key in _STAGE_OVERRIDES
            _emit_mapping(value, sub, indent + 2, lines, comments=comments and not overrides)
        elif sub is not None and isinstance(value, list) and all(isinstance(item, dict) for item in value):
            # (a list of sections; eval.prompts' text prompts are scalars though a prompt may be messages)
            lines.append(f"{pad}{key}:")
            for i, item in enumerate(value):  # the first item's comments serve the others
                _emit_list_item(item, sub, indent + 2, lines, comments=comments and i == 0)
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}")


def _emit_list_item(
    item: dict[str, Any], model: type[BaseModel], indent: int, lines: list[str], comments: bool
) -> None:
    body: list[str] = []
    _emit_mapping(item, model, indent + 2, body, comments=comments)
    # The item's first key goes on the dash line; its comment (if any) stays above it.
    first = next(i for i, line in enumerate(body) if not line.lstrip().startswith("#"))
    lines += body[:first]
    lines.append(" " * indent + "- " + body[first].lstrip())
    lines += body[first + 1 :]

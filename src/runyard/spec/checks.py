"""Whole-spec checks that a spec's task and its sections agree: a tabular spec names a target and reads
tables, an image spec reads images, each names a family of its task, and a field that only another task
uses is an error naming it rather than a setting silently ignored.

`task_problems(spec)` returns (field location, value, what was expected) for each disagreement; spec.py
raises them as one SpecError, each under its own field path.
"""

from __future__ import annotations

from typing import Any

LANGUAGE_MODEL = "language_model"
TABULAR_TASKS = ("tabular_classification", "tabular_regression")
IMAGE_TASK = "image_classification"

FAMILIES_BY_TASK: dict[str, tuple[str, ...]] = {
    LANGUAGE_MODEL: ("decoder",),
    "tabular_classification": ("lightgbm", "linear"),
    "tabular_regression": ("lightgbm", "linear"),
    IMAGE_TASK: ("cnn",),
}
FORMATS_BY_TASK: dict[str, tuple[str, ...]] = {
    LANGUAGE_MODEL: ("text", "jsonl", "parquet"),
    "tabular_classification": ("csv", "parquet", "sklearn"),
    "tabular_regression": ("csv", "parquet", "sklearn"),
    IMAGE_TASK: ("image_folder", "npz", "sklearn"),
}
# The data sets scikit-learn ships inside its wheel (nothing is downloaded), by the task that reads them.
SKLEARN_SETS_BY_TASK: dict[str, tuple[str, ...]] = {
    "tabular_classification": ("breast_cancer", "wine", "iris", "digits"),
    "tabular_regression": ("diabetes",),
    IMAGE_TASK: ("digits",),
}

# Fields only a language model reads; one set away from its default in another task's spec is an error.
_LANGUAGE_ONLY = {
    "data": ("tokenizer", "shard_tokens", "normalize", "filters", "pii", "dedup", "chunk_bytes"),
    "model": ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "context_length",
              "tie_embeddings", "dropout", "rope_theta", "norm_eps"),
    "eval": ("max_heldout_perplexity", "max_gap", "must_beat_unigram", "unigram_margin", "prompts",
             "sample_tokens", "temperature", "top_k"),
}
# Sections of the loop (optimizer, schedule, steps) that a library-fitted family does not use.
_LOOP_SECTIONS = ("optim", "schedule", "train")


def _set(section: Any) -> set[str]:
    """The fields of `section` whose values differ from their defaults. Not pydantic's fields_set: a
    run directory's stored spec states every default explicitly, and must load as the original did."""
    out = set()
    for name, info in type(section).model_fields.items():
        if getattr(section, name) != info.get_default(call_default_factory=True):
            out.add(name)
    return out


def task_problems(spec: Any) -> list[tuple[tuple[Any, ...], Any, str]]:
    """Every way `spec`'s sections disagree with its task (empty when they agree)."""
    task = spec.task
    problems: list[tuple[tuple[Any, ...], Any, str]] = []
    if spec.data is None and task != LANGUAGE_MODEL:
        return problems  # JobSpec names the missing data (only an sft/dpo-only language model may leave it out)
    if spec.data is not None:
        problems += _source_problems(spec, task)
    problems += _family_problems(spec, task)
    if task == LANGUAGE_MODEL:
        for loc, name in ((("data", "table"), "data.table"), (("data", "images"), "data.images"),
                          (("model", "trees"), "model.trees"), (("model", "linear"), "model.linear"),
                          (("model", "cnn"), "model.cnn"), (("eval", "prediction"), "eval.prediction")):
            if (spec.data is not None or loc[0] != "data") and _lookup(spec, loc) is not None:
                problems.append((loc, "(set)", f"{name} is for the tabular and image tasks, not task {task}"))
        for i, stage in enumerate(spec.stages):
            if stage.gates.min_samples_per_s is not None:
                problems.append((("stages", i, "gates", "min_samples_per_s"), stage.gates.min_samples_per_s,
                                 "a gate of the image task; language models have min_tokens_per_s"))
        return problems

    for section, names in _LANGUAGE_ONLY.items():
        for name in sorted(_set(getattr(spec, section)) & set(names)):
            problems.append(((section, name), getattr(getattr(spec, section), name),
                             f"a language-model field; task {task} does not use it (remove it, or leave its default)"))
    for i, stage in enumerate(spec.stages):
        for name in sorted(set(stage.model) & set(_LANGUAGE_ONLY["model"])):
            problems.append((("stages", i, "model", name), stage.model[name],
                             f"a language-model field; task {task} does not use it"))
        if stage.gates.min_tokens_per_s is not None:
            problems.append((("stages", i, "gates", "min_tokens_per_s"), stage.gates.min_tokens_per_s,
                             "a language-model gate" + ("; images have min_samples_per_s" if task == IMAGE_TASK else "")))
        if task != IMAGE_TASK and stage.gates.min_samples_per_s is not None:
            problems.append((("stages", i, "gates", "min_samples_per_s"), stage.gates.min_samples_per_s,
                             "a gate of the image task"))

    if task in TABULAR_TASKS:
        if spec.data.table is None:
            problems.append((("data", "table"), "(missing)",
                             f"task {task} needs data.table naming at least its target column"))
        if spec.data.images is not None:
            problems.append((("data", "images"), "(set)", f"data.images is for image_classification, not {task}"))
        if spec.model.cnn is not None:
            problems.append((("model", "cnn"), "(set)", f"model.cnn is the image family's; task {task} fits trees or a linear model"))
        # LightGBM and scikit-learn fit in one process with their own threads and iterations.
        for section in _LOOP_SECTIONS:
            if _set(getattr(spec, section)):
                problems.append(((section,), "(set)", f"the {section} section is for models trained by runyard's loop; "
                                 f"task {task} is fit by LightGBM or scikit-learn (set model.trees or model.linear)"))
            for i, stage in enumerate(spec.stages):
                if getattr(stage, section):
                    problems.append((("stages", i, section), getattr(stage, section),
                                     f"task {task} is fit by LightGBM or scikit-learn; stages may change model only"))
        if spec.resources.nproc > 1:
            problems.append((("resources", "nproc"), spec.resources.nproc,
                             f"1: task {task} fits in one process (LightGBM's threads: resources.threads)"))
    else:  # images
        if spec.data.table is not None:
            problems.append((("data", "table"), "(set)", "data.table is for the tabular tasks, not image_classification"))
        for name in ("trees", "linear"):
            if getattr(spec.model, name) is not None:
                problems.append((("model", name), "(set)", f"model.{name} is a tabular family's; images train model.cnn"))
    return problems


def _lookup(spec: Any, loc: tuple[str, ...]) -> Any:
    node = spec
    for part in loc:
        node = getattr(node, part)
    return node


def _source_problems(spec: Any, task: str) -> list[tuple[tuple[Any, ...], Any, str]]:
    problems = []
    formats = FORMATS_BY_TASK[task]
    for i, source in enumerate(spec.data.sources):
        if source.format not in formats:
            unset = "format" not in source.model_fields_set  # the language model's default, `text`
            problems.append((("data", "sources", i, "format"), source.format,
                             f"one of {', '.join(formats)} for task {task}"
                             + (f" (it defaults to text; set format: for {source.path!r})" if unset else "")))
        elif source.format == "sklearn" and source.path not in SKLEARN_SETS_BY_TASK[task]:
            problems.append((("data", "sources", i, "path"), source.path,
                             f"a data set scikit-learn ships for task {task}: one of "
                             f"{', '.join(SKLEARN_SETS_BY_TASK[task])}"))
    return problems


def _family_problems(spec: Any, task: str) -> list[tuple[tuple[Any, ...], Any, str]]:
    allowed = FAMILIES_BY_TASK[task]
    problems = []
    if spec.model.family is not None and spec.model.family not in allowed:
        problems.append((("model", "family"), spec.model.family, f"one of {', '.join(allowed)} for task {task}"))
    for i, stage in enumerate(spec.stages):
        family = stage.model.get("family")
        if family is not None and family not in allowed:
            problems.append((("stages", i, "model", "family"), family, f"one of {', '.join(allowed)} for task {task}"))
    chosen = {spec.model.family, *(s.model.get("family") for s in spec.stages)} - {None}
    if task in TABULAR_TASKS and spec.model.trees is not None and chosen and "lightgbm" not in chosen:
        problems.append((("model", "trees"), "(set)", "settings of family lightgbm, which no stage uses"))
    return problems

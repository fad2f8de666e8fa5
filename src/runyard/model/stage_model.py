"""What each stage's model starts from (`model.init`), and the model config it trains.

A stage starts from random weights, from an earlier stage's final weights (`{from: stage}`), from a
runyard export (`{from: export}`) or from a Hugging Face model directory (`{from: hf}`). The model's
shape is the weights': `stage_config` merges the spec's `model` section into the weights' config and
reports every field the spec contradicts. It lives beside the family registry because the config is the
family's; the planner sizes it (plan/sizing.py), the loop builds it (train/loop.py) and loads its
weights (train/init_weights.py), and plan/weights_in.py checks a spec against it before any work.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runyard.errors import RunyardError, SpecError
from runyard.model.config import ConfigContradiction
from runyard.model.hf.config import HF_FIELDS
from runyard.model.hf.export import read_export_config
from runyard.model.registry import get_family
from runyard.spec.job import JobSpec, reference_hint, resolved_stage

SPEC_SOURCE = "(spec checked against its initial weights)"


@dataclass(frozen=True)
class StageStart:
    """Where one stage's weights come from. `field` is the spec path of its `model.init`."""

    stage: str
    source: str  # "random", "stage", "export" or "hf"
    field: str
    from_stage: str | None = None
    directory: Path | None = None


def stage_start(spec: JobSpec, stage_name: str) -> StageStart:
    """The stage's `model.init`, resolved (top-level inheritance included)."""
    stage = resolved_stage(spec, stage_name)
    init = stage.model.init
    field = f"stages[{stage.index}].model.init" if "init" in spec.stages[stage.index].model else "model.init"
    if init is None:
        return StageStart(stage_name, "random", field)
    if init.source == "stage":
        return StageStart(stage_name, "stage", field, from_stage=init.name)
    return StageStart(stage_name, init.source, field, directory=Path(init.path))


def _directory_problem(start: StageStart, message: str) -> SpecError:
    return SpecError(SPEC_SOURCE, [(f"{start.field}.path", str(start.directory),
                                    f"{message} {reference_hint('model.init.path')}")])


def directory_config(spec: JobSpec, start: StageStart) -> Any:
    """The config of the model in the stage's init directory; SpecError naming the file and field."""
    family = get_family(resolved_stage(spec, start.stage).model.family)
    directory = start.directory
    if not directory.is_dir():
        raise _directory_problem(start, "an existing model directory")
    try:
        if start.source == "export":
            recorded = read_export_config(directory).get("family")
            if recorded != family.name:
                raise _directory_problem(start, f"an export of a {family.name} model; {directory} holds a "
                                                f"{recorded!r} model")
        return family.config_from_directory(directory)
    except SpecError:
        raise
    except RunyardError as exc:
        raise _directory_problem(start, f"a model directory runyard can start from: {exc}") from None


def stage_config(spec: JobSpec, stage_name: str, vocab_size: int | None = None, **data_facts: Any) -> Any:
    """The model config stage `stage_name` trains: from its spec alone (random start; `vocab_size`: the
    tokenizer's, or for images the `data_facts` train/batches.py reads from the prepared data), or its
    initial weights' config merged with its spec. SpecError naming each field the spec contradicts."""
    stage = resolved_stage(spec, stage_name)
    family = get_family(stage.model.family)
    start = stage_start(spec, stage_name)
    if start.source == "random":
        facts = data_facts if vocab_size is None else {"vocab_size": vocab_size, **data_facts}
        return family.config_from_spec(stage.model, **facts)
    if start.source == "stage":
        weights = stage_config(spec, start.from_stage, vocab_size, **data_facts)
        origin = f"stage {start.from_stage!r}'s model"
    else:
        weights = directory_config(spec, start)
        origin = f"{start.directory}/config.json"
    try:
        return family.config_from_weights(stage.model, weights)
    except ConfigContradiction as exc:
        where = f"stages[{stage.index}].model" if spec.stages[stage.index].model else "model"
        raise SpecError(SPEC_SOURCE, [
            (f"{where}.{name}", mine, _contradiction(name, theirs, origin)) for name, mine, theirs in exc.fields
        ]) from None


def _contradiction(name: str, theirs: Any, origin: str) -> str:
    hf_name = HF_FIELDS.get(name, name)
    if name == "context_length":
        return (f"at most the context of the weights it starts from: {origin} has {hf_name} = {theirs} "
                f"{reference_hint('model.context_length')}")
    return (f"what the weights it starts from have, {origin}: {hf_name} = {theirs!r}; set it to that or "
            f"leave it null {reference_hint('model.' + name)}")


def directory_starts(spec: JobSpec) -> list[StageStart]:
    """The stages that start from a model directory (an export or a Hugging Face model)."""
    return [s for s in (stage_start(spec, st.name) for st in spec.stages) if s.directory is not None]


def check_directory_weights(spec: JobSpec, start: StageStart, weights: Any) -> None:
    """The stage's init directory holds whole weights for `weights` (its config), from the files'
    headers alone; SpecError naming the file otherwise."""
    family = get_family(resolved_stage(spec, start.stage).model.family)
    try:
        family.check_directory(start.directory, weights)
    except RunyardError as exc:
        raise _directory_problem(start, f"a model directory runyard can start from: {exc}") from None


def weights_origin(spec: JobSpec, stage_name: str) -> Path | None:
    """The model directory stage `stage_name`'s weights come from, through the stages it continues; None
    when they begin as random weights."""
    start = stage_start(spec, stage_name)
    while start.source == "stage":
        start = stage_start(spec, start.from_stage)
    return start.directory

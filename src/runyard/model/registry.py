"""The model family registry: each family names its config, builder, sizing, export and loader, and
the rest of runyard (the training loop, `plan`, export and serving) asks here instead of naming a model.

A family is a `ModelFamily`. Families trained by runyard's torch loop (the decoder today; an image CNN
next) also say how to build the model from its config, group its parameters for the optimizer and which
modules FSDP shards one by one. A family trained some other way (gradient-boosted trees fit through their
own library) implements the same config, sizing, export and load, and leaves the loop's methods to raise
`NotTrainedByLoop`; the run dispatches on `trains_with_loop`.

Adding a family: subclass `ModelFamily`, `register()` it where runyard.model imports families
(model/__init__.py), and add its name to the spec's `model.family` choices (spec/sections.py). A family
whose module needs an optional extra (LightGBM, scikit-learn: `runyard[predict]`) is named with
`register_lazy(name, module)` instead: its module is imported the first time `get_family` asks for it, so
a language-model run never pays for (or needs) those libraries, and a missing extra is an error that says
what to install.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from runyard.errors import RunyardError


class UnknownFamily(RunyardError):
    """A spec or an export names a model family this runyard does not have."""


class ExportError(RunyardError):
    """An export directory is missing a file, fails its checksums, or does not match its config."""


class FamilyUnavailable(RunyardError):
    """A registered family's module cannot be imported here (its optional extra is not installed)."""


class NotTrainedByLoop(RunyardError):
    """A family that is not trained by the torch training loop was asked for a loop-only part."""


class NoInitFromWeights(RunyardError):
    """A spec's `model.init` asks a family that cannot start from a model directory to do so."""


@dataclass(frozen=True)
class Sizing:
    """What a model of a given config costs, from its shape alone.

    `flops_per_unit` counts training FLOPs (forward and backward) per `unit` of data: a token for a
    language model, a sample for an image one; for a family not trained by the loop (trees), the whole
    fit's FLOPs per training row. `activation_bytes` estimates the activations one micro-batch keeps for
    backward. `inference_flops_per_unit` is one prediction's FLOPs per unit; None means a forward pass,
    a third of training's (forward 2, backward 4 FLOPs per weight). `cache_bytes_per_unit` is what serving
    keeps per unit in flight (a decoder's KV cache per token, in bf16); 0 for a model without one.
    `recomputable_units` blocks (the family's `checkpoint_units`) each keep `unit_activation_bytes` of those
    activations, or only `unit_input_bytes` (their input) when they are recomputed in backward."""

    parameters: int
    non_embedding_parameters: int
    flops_per_unit: float
    unit: str
    activation_bytes: int
    inference_flops_per_unit: float | None = None
    cache_bytes_per_unit: int = 0
    recomputable_units: int = 0
    unit_activation_bytes: int = 0
    unit_input_bytes: int = 0

    def activation_bytes_with(self, recomputed_units: int) -> int:
        """The activations one micro-batch keeps when `recomputed_units` blocks are recomputed in backward:
        each keeps only its input, and one block's activations are live again while it is recomputed."""
        n = max(0, min(recomputed_units, self.recomputable_units))
        if n == 0:
            return self.activation_bytes
        return self.activation_bytes - n * (self.unit_activation_bytes - self.unit_input_bytes) + self.unit_activation_bytes

    @property
    def forward_flops_per_unit(self) -> float:
        """FLOPs of one prediction per unit of data."""
        if self.inference_flops_per_unit is not None:
            return self.inference_flops_per_unit
        return self.flops_per_unit / 3


@dataclass(frozen=True)
class TensorParallelPlan:
    """How a family's model splits over a tensor-parallel mesh (torchtitan's per-model plan), applied from
    outside the model by train/tensor_parallel.py.

    `styles`: submodule path -> "colwise" (output features split: Q/K/V, the MLP's gate and up) or
    "rowwise" (input features split, outputs summed: the attention output, the MLP's down projection).
    `fused_rows`: parameter path -> sizes of the parts its rows concatenate (a fused Q/K/V matrix), so each
    rank's rows hold its share of every part. `local_attributes`: "module.attr" -> the value each rank's
    module holds (its share of the heads)."""

    styles: dict[str, str]
    fused_rows: dict[str, tuple[int, ...]]
    local_attributes: dict[str, int]


class NoTensorParallelPlan(RunyardError):
    """A layout asks for tensor parallelism that the model family (or this model's shape) does not allow."""


class NoPipelinePlan(RunyardError):
    """A layout asks for pipeline stages that the model family (or this model's shape) cannot be split into."""


class ModelFamily(ABC):
    """One kind of model. Configs are the family's own frozen dataclasses (with to_dict/from_dict)."""

    name: ClassVar[str]
    trains_with_loop: ClassVar[bool] = True
    tasks: ClassVar[tuple[str, ...]] = ()  # the spec's tasks this family can train (model/choice.py recommends by it)
    # The fewest rows (table rows, images, documents) for which this family is the recommendation; among
    # families that suit a task, the one wanting the most rows the data has is chosen (model/choice.py).
    min_rows: ClassVar[int] = 0
    # Why this family suits data it is recommended for, in words (a run's manifest and `plan` show it).
    why_recommended: ClassVar[str] = ""

    # -- config ----------------------------------------------------------------------------------------
    @abstractmethod
    def config_from_spec(self, spec: Any, **data_facts: Any) -> Any:
        """The resolved config from the spec's `model` section and what the prepared data tells (for a
        language model, `vocab_size`: the tokenizer's)."""

    @abstractmethod
    def config_from_dict(self, data: dict[str, Any]) -> Any:
        """Rebuild a config from `config_to_dict` output; ValueError naming bad keys."""

    def config_to_dict(self, config: Any) -> dict[str, Any]:
        return config.to_dict()

    # -- size ------------------------------------------------------------------------------------------
    @abstractmethod
    def sizing(self, config: Any, micro_batch: int = 1) -> Sizing:
        """Parameters, FLOPs and activation memory of a model of this config."""

    def units_per_example(self, config: Any) -> int:
        """Units of `Sizing.unit` in one training example, which are also the targets the loss scores per
        example: a language model's sequence has one per token of its context, a classifier's sample one."""
        return 1

    # -- training through the loop ---------------------------------------------------------------------
    def build(self, config: Any) -> torch.nn.Module:
        """A freshly initialised model (deterministic given the torch seed)."""
        raise NotTrainedByLoop(f"model family {self.name!r} is not built for the torch training loop")

    def optimizer_groups(self, model: torch.nn.Module, optim: Any) -> list[dict[str, Any]]:
        """AdamW parameter groups for the spec's `optim` section (which parameters decay)."""
        raise NotTrainedByLoop(f"model family {self.name!r} is not trained by the torch training loop")

    def shard_units(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The submodules FSDP shards one by one (the root is sharded after them)."""
        return []

    def tensor_parallel_plan(self, model: torch.nn.Module, tp: int) -> TensorParallelPlan:
        """How the model splits over `tp` processes; NoTensorParallelPlan naming why it cannot."""
        raise NoTensorParallelPlan(f"model family {self.name!r} has no tensor-parallel plan; use resources.parallel: "
                                   "ddp or fsdp")

    def pipeline_stage(self, model: torch.nn.Module, stage: int, stages: int) -> torch.nn.Module:
        """The part of `model` that pipeline stage `stage` (0-based, of `stages`) runs, sharing `model`'s
        parameters and keeping their names (so a checkpoint is the same whatever the layout): the first
        stage takes the model's input, the last returns its output (what the loss scores); each other
        stage maps one activation tensor to the next. NoPipelinePlan naming why it cannot be split."""
        raise NoPipelinePlan(f"model family {self.name!r} has no pipeline plan; use resources.parallel: ddp or fsdp")

    def checkpoint_units(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The submodules whose activations `train.activation_checkpointing` recomputes in backward, in
        order (a decoder's blocks), and which `resources.compile` compiles one by one; by default the
        FSDP units. Each must be called with its inputs only (no state carried between calls)."""
        return self.shard_units(model)

    # -- starting from existing weights (`model.init`) ------------------------------------------------
    def config_from_weights(self, spec: Any, weights_config: Any) -> Any:
        """The config of a stage that starts from weights of `weights_config`, with the spec's training
        settings; the family's ConfigContradiction naming each shape field the spec sets otherwise."""
        raise NoInitFromWeights(f"model family {self.name!r} cannot start from existing weights")

    def config_from_directory(self, directory: Path) -> Any:
        """The config of the model held by a model directory (an export, or the ecosystem's format)."""
        raise NoInitFromWeights(f"model family {self.name!r} cannot start from a model directory")

    def check_directory(self, directory: Path, config: Any) -> None:
        """Check, without loading it, that a model directory holds whole weights for `config` (from
        `config_from_directory`): the family's error naming the file otherwise. By default nothing more
        is checked than `config_from_directory` did."""
        return None

    def load_directory_into(self, model: torch.nn.Module, directory: Path) -> None:
        """Copy a model directory's weights into `model` (built from `config_from_directory`), in place."""
        raise NoInitFromWeights(f"model family {self.name!r} cannot start from a model directory")

    def synthetic_batch(
        self, config: Any, micro_batch: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Random (inputs, targets) of one micro-batch's real shapes, for `plan`'s calibration (a few real
        training steps); targets are class indices over the model's last output dimension. None: this
        family is not calibrated by steps, and `plan` estimates its time from FLOPs."""
        return None

    # -- export and load -------------------------------------------------------------------------------
    @abstractmethod
    def export_files(self, model: Any, config: Any, directory: Path, *, metadata: dict[str, Any] | None = None
                     ) -> list[str]:
        """Write the model's own files (config and weights, in the ecosystem's format where there is one)
        into `directory`; return their names. `metadata`: facts the caller knows that those files carry
        (a language model's special token ids; `source_config`, the config.json its weights came in with). The caller (model/hf/export.py) adds the tokenizer files
        and runyard.json with checksums, and commits the directory."""

    @abstractmethod
    def load_files(self, directory: Path, config: Any, device: str | torch.device = "cpu") -> Any:
        """The model from files `export_files` wrote, checked against `config`, in eval mode."""


DEFAULT_FAMILY = "decoder"  # what a spec's `model.family` and an export without one mean
_FAMILIES: dict[str, ModelFamily] = {}
# name -> (module that registers it when imported, the extra that module needs)
_LAZY: dict[str, tuple[str, str]] = {}


def register(family: ModelFamily) -> ModelFamily:
    if family.name in _FAMILIES or (family.name in _LAZY and _LAZY[family.name][0] != type(family).__module__):
        raise ValueError(f"model family {family.name!r} is registered twice")
    _FAMILIES[family.name] = family
    return family


def register_lazy(name: str, module: str, extra: str) -> None:
    """Name a family whose `module` registers it on import; the module is imported on first use."""
    if name in _FAMILIES or name in _LAZY:
        raise ValueError(f"model family {name!r} is registered twice")
    _LAZY[name] = (module, extra)


def get_family(name: str) -> ModelFamily:
    """The family registered under `name`; UnknownFamily naming the ones there are, FamilyUnavailable
    when its optional extra is not installed."""
    if name not in _FAMILIES and name in _LAZY:
        module, extra = _LAZY[name]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise FamilyUnavailable(
                f"model family {name!r} needs the optional extra {extra!r}: pip install 'runyard[{extra}]' ({exc})"
            ) from None
    try:
        return _FAMILIES[name]
    except KeyError:
        raise UnknownFamily(f"no model family {name!r}; runyard has {family_names()}") from None


def family_names() -> list[str]:
    return sorted(set(_FAMILIES) | set(_LAZY))

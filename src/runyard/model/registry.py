"""The model family registry: each family names its config, builder, sizing, export and loader, and
the rest of runyard (the training loop, `plan`, export and serving) asks here instead of naming a model.

A family is a `ModelFamily`. Families trained by runyard's torch loop (the decoder today; an image CNN
next) also say how to build the model from its config, group its parameters for the optimizer and which
modules FSDP shards one by one. A family trained some other way (gradient-boosted trees fit through their
own library) implements the same config, sizing, export and load, and leaves the loop's methods to raise
`NotTrainedByLoop`; the run dispatches on `trains_with_loop`.

Adding a family: subclass `ModelFamily`, `register()` it where runyard.model imports families
(model/__init__.py), and add its name to the spec's `model.family` choices (spec.py).
"""

from __future__ import annotations

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


class NotTrainedByLoop(RunyardError):
    """A family that is not trained by the torch training loop was asked for a loop-only part."""


@dataclass(frozen=True)
class Sizing:
    """What a model of a given config costs, from its shape alone.

    `flops_per_unit` counts training FLOPs (forward and backward) per `unit` of data: a token for a
    language model, a sample for an image one; for a family not trained by the loop (trees), the whole
    fit's FLOPs per training row. `activation_bytes` estimates the activations one micro-batch keeps for
    backward. `inference_flops_per_unit` is one prediction's FLOPs per unit; None means a forward pass,
    a third of training's (forward 2, backward 4 FLOPs per weight). `cache_bytes_per_unit` is what serving
    keeps per unit in flight (a decoder's KV cache per token, in bf16); 0 for a model without one."""

    parameters: int
    non_embedding_parameters: int
    flops_per_unit: float
    unit: str
    activation_bytes: int
    inference_flops_per_unit: float | None = None
    cache_bytes_per_unit: int = 0

    @property
    def forward_flops_per_unit(self) -> float:
        """FLOPs of one prediction per unit of data."""
        if self.inference_flops_per_unit is not None:
            return self.inference_flops_per_unit
        return self.flops_per_unit / 3


class ModelFamily(ABC):
    """One kind of model. Configs are the family's own frozen dataclasses (with to_dict/from_dict)."""

    name: ClassVar[str]
    trains_with_loop: ClassVar[bool] = True
    tasks: ClassVar[tuple[str, ...]] = ()  # the spec's tasks this family can train (`plan` recommends by it)

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
        """Units of `Sizing.unit` in one training example (a sequence's tokens for a language model)."""
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

    def synthetic_batch(
        self, config: Any, micro_batch: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Random (inputs, targets) of one micro-batch's real shapes, for `plan`'s calibration (a few real
        training steps); targets are class indices over the model's last output dimension. None: this
        family is not calibrated by steps, and `plan` estimates its time from FLOPs."""
        return None

    # -- export and load -------------------------------------------------------------------------------
    @abstractmethod
    def export_files(self, model: Any, config: Any, directory: Path) -> list[str]:
        """Write the model's own files (weights, ...) into `directory`; return their names. The caller
        (serve/export.py) adds the tokenizer and config.json with checksums and commits the directory."""

    @abstractmethod
    def load_files(self, directory: Path, config: Any, device: str | torch.device = "cpu") -> Any:
        """The model from files `export_files` wrote, checked against `config`, in eval mode."""


DEFAULT_FAMILY = "decoder"  # what a spec's `model.family` and an export without one mean
_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is registered twice")
    _FAMILIES[family.name] = family
    return family


def get_family(name: str) -> ModelFamily:
    """The family registered under `name`; UnknownFamily naming the ones there are."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise UnknownFamily(f"no model family {name!r}; runyard has {sorted(_FAMILIES)}") from None


def family_names() -> list[str]:
    return sorted(_FAMILIES)

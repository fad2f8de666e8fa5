"""A model family for tests of the family rule: it names its tasks, whether the loop trains it (`deep`)
and the fewest rows it is recommended for, and does nothing else."""

from __future__ import annotations

from typing import Any

import torch

from runyard.model.registry import ModelFamily, Sizing


class ToyFamily(ModelFamily):
    def __init__(self, name: str, tasks: tuple[str, ...], deep: bool, min_rows: int = 0):
        self.name, self.tasks, self.trains_with_loop, self.min_rows = name, tasks, deep, min_rows

    def config_from_spec(self, spec: Any, **facts: Any) -> Any:
        return facts

    def config_from_dict(self, data: dict[str, Any]) -> Any:
        return data

    def sizing(self, config: Any, micro_batch: int = 1) -> Sizing:
        return Sizing(10, 10, 60.0, "row", 0)

    def export_files(self, model, config, directory):
        return []

    def load_files(self, directory, config, device="cpu"):
        return torch.nn.Identity()

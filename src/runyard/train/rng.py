"""Seeding and capturing every source of randomness, so a resumed run draws the same numbers."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def capture_rng() -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, json_state): torch CPU/CUDA states as tensors, Python and numpy states as JSON."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = state
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    json_state = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_kind, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
    }
    return tensors, json_state


def restore_rng(tensors: dict[str, torch.Tensor], json_state: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])
    py_version, py_state, py_gauss = json_state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    kind, keys, pos, has_gauss, gauss = json_state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


class ProcessRNG:
    """This process's random number generators (torch CPU and CUDA, Python, numpy) as one stateful
    component: `state_dict()` holds the torch states as tensors and the others as plain values."""

    def state_dict(self) -> dict[str, Any]:
        tensors, json_state = capture_rng()
        return {**tensors, **json_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng({k: v for k, v in state.items() if isinstance(v, torch.Tensor)},
                    {"python": state["python"], "numpy": state["numpy"]})

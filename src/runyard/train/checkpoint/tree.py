"""A nested state dict as flat tensors plus a JSON skeleton, so it can be stored without pickle.

An optimizer's state dict is a tree: `{"state": {0: {"step": tensor, "exp_avg": tensor, ...}},
"param_groups": [{"lr": 0.001, "betas": (0.9, 0.95), "params": [0, 1], ...}]}`. `flatten` takes the
tensors out (named by their path, e.g. `state.0.exp_avg`) and leaves a JSON skeleton in which each
tensor is `{"$tensor": name}`; `unflatten` puts them back. What JSON cannot say directly is tagged,
so the tree comes back with the same types: tuples (`{"$tuple": [...]}`) and dictionaries whose keys
are not plain strings (`{"$items": [[key, value], ...]}`, e.g. the optimizer's integer parameter ids).

A tensor that appears twice (a tied embedding and output head share one) is stored once; both places
refer to it. Anything else (an arbitrary object) is refused with the path where it was found.
"""

from __future__ import annotations

from typing import Any

import torch

from runyard.errors import CheckpointCorrupt

TENSOR, TUPLE, ITEMS = "$tensor", "$tuple", "$items"
_SCALARS = (str, int, float, bool, type(None))


class UnstorableState(TypeError):
    """A state dict holds a value that is neither a tensor nor plain data (str, number, bool, None,
    list, tuple, dict)."""


def _identity(t: torch.Tensor) -> tuple:
    """Two tensors with the same identity are the same values in the same memory."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())


def flatten(tree: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """(tensors by name, JSON-able skeleton). A state dict of tensors keyed by name (a model's) keeps
    those names, so its file reads as an ordinary state dict."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}

    def name_for(path: list[str]) -> str:
        name = ".".join(path) or "tensor"
        candidate, n = name, 1
        while candidate in tensors:  # {"a": {"b": t}} and {"a.b": t} would collide
            candidate, n = f"{name}#{n}", n + 1
        return candidate

    def walk(node: Any, path: list[str]) -> Any:
        if isinstance(node, torch.Tensor):
            key = _identity(node)
            if key not in seen:
                seen[key] = name_for(path)
                tensors[seen[key]] = node
            return {TENSOR: seen[key]}
        if isinstance(node, _SCALARS):
            return node
        if isinstance(node, tuple):
            return {TUPLE: [walk(v, [*path, str(i)]) for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [walk(v, [*path, str(i)]) for i, v in enumerate(node)]
        if isinstance(node, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in node):
                return {k: walk(v, [*path, k]) for k, v in node.items()}
            for k in node:
                if not isinstance(k, _SCALARS):
                    raise UnstorableState(f"state at {'.'.join(path) or '(root)'}: a key of type {type(k).__name__}")
            return {ITEMS: [[k, walk(v, [*path, str(k)])] for k, v in node.items()]}
        raise UnstorableState(
            f"state at {'.'.join(path) or '(root)'} is a {type(node).__name__}: a checkpoint stores tensors "
            "and plain data (str, int, float, bool, None, list, tuple, dict) only"
        )

    return tensors, walk(tree, [])


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor], where: str = "checkpoint") -> Any:
    """The tree `flatten` took apart. A skeleton naming a tensor the file lacks is CheckpointCorrupt."""

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        if TENSOR in node:
            if node[TENSOR] not in tensors:
                raise CheckpointCorrupt(f"{where}: its structure names tensor {node[TENSOR]!r}, which it does not hold")
            return tensors[node[TENSOR]]
        if TUPLE in node:
            return tuple(walk(v) for v in node[TUPLE])
        if ITEMS in node:
            return {k: walk(v) for k, v in node[ITEMS]}
        return {k: walk(v) for k, v in node.items()}

    return walk(skeleton)


def has_tensors(skeleton: Any) -> bool:
    if isinstance(skeleton, list):
        return any(has_tensors(v) for v in skeleton)
    if isinstance(skeleton, dict):
        return TENSOR in skeleton or any(has_tensors(v) for v in skeleton.values())
    return False

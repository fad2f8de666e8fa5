"""Field paths of a spec: how a validation error's location is written (`stages[0].train.steps`), the
user's own value at it, and the anchor of the field's entry in the spec reference (docs/spec.md).

Pure functions of a root pydantic model class; `runyard.spec.job` binds them to `JobSpec`.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from pydantic import BaseModel


def loc_to_path(loc: tuple[Any, ...]) -> str:
    """('stages', 0, 'train', 'steps') -> 'stages[0].train.steps'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + str(part)
    return path or "(top level)"


def path_to_loc(path: str) -> tuple[str, ...]:
    """'data.sources[0].path' -> ('data', 'sources', 'path'): the names only, list indices dropped."""
    return tuple(p for p in re.split(r"\.|\[\d+\]", path) if p)


def lookup(raw: Any, loc: tuple[Any, ...]) -> tuple[bool, Any]:
    """The user's own value at `loc`, so messages quote what they wrote rather than a merged default."""
    node = raw
    for part in loc:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, node


def field_model(annotation: Any) -> type[BaseModel] | None:
    """The model class a field holds (directly, in a list, or optional), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = field_model(arg)
        if found is not None:
            return found
    return None


def resolve_loc(
    root: type[BaseModel], loc: tuple[Any, ...], aliases: dict[str, tuple[str, ...]] | None = None
) -> tuple[list[str], type[BaseModel] | None, str | None]:
    """Walk `loc` down `root`'s fields: (the field names found, the model of the deepest section
    reached, the first name that is not a field there, or None). `aliases` maps a path prefix to the
    one it stands for (a stage's free-form `model` overrides are the top-level `model`'s fields)."""
    names = tuple(p for p in loc if not isinstance(p, int))
    for prefix, target in (aliases or {}).items():
        head = tuple(prefix.split("."))
        if names[: len(head)] == head:
            names = target + names[len(head) :]
            break
    known: list[str] = []
    model: type[BaseModel] | None = root
    for name in names:
        if model is None:
            break
        field = model.model_fields.get(name)
        if field is None:
            return known, model, name
        known.append(name)
        model = field_model(field.annotation)
    return known, model, None


def anchor(root: type[BaseModel], loc: tuple[Any, ...], aliases: dict[str, tuple[str, ...]] | None = None) -> str:
    """The reference anchor of the field at `loc`: its dotted path without list indices; an unknown
    key points at its section, the top level at `top`."""
    known, _model, _unknown = resolve_loc(root, loc, aliases)
    return ".".join(known) or "top"


def unknown_key_message(
    root: type[BaseModel], loc: tuple[Any, ...], aliases: dict[str, tuple[str, ...]] | None = None
) -> str:
    """'unknown key', with the closest field name of its section when one is close."""
    _known, model, unknown = resolve_loc(root, loc, aliases)
    if model is not None and unknown is not None:
        close = difflib.get_close_matches(unknown, list(model.model_fields), n=1, cutoff=0.6)
        if close:
            return f"unknown key (did you mean {close[0]!r}?)"
    return "unknown key"

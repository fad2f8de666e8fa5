"""Instruction and preference records from their sources: JSONL, Parquet, or Python files whose
documented functions become (signature and docstring -> body) pairs.

A record is a conversation: `messages` (system first if any, then user and assistant alternating, ending
with the assistant), and for preference data the last assistant turn comes in two versions, `chosen` and
`rejected`. A record whose structure is wrong (a role out of order, an unknown role, a field of the wrong
type) stops the data stage with an error naming the file, the line or row, and the field; a record that
is well formed but unusable (an empty response) is counted and left out.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import textwrap
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from runyard.data.sources import InputFile, read_bytes
from runyard.errors import DataError
from runyard.spec.data_instruct import InstructSourceSpec

ROLES = ("system", "user", "assistant")


@dataclass
class Record:
    """One conversation. `rejected` is set for preference data: the alternative last assistant turn."""

    id: str
    group: str | None
    messages: list[dict[str, str]]
    rejected: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class RecordError(DataError):
    """A record whose structure is wrong; the message names the file, the line or row, and the field."""


def _check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RecordError(f"{where}: field `messages` must be a non-empty list of {{role, content}}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RecordError(f"{where}: `messages[{i}]` must be an object with string `role` and `content`")
        if m["role"] not in ROLES:
            raise RecordError(f"{where}: `messages[{i}].role` is {m['role']!r}; roles are {list(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    body = out[1:] if out[0]["role"] == "system" else out
    for i, m in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            index = i + (len(out) - len(body))
            raise RecordError(
                f"{where}: `messages[{index}].role` is {m['role']!r} where {expected!r} was expected (roles out "
                "of order: an optional system message, then user and assistant alternating)"
            )
    if not body or body[-1]["role"] != "assistant":
        raise RecordError(f"{where}: `messages` must end with an assistant message (the response to learn)")
    return out


def _string(record: dict, name: str, where: str, required: bool = True) -> str | None:
    value = record.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise RecordError(f"{where}: field `{name}` must be a string, got {type(value).__name__}")
    return value


def record_from_mapping(raw: Any, rid: str, preference: bool, group_field: str | None) -> Record:
    """A Record from one JSON object / Parquet row (`rid` names its file and line or row)."""
    if not isinstance(raw, dict):
        raise RecordError(f"{rid}: a record must be an object, got {type(raw).__name__}")
    group = None
    if group_field is not None:
        if group_field not in raw:
            raise RecordError(f"{rid}: field `{group_field}` (group_field) is missing")
        group = str(raw[group_field])
    system = _string(raw, "system", rid, required=False)
    head = [{"role": "system", "content": system}] if system is not None else []
    if preference:
        meta = {}
        if "messages" in raw:
            prompt = _check_messages(raw["messages"] + [{"role": "assistant", "content": ""}], rid)[:-1]
        else:
            prompt = head + [{"role": "user", "content": _string(raw, "prompt", rid)}]
            meta["format"] = "prompt_response"
        chosen, rejected = _string(raw, "chosen", rid), _string(raw, "rejected", rid)
        return Record(rid, group, prompt + [{"role": "assistant", "content": chosen}], rejected=rejected, meta=meta)
    if "messages" in raw:
        return Record(rid, group, _check_messages(raw["messages"], rid))
    if "prompt" not in raw or "response" not in raw:
        raise RecordError(f"{rid}: a record needs `messages`, or `prompt` and `response`; it has {sorted(raw)[:8]}")
    messages = head + [
        {"role": "user", "content": _string(raw, "prompt", rid)},
        {"role": "assistant", "content": _string(raw, "response", rid)},
    ]
    return Record(rid, group, messages, meta={"format": "prompt_response"})


def _jsonl_records(path: str, data: bytes) -> Iterator[tuple[str, Any]]:
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RecordError(f"{path}:{lineno}: not a JSON object ({exc})") from None


def _parquet_records(path: str, data: bytes) -> Iterator[tuple[str, Any]]:
    try:
        table = pq.read_table(pa.BufferReader(data))
    except pa.ArrowException as exc:
        raise RecordError(f"{path}: not a readable Parquet file: {exc}") from None
    for row, record in enumerate(table.to_pylist()):
        yield f"{path}#row{row}", record


def python_function_records(path: str, text: str, module: str, source: InstructSourceSpec,
                            counts: Counter) -> Iterator[Record]:
    """One record per function with a docstring: the prompt is its signature and docstring, the response
    its body (both dedented); functions without a docstring, or with a body outside the spec's bounds,
    are counted and skipped."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        counts["files_not_parsed"] += 1
        return
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        counts["functions_seen"] += 1
        doc = node.body[0] if node.body else None
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            counts["functions_without_docstring"] += 1
            continue
        if len(node.body) < 2:
            counts["functions_without_body"] += 1
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        body_start, body_end = node.body[1].lineno - 1, node.end_lineno
        n_body = body_end - body_start
        if not source.min_body_lines <= n_body <= source.max_body_lines:
            counts["functions_outside_body_bounds"] += 1
            continue
        block = textwrap.dedent("\n".join(lines[start:body_end]))
        block_lines = block.splitlines()
        split = body_start - start
        prompt = "\n".join(block_lines[:split])
        response = "\n".join(block_lines[split:]) + "\n"
        yield Record(
            id=f"{path}:{node.lineno}:{node.name}",
            group=module,
            messages=[{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
            meta={"format": "python_functions"},
        )


def preference_pairs(records: list[Record], rejected: str, counts: Counter) -> Iterator[Record]:
    """Preference records from one module's functions: chosen, a function's own body; rejected, by the
    `rejected` policy (see InstructSourceSpec.rejected). A function left without a distinct rejected
    body is counted and skipped."""
    make = _REJECTED_BODY[rejected]
    for i, record in enumerate(records):
        chosen = record.messages[-1]["content"]
        rival = make(records, i)
        if rival is None or rival == chosen:
            counts["functions_without_a_rival"] += 1
            continue
        yield Record(record.id, record.group, record.messages, rejected=rival, meta=record.meta)


def _next_function_body(records: list[Record], i: int) -> str | None:
    """The body of the module's next function, in source order, cyclically: code of the same style and
    vocabulary that does not implement this signature and docstring."""
    return records[(i + 1) % len(records)].messages[-1]["content"] if len(records) > 1 else None


def _shuffled_body(records: list[Record], i: int) -> str | None:
    """Function i's body with its lines permuted: seeded by the function's id (so the same on every
    machine and run), rotated by one line when the shuffle happens to leave the order as it was."""
    lines = records[i].messages[-1]["content"].splitlines(keepends=True)
    order = list(range(len(lines)))
    random.Random(hashlib.sha256(records[i].id.encode()).digest()).shuffle(order)
    if order == sorted(order):
        order = order[1:] + order[:1]
    return "".join(lines[j] for j in order)


# InstructSourceSpec.rejected -> how a function's rejected body is made
_REJECTED_BODY = {"next_function": _next_function_body, "shuffled_lines": _shuffled_body}


def iter_records(source: InstructSourceSpec, file: InputFile, base: str, preference: bool,
                 counts: Counter) -> Iterator[Record]:
    """Every record of one file of `source` (`base`: the source's fixed directory, so groups and ids
    do not depend on where the files sit)."""
    data = read_bytes(file.path)
    counts["files"] += 1
    counts["bytes_read"] += len(data)
    rel = os.path.relpath(file.path, base) if base else file.path
    if source.format == "python_functions":
        text = data.decode("utf-8", errors="replace")
        module = rel.removesuffix(".py").replace(os.sep, ".").removesuffix(".__init__")
        records = python_function_records(rel, text, module, source, counts)
        yield from (preference_pairs(list(records), source.rejected, counts) if preference else records)
        return
    raw = _jsonl_records(rel, data) if source.format == "jsonl" else _parquet_records(rel, data)
    for rid, item in raw:
        yield record_from_mapping(item, rid, preference, source.group_field)

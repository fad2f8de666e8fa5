"""Instruction and preference records from their sources: JSONL, Parquet, or Python files whose
documented functions become (signature and docstring -> body) pairs.

A record is a conversation: `messages` (system first if any, then user and assistant alternating, ending
with the assistant), and for preference data the last assistant turn comes in two versions, `chosen` and
`rejected`. A record whose structure is wrong (a role out of order, an unknown role, a field of the wrong
type, a line that is not JSON) is a RecordError naming the file, the line or row, the field and what was
expected: `runyard plan` and `run` find every one before any work (instruct_check.py) and refuse them
(data.on_bad_record: error) or leave them out, counted by kind (skip); a record that is well formed but
unusable (an empty response, a chosen answer equal to the rejected one) is counted and left out.
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
from runyard.errors import EXIT_BAD_SPEC, DataError
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
    """A record whose structure is wrong: `where` names the file and the line or row, `field` the field,
    `expected` what it should hold, `problem` the kind of problem (counted by kind under
    on_bad_record: skip)."""

    def __init__(self, where: str, field: str, expected: str, problem: str):
        super().__init__(f"{where}: {field}: {expected}")
        self.where, self.field, self.expected, self.problem = where, field, expected, problem


class BadRecords(DataError):
    """Records that cannot be used, found before any work (data.on_bad_record: error): every one is
    counted, the first `shown` listed with file:line, field and what was expected."""

    exit_code = EXIT_BAD_SPEC

    def __init__(self, where: str, bad: list[RecordError], total: int, shown: int = 20):
        kinds = Counter(b.problem for b in bad)
        lines = [f"{where}: {total:,} bad record{'s' if total != 1 else ''} ("
                 + ", ".join(f"{k} {v:,}" for k, v in sorted(kinds.items()))
                 + "); set data.on_bad_record: skip to leave them out (counted in the data report):"]
        lines += [f"  {b.where}: {b.field}: {b.expected}" for b in bad[:shown]]
        if total > shown:
            lines.append(f"  ... and {total - shown:,} more")
        super().__init__("\n".join(lines))
        self.bad, self.total = bad, total


# What the pre-pass keeps of the bad records it finds (it counts them all).
KEEP_BAD = 1000


def _check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RecordError(where, "messages", "a non-empty list of {role, content}", "no_messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RecordError(where, f"messages[{i}]", f"an object with string `role` and `content`, got "
                              f"{type(m).__name__}", "bad_message")
        for name in ("role", "content"):
            if not isinstance(m.get(name), str):
                got = "nothing" if name not in m else type(m[name]).__name__
                raise RecordError(where, f"messages[{i}].{name}", f"a string, got {got}", "not_a_string")
        if m["role"] not in ROLES:
            raise RecordError(where, f"messages[{i}].role", f"one of {list(ROLES)}, got {m['role']!r}",
                              "unknown_role")
        out.append({"role": m["role"], "content": m["content"]})
    body = out[1:] if out[0]["role"] == "system" else out
    for i, m in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            index = i + (len(out) - len(body))
            raise RecordError(where, f"messages[{index}].role", f"{expected!r} (roles out of order: an optional "
                              f"system message, then user and assistant alternating), got {m['role']!r}",
                              "roles_out_of_order")
    if not body or body[-1]["role"] != "assistant":
        raise RecordError(where, "messages", "to end with an assistant message (the response to learn)",
                          "no_response")
    return out


def _string(record: dict, name: str, where: str, required: bool = True) -> str | None:
    value = record.get(name)
    if value is None and not required:
        return None
    if name not in record:
        raise RecordError(where, name, "a string; the field is missing", "missing_field")
    if not isinstance(value, str):
        raise RecordError(where, name, f"a string, got {type(value).__name__}", "not_a_string")
    return value


def record_from_mapping(raw: Any, rid: str, preference: bool, group_field: str | None) -> Record:
    """A Record from one JSON object / Parquet row (`rid` names its file and line or row); RecordError
    names the field and what it should hold when the record is malformed."""
    if not isinstance(raw, dict):
        raise RecordError(rid, "(record)", f"an object, got {type(raw).__name__}", "not_an_object")
    group = None
    if group_field is not None:
        if group_field not in raw:
            raise RecordError(rid, group_field, "a value (data.sources[].group_field); the field is missing",
                              "missing_field")
        group = str(raw[group_field])
    system = _string(raw, "system", rid, required=False)
    head = [{"role": "system", "content": system}] if system is not None else []
    if preference:
        meta = {}
        if "messages" in raw:
            if not isinstance(raw["messages"], list):
                raise RecordError(rid, "messages", "a list of {role, content} (the prompt)", "no_messages")
            prompt = _check_messages(raw["messages"] + [{"role": "assistant", "content": ""}], rid)[:-1]
        elif "prompt" in raw:
            prompt = head + [{"role": "user", "content": _string(raw, "prompt", rid)}]
            meta["format"] = "prompt_response"
        else:
            raise RecordError(rid, "prompt", f"a preference record needs `prompt` (or `messages`), `chosen` and "
                              f"`rejected`; it has {sorted(raw)[:8]}", "no_messages")
        chosen, rejected = _string(raw, "chosen", rid), _string(raw, "rejected", rid)
        return Record(rid, group, prompt + [{"role": "assistant", "content": chosen}], rejected=rejected, meta=meta)
    if "messages" in raw:
        return Record(rid, group, _check_messages(raw["messages"], rid))
    if "prompt" not in raw or "response" not in raw:
        raise RecordError(rid, "messages", f"a record needs `messages`, or `prompt` and `response`; it has "
                          f"{sorted(raw)[:8]}", "no_messages")
    messages = head + [
        {"role": "user", "content": _string(raw, "prompt", rid)},
        {"role": "assistant", "content": _string(raw, "response", rid)},
    ]
    return Record(rid, group, messages, meta={"format": "prompt_response"})


def raw_records(path: str, data: bytes, format: str) -> Iterator[tuple[str, Any]]:
    """(file:line or file#row, the parsed object) of every record of a JSONL or Parquet file; a line that
    is not JSON comes as its RecordError in place of the object, so a reader can go on past it."""
    return _jsonl_records(path, data) if format == "jsonl" else _parquet_records(path, data)


def _jsonl_records(path: str, data: bytes) -> Iterator[tuple[str, Any]]:
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            yield where, json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            yield where, RecordError(where, "(line)", f"a JSON object ({exc})", "malformed_json")


def _parquet_records(path: str, data: bytes) -> Iterator[tuple[str, Any]]:
    try:
        table = pq.read_table(pa.BufferReader(data))
    except pa.ArrowException as exc:
        raise DataError(f"{path}: not a readable Parquet file: {exc}") from None
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
                 counts: Counter) -> Iterator[Record | RecordError]:
    """Every record of one file of `source` (`base`: the source's fixed directory, so groups and ids
    do not depend on where the files sit); a malformed record comes as its RecordError, in its place."""
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
    for rid, item in raw_records(rel, data, source.format):
        if isinstance(item, RecordError):
            yield item
            continue
        try:
            yield record_from_mapping(item, rid, preference, source.group_field)
        except RecordError as bad:
            yield bad

"""The spec reference, generated from the spec's own pydantic models: a JSON Schema (so editors complete
and check a spec's YAML) and a Markdown page with one entry per field (type, bounds, default, meaning),
each under an anchor that is the field's dotted path (`data.filters.min_words`), which spec errors name.

`docs/spec.md` and `docs/spec.schema.json` are this module's output, committed; a test fails when they
differ from what the code generates, so a change to the spec must regenerate them:
`runyard spec reference --write-docs docs`.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_jsonable_python

from runyard.errors import EXIT_BAD_SPEC, RunyardError
from runyard.market.requirement import ACCELERATOR_KINDS
from runyard.spec.job import TASKS, JobSpec
from runyard.spec.paths import field_model, path_to_loc

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
MARKDOWN_FILE = "spec.md"
SCHEMA_FILE = "spec.schema.json"

# A stage's free-form overrides take the fields of these top-level sections.
_STAGE_OVERRIDES = ("model", "optim", "schedule", "train")


class UnknownSpecField(RunyardError):
    """`runyard spec reference FIELD` named a field the spec does not have."""

    exit_code = EXIT_BAD_SPEC


@dataclass(frozen=True)
class FieldEntry:
    name: str
    path: str  # dotted, no list indices: the anchor
    type_text: str
    default_text: str
    description: str
    section_link: str | None = None  # the anchor of the section this field opens, if it is one


@dataclass
class Section:
    path: str  # "" for the top level
    model: type[BaseModel]
    doc: str
    is_list: bool = False
    fields: list[FieldEntry] = field(default_factory=list)

    @property
    def anchor(self) -> str:
        return self.path or "top"

    @property
    def title(self) -> str:
        return f"`{self.path}`" if self.path else "Top level"


# --- JSON Schema ---------------------------------------------------------------------------------


def json_schema() -> dict[str, Any]:
    """The job spec's JSON Schema (draft 2020-12), for editors and other tools."""
    schema = JobSpec.model_json_schema()
    defs = schema["$defs"]
    stage = defs["StageSpec"]["properties"]
    for section in _STAGE_OVERRIDES:
        target = JobSpec.model_fields[section].annotation.__name__
        # A stage's overrides are a partial section: every field of one has a default, so the same
        # definition checks them (and forbids unknown keys).
        stage[section] = {"$ref": f"#/$defs/{target}", "description": stage[section]["description"]}
    defs["Requirement"]["properties"]["accelerator_kinds"]["items"]["enum"] = list(ACCELERATOR_KINDS)
    for model in _all_models():
        props = schema["properties"] if model is JobSpec else defs[model.__name__]["properties"]
        for name, info in model.model_fields.items():
            prop = props[name]
            prop.pop("title", None)
            default = info.get_default(call_default_factory=True)
            is_section = isinstance(default, BaseModel) or (
                isinstance(default, list) and default and isinstance(default[0], BaseModel)
            )
            if "default" not in prop and default is not PydanticUndefined and not is_section:
                prop["default"] = to_jsonable_python(default)
    # `data` may be left out (an sft/dpo-only spec), but where given it is a data section: validation says
    # when it is required, and an error inside it is then reported at its own path, not as "not null".
    top = schema["properties"]
    top["data"] = {"$ref": "#/$defs/DataSpec", "description": top["data"]["description"]}
    return {
        "$schema": SCHEMA_DIALECT,
        "title": "runyard job spec",
        "description": f"{_doc(JobSpec)} Reference: docs/{MARKDOWN_FILE}.",
        **{k: v for k, v in schema.items() if k not in ("title", "description")},
    }


def json_schema_text() -> str:
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


def _all_models() -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []

    def visit(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.append(model)
        for info in model.model_fields.values():
            sub = field_model(info.annotation)
            if sub is not None:
                visit(sub)

    visit(JobSpec)
    return seen


def _doc(model: type[BaseModel]) -> str:
    return " ".join(inspect.cleandoc(model.__doc__ or "").split())


# --- the sections and their fields ----------------------------------------------------------------


def sections() -> list[Section]:
    """Every section of the spec, top level first, each followed by its subsections (depth first)."""
    schema = json_schema()
    out: list[Section] = []

    def visit(path: str, model: type[BaseModel], props: dict[str, Any], is_list: bool) -> None:
        section = Section(path, model, _doc(model), is_list)
        out.append(section)
        children = []
        for name, info in model.model_fields.items():
            child_path = f"{path}.{name}" if path else name
            prop = props[name]
            sub = field_model(info.annotation)
            default = info.get_default(call_default_factory=True)
            if sub is not None:
                child_is_list = _is_array(prop, schema)
                section.fields.append(FieldEntry(
                    name, child_path, _section_type(prop, schema, child_is_list),
                    "required" if default is PydanticUndefined else _section_default(default),
                    info.description or "", section_link=child_path,
                ))
                children.append((child_path, sub, _def_of(sub, schema)["properties"], child_is_list))
                continue
            link = name if model.__name__ == "StageSpec" and name in _STAGE_OVERRIDES else None
            type_text = f"fields of [`{name}`](#{name})" if link else _type_text(prop, schema)
            section.fields.append(FieldEntry(
                name, child_path, type_text, _default_text(default), info.description or "", section_link=link
            ))
        for child in children:
            visit(*child)

    visit("", JobSpec, schema["properties"], False)
    return out


def _def_of(model: type[BaseModel], schema: dict[str, Any]) -> dict[str, Any]:
    return schema["$defs"][model.__name__]


def _deref(prop: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in prop:
        return schema["$defs"][prop["$ref"].rsplit("/", 1)[1]]
    return prop


def _is_array(prop: dict[str, Any], schema: dict[str, Any]) -> bool:
    return _deref(prop, schema).get("type") == "array"


def _section_type(prop: dict[str, Any], schema: dict[str, Any], is_list: bool) -> str:
    nullable = any(p.get("type") == "null" for p in prop.get("anyOf", []))
    text = "list of sections" if is_list else "section"
    if is_list and prop.get("minItems"):
        text += f", at least {prop['minItems']}"
    return text + (", or null" if nullable else "")


def _section_default(default: Any) -> str:
    if default is None:
        return "`null`"
    if isinstance(default, list):
        return f"{len(default)} item{'s' if len(default) != 1 else ''}" if default else "`[]`"
    return "its fields' defaults"


def _default_text(default: Any) -> str:
    if default is PydanticUndefined:
        return "required"
    value = to_jsonable_python(default.value if isinstance(default, Enum) else default)
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def _number(value: Any) -> str:
    if isinstance(value, int) and value >= 2**32 and (value & (value - 1)) == 0:
        return f"2^{value.bit_length() - 1}"
    return format(value, "g") if isinstance(value, float) else str(value)


def _bounds(prop: dict[str, Any]) -> str:
    lo = ("≥", prop["minimum"]) if "minimum" in prop else (">", prop["exclusiveMinimum"]) if "exclusiveMinimum" in prop else None
    hi = ("≤", prop["maximum"]) if "maximum" in prop else ("<", prop["exclusiveMaximum"]) if "exclusiveMaximum" in prop else None
    if lo and hi:
        left = "[" if lo[0] == "≥" else "("
        right = "]" if hi[0] == "≤" else ")"
        return f" in {left}{_number(lo[1])}, {_number(hi[1])}{right}"
    if lo:
        return f" {lo[0]} {_number(lo[1])}"
    if hi:
        return f" {hi[0]} {_number(hi[1])}"
    return ""


def _type_text(prop: dict[str, Any], schema: dict[str, Any]) -> str:
    """A JSON Schema fragment in words: `integer ≥ 1, or null`, `one of `cpu`, `cuda``..."""
    if "$ref" in prop:
        return _type_text(_deref(prop, schema), schema)
    if "anyOf" in prop:
        options = [p for p in prop["anyOf"] if p.get("type") != "null"]
        text = " or ".join(_type_text(p, schema) for p in options)
        return text + (", or null" if len(options) < len(prop["anyOf"]) else "")
    if "const" in prop:
        return f"`{prop['const']}`"
    if "enum" in prop:
        values = [f"`{v}`" for v in prop["enum"]]
        return values[0] if len(values) == 1 else "one of " + ", ".join(values)
    kind = prop.get("type")
    if kind in ("integer", "number"):
        return kind + _bounds(prop)
    if kind == "string":
        return "date-time (ISO 8601)" if prop.get("format") == "date-time" else "string"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        if "prefixItems" in prop:
            return "[" + ", ".join(_type_text(p, schema) for p in prop["prefixItems"]) + "]"
        text = "list of " + _type_text(prop.get("items", {}), schema)
        if prop.get("minItems"):
            text += f" (at least {prop['minItems']})"
        return text
    if kind == "object":
        return "mapping"
    return "any value"


# --- Markdown ------------------------------------------------------------------------------------

_INTRO = f"""# Job spec reference

<!-- Generated by `runyard spec reference --write-docs docs` from runyard's own models: do not edit by
hand. A test fails when this page or spec.schema.json differs from what the code generates. -->

A job spec is one YAML file that states everything a run depends on. It is checked before any work
starts: a bad field is reported with its path, the value and what was expected, and the error links to
the field's entry below (the anchor is the field's dotted path, e.g. `#data.filters.min_words`).
`runyard spec reference FIELD` prints one entry; `runyard spec init` writes a commented starting spec.

Stages inherit the top-level `model`, `optim`, `schedule` and `train` sections and change them field by
field (`stages[].model` takes the fields of [`model`](#model), and so on). `null` turns an optional
bound or filter off. Tasks: {", ".join(f"`{t}`" for t in TASKS)}.

Editors: [`spec.schema.json`]({SCHEMA_FILE}) is the same reference as a JSON Schema. With the YAML
language server (VS Code's YAML extension, Neovim's yamlls), put
`# yaml-language-server: $schema=<path or URL of spec.schema.json>` on a spec's first line, or map spec
files to it in the editor's settings (`yaml.schemas`), to get completion, hover text and checks as you
type.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section_markdown(section: Section) -> list[str]:
    lines = [f'<a id="{section.anchor}"></a>', "", f"## {section.title}", ""]
    if section.doc:
        lines += [section.doc, ""]
    if section.is_list:
        lines += ["A list; each item has these fields.", ""]
    lines += ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in section.fields:
        opens_section = f.section_link == f.path
        name = f"[`{f.name}`](#{f.path})" if opens_section else f'<a id="{f.path}"></a>`{f.name}`'
        lines.append(f"| {name} | {_cell(f.type_text)} | {_cell(f.default_text)} | {_cell(f.description)} |")
    return lines + [""]


def markdown_reference() -> str:
    """docs/spec.md: the intro, a table of contents and one table per section."""
    all_sections = sections()
    lines = [_INTRO, "## Sections", ""]
    for s in all_sections:
        depth = s.path.count(".") + (1 if s.path else 0)
        lines.append(f"{'  ' * depth}- [{s.title}](#{s.anchor})")
    lines.append("")
    for s in all_sections:
        lines += _section_markdown(s)
    return "\n".join(lines).rstrip() + "\n"


def entry_text(path: str) -> str:
    """The reference entry of one field or section, as plain text (for `runyard spec reference FIELD`)."""
    wanted = ".".join(path_to_loc(path)) if path not in ("", "top") else ""
    all_sections = sections()
    for s in all_sections:
        if s.path == wanted:
            return "\n".join(_section_markdown(s)[2:]).rstrip() + "\n"
    for s in all_sections:
        for f in s.fields:
            if f.path == wanted:
                return (
                    f"{f.path}\n  type: {f.type_text}\n  default: {f.default_text.strip('`')}\n"
                    f"  {f.description}\n"
                )
    known = [f.path for s in all_sections for f in s.fields]
    close = [p for p in known if p.endswith("." + wanted.rsplit(".", 1)[-1])][:5]
    hint = f"; fields with that name: {', '.join(close)}" if close else ""
    raise UnknownSpecField(f"the spec has no field {path!r}{hint} (sections: {', '.join(s.anchor for s in all_sections)})")


def undocumented_fields() -> list[str]:
    """Paths of fields without a description (a test keeps this empty)."""
    return [f.path for s in sections() for f in s.fields if not f.description.strip()] + [
        s.anchor for s in sections() if not s.doc
    ]

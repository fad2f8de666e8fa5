"""The `data:` section of an instruction (sft) or preference (dpo) stage. Owned by the data stage;
spec/sections.py embeds it in a stage.

Records come from JSONL or Parquet (fields named below) or are built from Python sources
(`python_functions`: one record per documented function, made with `ast` at data-prep time). The
conversation text is normalised, exact and near duplicates are removed by conversation, and the
held-out split is made by conversation (or by a named group, so that related records share a side).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runyard.spec.data import DedupSpec, NormalizeSpec


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InstructSourceSpec(_Strict):
    """One input of instruction or preference records."""

    path: str = Field(
        description="a local file, a glob (`**` recurses) or an fsspec URL; `{stdlib}` expands to the "
        "interpreter's standard library"
    )
    format: Literal["jsonl", "parquet", "python_functions"] = Field(
        default="jsonl",
        description="`jsonl` (one record per line), `parquet` (one record per row), or `python_functions`: "
        "Python files whose documented functions become records (the prompt: the function's signature and "
        "docstring; the response: its body; the group: its module), built with `ast` at data-prep time; for a dpo "
        "stage the rejected response is made as `rejected` says",
    )
    rejected: Literal["next_function", "shuffled_lines"] = Field(
        default="next_function",
        description="`python_functions` in a dpo stage only: the rejected response. `next_function`: the body of "
        "the module's next function (the same style and vocabulary, the wrong meaning: hard for a small model); "
        "`shuffled_lines`: the function's own body with its lines in another order (the same tokens, not a "
        "program that runs in that order), a permutation fixed by the function's id",
    )
    group_field: str | None = Field(
        default=None,
        description="a record field whose value keeps records together in the held-out split (e.g. a "
        "source module); null splits by conversation. `python_functions` records are grouped by module",
    )
    min_body_lines: int = Field(
        default=2, ge=1, description="`python_functions` only: functions whose body is shorter are skipped"
    )
    max_body_lines: int = Field(
        default=40, ge=1, description="`python_functions` only: functions whose body is longer are skipped"
    )
    exclude: list[str] = Field(default_factory=list, description="glob patterns of paths to leave out")

    @model_validator(mode="after")
    def _function_fields_need_python_functions(self) -> InstructSourceSpec:
        # Records of a JSONL or Parquet file bring their own responses: these fields would do nothing there.
        # Compared with their defaults, not by whether they were written: a resolved spec writes them all.
        fields = type(self).model_fields
        stray = [n for n in ("min_body_lines", "max_body_lines", "rejected") if getattr(self, n) != fields[n].default]
        if stray and self.format != "python_functions":
            raise ValueError(f"{', '.join(stray)} apply to format python_functions only, not {self.format!r}")
        return self


class InstructDataSpec(_Strict):
    """Instruction data (stage kind `sft`): records with `messages` (a list of {role, content}, roles
    system/user/assistant, user and assistant alternating, ending with the assistant) or with `prompt`
    and `response` (and an optional `system`). Preference data (kind `dpo`): records with `prompt`,
    `chosen` and `rejected` (and an optional `system`)."""

    sources: list[InstructSourceSpec] = Field(min_length=1, description="the inputs, read in order")
    heldout_fraction: float = Field(
        default=0.1,
        gt=0.0,
        lt=0.5,
        description="fraction of conversations (or groups) held out for evaluation, chosen by a seeded hash",
    )
    chat_template: str | None = Field(
        default=None,
        description="a Jinja chat template (rendered as transformers renders them), or `default` for "
        "runyard's instruction format (`### Instruction:` / `### Response:`, turns ended by the end-of-text "
        "token); null takes the tokenizer's tokenizer_config.json template, else the default for "
        "prompt/response data (messages without a template are an error)",
    )
    too_long: Literal["truncate", "drop"] = Field(
        default="drop",
        description="a conversation longer than the model's context: `drop` it, or `truncate` it to the "
        "context (dropped all the same when no response token is left); both counted in the data report",
    )
    on_bad_record: Literal["error", "skip"] = Field(
        default="error",
        description="a record that cannot be used (a line that is not JSON, no `messages`, roles out of order, "
        "an unknown role such as `tool`, a non-string content, a preference record without `chosen` or "
        "`rejected`, a conversation the chat template refuses with raise_exception): `error` refuses the run "
        "before any work (exit 2, from `runyard plan` too), listing every bad record by file:line, field and "
        "what was expected (the first 20, with a count of the rest); `skip` leaves each out, counted by kind "
        "with samples in the data report",
    )
    length_grouping: int = Field(
        default=32,
        ge=0,
        description="batches are drawn from windows of this many global batches sorted by length, so a "
        "batch pads less; 0 draws them in plain shuffled order",
    )
    normalize: NormalizeSpec = Field(default_factory=NormalizeSpec, description="text normalisation of every message")
    dedup: DedupSpec = Field(
        default_factory=DedupSpec, description="exact and near-duplicate removal by whole conversation"
    )
    cache_dir: str | None = Field(
        default=None, description="where prepared records are kept; default the top-level data's cache"
    )

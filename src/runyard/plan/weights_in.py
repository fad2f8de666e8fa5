"""A spec checked against its initial weights (`model.init`) before any work.

Where each stage starts and the model config that follows are model/stage_model.py's. A run has one
tokenizer (its data is tokenized once), so the stages that start from a model directory must agree on
it, and it replaces the trained BPE: `weights_tokenizer_dir`.

`check_weights_in(spec)` runs all of this before any work (`runyard plan`, and `runyard run` before the
run directory holds anything), so a spec that cannot run on its weights is a spec error (exit 2) naming
the field, the file and the value: the weights' files as their safetensors headers describe them
(format, whole files, every tensor config.json implies), the tokenizer, and the chat template an sft or
dpo stage on `messages` renders with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from runyard.data.chat import compile_template, directory_template, missing_template
from runyard.data.sources import is_url, list_source_files, read_bytes
from runyard.data.tokenizer import TOKENIZER_FILE, eos_token_beside, load_model_tokenizer
from runyard.errors import DataError, SpecError
from runyard.model.stage_model import (
    SPEC_SOURCE,
    StageStart,
    check_directory_weights,
    directory_config,
    directory_starts,
    stage_config,
    stage_start,
)
from runyard.spec.job import JobSpec, reference_hint


def chat_template_problems(spec: JobSpec) -> list[tuple[str, object, str]]:
    """For each sft or dpo stage that renders with the tokenizer's chat template (its data sets no
    `chat_template`): the template must be readable and compile, and where the records give `messages`
    there must be one. The template is looked up where the stage's data preparation looks
    (data/chat.py's `directory_template`, beside the run's tokenizer)."""
    problems: list[tuple[str, object, str]] = []
    directory = data_tokenizer_dir(spec)
    for index, stage in enumerate(spec.stages):
        if stage.kind == "pretrain" or stage.data is None or stage.data.chat_template is not None:
            continue
        field = f"stages[{index}].data.chat_template"
        try:
            source, _origin = directory_template(directory) if directory is not None else (None, "")
            if source is not None:
                compile_template(source)
                continue
        except DataError as exc:
            problems.append((field, None, f"a chat template runyard can render: {exc}"))
            continue
        uses = _first_messages_record(stage.data)
        if uses is not None:
            why = (missing_template(directory) if directory is not None else
                   "the run trains its own tokenizer, which has no chat template, and the spec sets none. Set "
                   "the stage's data.chat_template to a Jinja template, or to `default` for runyard's "
                   "instruction format")
            problems.append((field, None, f"a chat template, as the stage's records give `messages` ({uses}): {why}"))
    return problems


def _first_messages_record(data: Any) -> str | None:
    """Where the first record of an sft/dpo stage's JSONL or Parquet sources that gives `messages` is
    (file:line, or file for Parquet's column), or None. A line is parsed only when it names the key."""
    for i, source in enumerate(data.sources):
        if source.format == "python_functions":
            continue
        try:
            files = list_source_files(source, i)
        except (DataError, OSError):
            continue  # a source that lists no files is reported by the data stage's own checks
        for file in files:
            if is_url(file.path):
                continue  # remote records are read by the data stage alone
            try:
                raw = read_bytes(file.path)
            except (DataError, OSError):
                continue
            if source.format == "parquet":
                try:
                    if "messages" in pq.read_schema(pa.BufferReader(raw)).names:
                        return f"{file.path}, column messages"
                except pa.ArrowException:
                    pass
                continue
            for lineno, line in enumerate(raw.split(b"\n"), start=1):
                if b'"messages"' not in line:
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "messages" in record:
                    return f"{file.path}:{lineno}"
    return None


def weights_tokenizer_dir(spec: JobSpec) -> Path | None:
    """The model directory whose tokenizer the run uses (the first stage that starts from one), or None
    when every stage starts from random weights or another stage (the data stage then trains a BPE)."""
    starts = directory_starts(spec)
    return starts[0].directory if starts else None


def data_tokenizer_dir(spec: JobSpec) -> Path | None:
    """The directory of the tokenizer file the run tokenizes with as it came (a model directory's, else
    data.tokenizer.path's), where its tokenizer_config.json and chat template sit; None for a BPE the data
    stage trains."""
    directory = weights_tokenizer_dir(spec)
    if directory is None and spec.data is not None and spec.data.tokenizer.path:
        directory = Path(spec.data.tokenizer.path).parent
    return directory


def run_vocab(spec: JobSpec) -> int:
    """The vocabulary the plan sizes stages from random weights with: model.vocab_size, else
    data.tokenizer.vocab_size, else (no top-level data) the initial weights' tokenizer's."""
    if spec.model.vocab_size:
        return spec.model.vocab_size
    if spec.data is not None:
        return spec.data.tokenizer.vocab_size
    directory = weights_tokenizer_dir(spec)
    if directory is None:  # JobSpec refuses a spec without data whose stages start from no weights
        raise SpecError(SPEC_SOURCE, [("data", "(missing)", "a model directory in model.init to take the tokenizer from")])
    return Tokenizer.from_file(str(directory / TOKENIZER_FILE)).get_vocab_size()


def check_weights_in(spec: JobSpec, tokenizer_vocab: int | None = None) -> None:
    """Raise one SpecError listing every problem with the spec's initial weights, before any work: a
    directory that is missing or malformed, an unsupported architecture or config value, a tokenizer
    that is missing, disagrees between stages or with data.tokenizer.path, a vocabulary or context the
    spec contradicts. `tokenizer_vocab` sizes stages that start from random weights (default: the
    spec's data.tokenizer.vocab_size)."""
    problems: list[tuple[str, object, str]] = []
    starts = directory_starts(spec)
    digests: dict[str, StageStart] = {}
    vocab = tokenizer_vocab or (spec.data.tokenizer.vocab_size if spec.data is not None else 0)
    for start in starts:
        try:
            weights = directory_config(spec, start)
            check_directory_weights(spec, start, weights)
            tok, _config = load_model_tokenizer(start.directory)
        except SpecError as exc:
            problems += exc.problems
            continue
        except DataError as exc:
            problems.append((f"{start.field}.path", str(start.directory), f"a model directory with its tokenizer: "
                             f"{exc} {reference_hint('model.init.path')}"))
            continue
        vocab = tok.get_vocab_size()
        if tok.get_vocab_size() > weights.vocab_size:
            problems.append((f"{start.field}.path", str(start.directory),
                             f"a tokenizer that fits the model: {start.directory / TOKENIZER_FILE} has "
                             f"{tok.get_vocab_size():,} tokens, config.json's vocab_size is {weights.vocab_size:,}"))
        digest = _tokenizer_identity(start.directory / TOKENIZER_FILE)
        first = next(iter(digests.values()), None)
        if first is not None and digest not in digests:
            problems.append((f"{start.field}.path", str(start.directory),
                             f"a model directory with the same tokenizer as {first.directory} ({first.field}): "
                             "the stages of one run share one tokenizer, as their data is tokenized once"))
        digests.setdefault(digest, start)
    if starts and spec.data is not None and spec.data.tokenizer.path and not problems:
        theirs = _tokenizer_identity(starts[0].directory / TOKENIZER_FILE)
        if _tokenizer_identity(Path(spec.data.tokenizer.path)) != theirs:
            problems.append(("data.tokenizer.path", spec.data.tokenizer.path,
                             f"null, or the tokenizer of {starts[0].directory} ({starts[0].field}): a stage that "
                             "starts from a model directory brings its tokenizer"))
    if not problems:
        problems += chat_template_problems(spec)
    if not problems:
        for stage in spec.stages:
            if stage_start(spec, stage.name).source == "random":  # nothing to check against (nor, for a
                continue  # table or an image task, the data's facts yet)
            try:
                stage_config(spec, stage.name, vocab)
            except SpecError as exc:
                problems += [p for p in exc.problems if p not in problems]
    if problems:
        raise SpecError(SPEC_SOURCE, problems)


def _tokenizer_identity(tokenizer_path: Path) -> tuple[str, str] | None:
    """What decides how a tokenizer tokenizes data: its canonical serialisation (so a file re-saved with
    other formatting is the same tokenizer) and its end-of-document token. None when unreadable."""
    try:
        return Tokenizer.from_file(str(tokenizer_path)).to_str(), eos_token_beside(tokenizer_path)
    except Exception:  # noqa: BLE001 (tokenizers raises a bare Exception; unreadable is reported elsewhere)
        return None

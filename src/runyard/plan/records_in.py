"""Every sft and dpo stage's records checked before any work (data/instruct_check.py), with the chat
template the stage will render with where that template can refuse a conversation: `runyard plan` and
`runyard run` call `check_records_in` beside `check_weights_in`, and refuse a stage whose records are bad
under data.on_bad_record: error (exit 2, every bad record counted, the first 20 listed)."""

from __future__ import annotations

from pathlib import Path

from runyard.data.chat import ChatTemplate, choose_template
from runyard.data.instruct_check import RecordScan, check_records
from runyard.data.sources import files_or_problem
from runyard.data.tokenizer import EOS_TOKEN, TOKENIZER_FILE, eos_token_beside
from runyard.errors import DataError, SpecError
from runyard.plan.weights_in import data_tokenizer_dir
from runyard.spec.job import JobSpec


def stage_template(spec: JobSpec, stage) -> ChatTemplate | None:
    """The template the stage's data preparation will choose (data/chat.py's choose_template, beside the
    run's tokenizer), or None where it cannot be known yet or is refused (check_weights_in says why)."""
    directory = data_tokenizer_dir(spec)
    tokenizer = (directory / TOKENIZER_FILE) if directory is not None else Path("(the run's BPE)") / TOKENIZER_FILE
    try:
        eos = eos_token_beside(tokenizer) if directory is not None else EOS_TOKEN
        return choose_template(stage.data.chat_template, tokenizer, eos, False, "")
    except DataError:
        return None


def check_records_in(spec: JobSpec) -> dict[str, RecordScan]:
    """Scan every sft/dpo stage's records; SpecError for a source that matches no file, BadRecords (exit
    2) for bad records under on_bad_record: error. Returns each stage's scan (skip: what will be left out)."""
    scans: dict[str, RecordScan] = {}
    missing = []
    for index, stage in enumerate(spec.stages):
        if stage.kind == "pretrain" or stage.data is None:
            continue
        for i, source in enumerate(stage.data.sources):
            where = f"stages[{index}].data.sources[{i}].path"
            problem = files_or_problem(source, i, where)[1]
            if problem is not None:
                missing.append(problem)
    if missing:
        raise SpecError("stages[].data.sources", missing)
    for index, stage in enumerate(spec.stages):
        if stage.kind == "pretrain" or stage.data is None:
            continue
        scans[stage.name] = check_records(stage.data, stage.kind == "dpo", f"stages[{index}].data ({stage.name})",
                                          stage_template(spec, stage))
    return scans

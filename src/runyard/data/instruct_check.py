"""The pass over an sft or dpo stage's records before any work: every JSONL line parsed, every Parquet
row read, each checked as the data stage reads it (instruct_sources.py's record_from_mapping), nothing
tokenized. With data.on_bad_record: error, `runyard plan` and `run` refuse the stage (exit 2) listing
every bad record by file:line, field and what was expected.

A chat template that calls `raise_exception` is run on every conversation too (rendering is the only way
to know what it refuses); a template without it is never rendered here, so the pass stays a parse.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runyard.data.chat import ChatTemplate, ChatTemplateRefused
from runyard.data.instruct_sources import KEEP_BAD, BadRecords, RecordError, raw_records, record_from_mapping
from runyard.data.sources import is_url, list_source_files, read_bytes
from runyard.spec.data_instruct import InstructDataSpec


@dataclass
class RecordScan:
    """What the pass found: records read, the bad ones (the first KEEP_BAD kept) and how many in all."""

    records: int = 0
    bad: list[RecordError] = field(default_factory=list)
    bad_total: int = 0

    def add(self, problem: RecordError) -> None:
        self.bad_total += 1
        if len(self.bad) < KEEP_BAD:
            self.bad.append(problem)


def refuses(template: ChatTemplate | None) -> bool:
    """Whether the template can refuse a conversation (it calls raise_exception)."""
    return template is not None and "raise_exception" in template.source


def scan_records(spec: InstructDataSpec, preference: bool, template: ChatTemplate | None = None) -> RecordScan:
    """Check every record of the stage's JSONL and Parquet sources (local files; `python_functions`
    records are built from code and remote files read by the data stage alone)."""
    scan = RecordScan()
    render = template if refuses(template) else None
    for i, source in enumerate(spec.sources):
        if source.format == "python_functions":
            continue
        for file in list_source_files(source, i):
            if is_url(file.path):
                continue
            for rid, item in raw_records(file.path, read_bytes(file.path), source.format):
                scan.records += 1
                if isinstance(item, RecordError):
                    scan.add(item)
                    continue
                try:
                    record = record_from_mapping(item, rid, preference, source.group_field)
                except RecordError as bad:
                    scan.add(bad)
                    continue
                if render is not None:
                    _render(render, record, scan)
    return scan


def _render(template: ChatTemplate, record, scan: RecordScan) -> None:
    conversations = [record.messages]
    if record.rejected is not None:
        conversations.append(record.messages[:-1] + [{"role": "assistant", "content": record.rejected}])
    for messages in conversations:
        try:
            template.segments(messages)
        except ChatTemplateRefused as exc:
            scan.add(RecordError(record.id, "messages", f"a conversation the chat template ({exc.origin}) renders; "
                                 f"it refused: {exc.reason}", "template_refused"))
            return


def check_records(spec: InstructDataSpec, preference: bool, where: str, template: ChatTemplate | None = None) -> RecordScan:
    """scan_records, and under on_bad_record: error a BadRecords (exit 2) listing what it found."""
    scan = scan_records(spec, preference, template)
    if scan.bad_total and spec.on_bad_record == "error":
        raise BadRecords(where, scan.bad, scan.bad_total)
    return scan

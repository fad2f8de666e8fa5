"""Instruction and preference records for the layout tests of sft and dpo stages: prompts and responses of
many lengths (lines of a stdlib module, a response of one to three lines), short enough to fit a 128-token
context, so the rows of a batch are padded and every record supervises its own number of tokens."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import merge
from .test_finetune_run import SFT_STAGE


def uneven_records() -> list[dict]:
    lines = [line.strip() for line in Path(json.__file__).read_text().splitlines() if line.strip()]
    return [{"prompt": lines[i], "response": "\n".join(lines[i + 1 : i + 2 + i % 3])} for i in range(0, 240, 3)]


def write_uneven_records(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in uneven_records()))
    return path


def write_uneven_pairs(path: Path) -> Path:
    """Preference pairs: chosen, the record's own response; rejected, the next record's."""
    records = uneven_records()
    pairs = [{"prompt": r["prompt"], "chosen": r["response"], "rejected": records[(i + 1) % len(records)]["response"]}
             for i, r in enumerate(records)]
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return path


def sft_stage_patch(records: Path, stage: str = "main", kind: str = "sft") -> dict:
    """A spec patch whose one stage, `stage`, fine-tunes (sft, or dpo on pairs) on `records`."""
    data = {"sources": [{"path": str(records), "group_field": None}], "too_long": "truncate",
            "heldout_fraction": 0.2}
    return {"model": {"context_length": 128}, "stages": [merge(SFT_STAGE, {"name": stage, "kind": kind, "data": data})]}

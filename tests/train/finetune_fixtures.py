"""Real files for fine-tuning tests: a BPE trained on stdlib sources, and instruction / preference JSONL
built from stdlib functions (prompt: signature and docstring; response: body)."""

from __future__ import annotations

import glob
import json
import random
import sysconfig
from collections import Counter
from pathlib import Path

from runyard.data.instruct import prepare_instruct
from runyard.data.instruct_sources import python_function_records
from runyard.data.pipeline import PreparedData
from runyard.data.tokenizer import train_bpe
from runyard.spec.data_instruct import InstructDataSpec, InstructSourceSpec

STDLIB = sysconfig.get_paths()["stdlib"]


def stdlib_files(pattern: str = "json/*.py") -> list[str]:
    return sorted(glob.glob(f"{STDLIB}/{pattern}"))


def write_tokenizer(path: Path, vocab: int = 400) -> Path:
    texts = [Path(p).read_text() for p in stdlib_files() + stdlib_files("email/_*.py")]
    train_bpe(texts, vocab, 2, 10**7).save(str(path))
    return path


def function_pairs(patterns: tuple[str, ...] = ("json/*.py", "email/_*.py")) -> list[dict]:
    source = InstructSourceSpec(path="x", format="python_functions", max_body_lines=12)
    out = []
    for path in [p for pattern in patterns for p in stdlib_files(pattern)]:
        for r in python_function_records(path, Path(path).read_text(), Path(path).stem, source, Counter()):
            out.append({"prompt": r.messages[0]["content"], "response": r.messages[1]["content"], "module": r.group})
    return out


def write_sft_jsonl(path: Path, pairs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return path


def write_dpo_jsonl(path: Path, pairs: list[dict], seed: int = 0) -> Path:
    """chosen: the function's own body; rejected: another function's body."""
    rng = random.Random(seed)
    lines = []
    for i, p in enumerate(pairs):
        other = pairs[(i + 1 + rng.randrange(len(pairs) - 1)) % len(pairs)]
        lines.append(json.dumps({"prompt": p["prompt"], "chosen": p["response"], "rejected": other["response"]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def prepared_text(tokenizer: Path, vocab: int) -> PreparedData:
    """A PreparedData carrying only the tokenizer (sft and dpo stages read their own records)."""
    return PreparedData(tokenizer_path=tokenizer, vocab_size=vocab, eos_id=0, train_index=tokenizer,
                        heldout_index=tokenizer, fingerprint="test", stats={}, input_fingerprints={})


def prepare(data: dict, kind: str, tokenizer: Path, context: int, cache: Path, seed: int = 3):
    return prepare_instruct(InstructDataSpec.model_validate(data), kind, tokenizer, context, seed, cache)

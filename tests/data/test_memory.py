"""data.memory_limit holds for the whole process tree: `runyard prepare` on real text (the standard
library's sources, edited copies so deduplication has work), with its peak resident memory measured
from /proc, the preparing process and its workers summed (budget.py sizes every buffer from the limit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from runyard.data.budget import MIB
from runyard.system.processes import popen_dying_with_me
from tests.data.data_fixtures import age_file
from tests.data.tree_memory import TreeMemory

ROOT = Path(__file__).resolve().parents[2]


def stdlib_corpus(path: Path, size: int) -> Path:
    """A JSONL file of `size` characters of the standard library's modules: each module as found, then
    copies with one identifier renamed (near-duplicates)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = sorted(p for p in stdlib.rglob("*.py") if not {"site-packages", "__pycache__", "test"} & set(p.parts))
    written, copy = 0, 0
    with open(path, "w") as out:
        while written < size:
            for module in modules:
                try:
                    text = module.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if copy:
                    text = text.replace("self", f"self{copy}", 1)
                out.write(json.dumps({"text": text}) + "\n")
                written += len(text)
                if written >= size:
                    break
            copy += 1
    age_file(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.full)])
def test_prepare_stays_under_the_memory_limit(tmp_path: Path, workers: int):
    limit = 512 * MIB if workers == 1 else 768 * MIB
    corpus = stdlib_corpus(tmp_path / "corpus.jsonl", 8_000_000)
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: memory\n"
        "data:\n"
        f"  sources: [{{path: '{corpus}', format: jsonl}}]\n"
        f"  workers: {workers}\n"
        f"  memory_limit: {limit}\n"
        "  tokenizer: {vocab_size: 4096, train_max_bytes: 4000000}\n"
    )
    proc = popen_dying_with_me(
        [sys.executable, "-m", "runyard", "prepare", str(spec), "--cache-dir", str(tmp_path / "cache"),
         "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    memory = TreeMemory(proc.pid)
    _, err = proc.communicate(timeout=900)
    peak = memory.stop()
    assert proc.returncode == 0, err[-3000:]
    assert memory.samples > 10  # it was watched while it ran
    prepared = next((tmp_path / "cache" / "datasets").glob("*/prepared.json"))
    stats = json.loads(prepared.read_text())["stats"]
    assert stats["dedup"]["near_removed"] > 0 and stats["split"]["train"]["tokens"] > 1_000_000
    print(f"peak {peak / MIB:.0f} MiB of {limit / MIB:.0f}")
    assert peak < limit, f"peak resident memory {peak / MIB:.0f} MiB over data.memory_limit {limit / MIB:.0f} MiB"

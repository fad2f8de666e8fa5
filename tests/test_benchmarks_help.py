"""Every benchmark's `--help` works without its peers installed: the bench extra's packages (trl,
datasets, transformers, datasketch, datatrove, spacy) and the serving peers are made unimportable in the
subprocess, whether or not this environment has them, so the check means the same everywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))  # the helpers the scripts share (harness, schedule_sim...) too: they must import
PEERS = ("trl", "datasets", "transformers", "datasketch", "datatrove", "spacy", "vllm", "llama_cpp")

# Runs the script as __main__ with the peers refused at import, as if they were not installed.
RUNNER = """
import importlib.abc, runpy, sys
PEERS = set(sys.argv[1].split(","))
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in PEERS:
            raise ModuleNotFoundError(f"No module named {name!r} (made absent by the test)", name=name)
        return None
sys.meta_path.insert(0, _Absent())
script = sys.argv[2]
sys.argv = [script, "--help"]
sys.path.insert(0, script.rsplit("/", 1)[0])
runpy.run_path(script, run_name="__main__")
"""


def test_every_benchmark_is_covered():
    assert len(SCRIPTS) >= 10 and BENCHMARKS / "finetune_throughput.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_help_works_without_the_peers(script: Path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCHMARKS.parent / "src"),
                                                                   os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", RUNNER, ",".join(PEERS), str(script)], capture_output=True,
                          text=True, timeout=120, env=env, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, f"{script.name} --help failed:\n{done.stderr[-3000:]}"
    if '__name__ == "__main__"' in script.read_text():
        assert "usage:" in done.stdout, done.stdout[-2000:]

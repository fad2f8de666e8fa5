"""Every benchmark's `--help` works without its peers installed: the bench extra's packages (trl,
datasets, transformers, datasketch, datatrove, spacy) and the serving peers are made unimportable in the
subprocess, whether or not this environment has them, so the check means the same everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))  # the helpers the scripts share (harness, schedule_sim...) too: they must import
PEERS = ("trl", "datasets", "transformers", "datasketch", "datatrove", "spacy", "vllm", "llama_cpp")

# Runs every script given as __main__ with `--help`, one after the other in one interpreter (each would
# otherwise pay for its own torch import), with the peers refused at import as if they were not installed;
# prints one JSON line: script -> its exit code, standard output and the end of its error.
RUNNER = """
import contextlib, importlib.abc, io, json, runpy, sys, traceback
PEERS = set(sys.argv[1].split(","))
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in PEERS:
            raise ModuleNotFoundError(f"No module named {name!r} (made absent by the test)", name=name)
        return None
sys.meta_path.insert(0, _Absent())
results = {}
for script in sys.argv[2:]:
    sys.argv = [script, "--help"]
    sys.path.insert(0, script.rsplit("/", 1)[0])
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    sys.path.pop(0)
    results[script] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()[-3000:]}
print(json.dumps(results))
"""

pytestmark = pytest.mark.xdist_group("benchmarks_help")  # one interpreter answers for every script


def test_every_benchmark_is_covered():
    assert len(SCRIPTS) >= 10 and BENCHMARKS / "finetune_throughput.py" in SCRIPTS


@pytest.fixture(scope="module")
def helps() -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCHMARKS.parent / "src"),
                                                                   os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", RUNNER, ",".join(PEERS), *map(str, SCRIPTS)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_help_works_without_the_peers(script: Path, helps):
    result = helps[str(script)]
    assert result["code"] == 0, f"{script.name} --help failed:\n{result['stderr']}"
    if '__name__ == "__main__"' in script.read_text():
        assert "usage:" in result["stdout"], result["stdout"][-2000:]


def test_a_failing_script_is_reported_as_failed(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import argparse\nimport datasketch\nargparse.ArgumentParser().parse_args()\n")
    done = subprocess.run([sys.executable, "-c", RUNNER, ",".join(PEERS), str(broken)], capture_output=True,
                          text=True, timeout=120)
    result = json.loads(done.stdout.strip().splitlines()[-1])[str(broken)]
    assert result["code"] == 1 and "made absent by the test" in result["stderr"]

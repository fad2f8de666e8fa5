"""The Slurm executor on the CI's single-node Slurm (.ci/setup_slurm.sh; `source .ci/env`): each step a
job array, the same dataset as the local executor, and a failed or killed array task rerun alone."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from runyard.data.errors import TaskFailed
from runyard.data.executors import ExecutorChoice
from runyard.data.pipeline import PreparedData, prepare_data
from runyard.data.shards import load_index
from tests.data.data_fixtures import WORDS, age_file, spec_for, write_corpus

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


@pytest.fixture(autouse=True)
def _slurm():
    if not os.environ.get("RUNYARD_TEST_SLURM"):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("RUNYARD_TEST_SLURM is not set, and CI=true: run .ci/setup_slurm.sh and source .ci/env")
        pytest.skip("RUNYARD_TEST_SLURM is not set (run .ci/setup_slurm.sh, then `source .ci/env`)")


def shard_hashes(prepared: PreparedData) -> list[str]:
    return [s["sha256"] for idx in (prepared.train_index, prepared.heldout_index) for s in load_index(idx)["shards"]]


def submitted(cache: Path, step: str) -> dict[int, list[str]]:
    """attempt -> the outputs of the tasks submitted in it, from the task lists the executor wrote."""
    out: dict[int, list[str]] = {}
    for path in (cache / "steps" / "logs").rglob(f"{step}-a*-*.json"):
        attempt = int(path.name.split("-")[1][1:])
        out.setdefault(attempt, []).extend(t["output"] for t in json.loads(path.read_text()))
    return out


def slurm(name: str, retries: int = 2) -> ExecutorChoice:
    return ExecutorChoice("slurm", sbatch_args=[f"--job-name={name}"], retries=retries)


def test_slurm_arrays_prepare_the_dataset_the_local_executor_does(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=30, words=(4000, 8000))  # several parts
    spec = spec_for(str(corpus / "*.txt"), workers=2)
    local = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "local", progress=False)
    on_slurm = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "slurm", progress=False,
                            executor=slurm(f"rytest-{uuid.uuid4().hex[:8]}"))
    assert on_slurm.fingerprint == local.fingerprint
    assert shard_hashes(on_slurm) == shard_hashes(local)
    assert on_slurm.tokenizer_path.read_bytes() == local.tokenizer_path.read_bytes()
    clean, tokenize = submitted(tmp_path / "slurm", "clean"), submitted(tmp_path / "slurm", "tokenize")
    assert list(clean) == [1] and len(clean[1]) >= 2 and list(tokenize) == [1]
    script = next((tmp_path / "slurm" / "steps" / "logs").rglob("clean-a1-000.sbatch")).read_text()
    # two array tasks (data.workers) drain the list of more tasks: each claimed by exactly one of them
    assert "#SBATCH --array=0-1%2" in script and "--drain" in script and "#SBATCH --mem=4096M" in script
    claims = next((tmp_path / "slurm" / "steps" / "logs").rglob("clean-a1-000.claims"))
    claimed = sorted(int(p.name) for p in claims.iterdir() if p.name.isdigit())
    assert claimed == list(range(len(clean[1])))
    assert {p.read_text().split()[0] for p in claims.iterdir() if p.name.isdigit()} <= {"0", "1"}


def test_a_failing_array_task_is_retried_alone_named_and_rerun_alone_later(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=30, words=(4000, 8000))
    broken = corpus / "doc_0020.txt.gz"
    broken.write_bytes(b"this is not gzip")
    age_file(broken)
    spec = spec_for(str(corpus / "doc_*"), workers=2)
    name = f"rytest-{uuid.uuid4().hex[:8]}"
    with pytest.raises(TaskFailed, match=r"(?s)1 clean task\(s\) failed on Slurm after 2 attempt.*cannot decompress as gzip"):
        prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "c", progress=False,
                     executor=slurm(name, retries=1))
    clean = submitted(tmp_path / "c", "clean")
    assert len(clean[1]) >= 2 and len(clean[2]) == 1 and clean[2][0] in clean[1]  # retried alone
    others = [Path(o) for o in clean[1] if o != clean[2][0]]
    assert all((o / "meta.json").exists() for o in others)
    done_at = {o: (o / "meta.json").stat().st_mtime_ns for o in others}

    broken.write_bytes(gzip.compress(b"a fixed document about the river and the stone\n" * 50))
    age_file(broken)
    fixed = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "c", progress=False,
                         executor=slurm(name))
    lists = sorted((tmp_path / "c" / "steps" / "logs").rglob("clean-a1-000.json"), key=os.path.getmtime)
    assert len(lists) == 2 and len(json.loads(lists[-1].read_text())) == 1  # only the fixed file's part ran
    assert all((o / "meta.json").stat().st_mtime_ns == t for o, t in done_at.items())
    assert fixed.stats["read"]["files"] == 31
    reference = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "ref", progress=False)
    assert fixed.fingerprint == reference.fingerprint and shard_hashes(fixed) == shard_hashes(reference)


def _squeue(name: str) -> list[tuple[str, str, str]]:
    out = subprocess.run(["squeue", "-h", "-r", "--name", name, "-o", "%F %K %T"], capture_output=True, text=True)
    return [tuple(line.split()) for line in out.stdout.splitlines() if line.strip()]


def test_an_array_task_killed_mid_run_is_rerun_alone(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=20, words=(2000, 4000))
    rng = np.random.default_rng(0)
    words = np.array(WORDS)[rng.integers(0, len(WORDS), size=1_200_000)]
    big = corpus / "doc_big.txt"  # its own part, cleaned for some seconds: long enough to be killed in
    big.write_text("\n".join(" ".join(words[i : i + 10]) for i in range(0, len(words), 10)))
    age_file(big)
    spec = spec_for(str(corpus / "*.txt"), workers=2)
    name = f"rytest-{uuid.uuid4().hex[:8]}"
    logs = tmp_path / "c" / "steps" / "logs"
    outcome: dict = {}

    def prepare() -> None:
        try:
            outcome["prepared"] = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "c",
                                               progress=False, executor=slurm(name))
        except Exception as exc:  # reported by the assertion below
            outcome["error"] = exc

    worker = threading.Thread(target=prepare, daemon=True)
    worker.start()
    deadline = time.monotonic() + 120
    position = killed = None
    while time.monotonic() < deadline and killed is None and worker.is_alive():
        lists = list(logs.rglob("clean-a1-000.json")) if logs.exists() else []
        if lists and position is None:
            tasks = json.loads(lists[0].read_text())
            position = next(k for k, t in enumerate(tasks) if any(f["path"] == str(big) for f in t["args"]["files"]))
        # the array task that runs it: the one at its position, or (more tasks than array tasks) the one
        # draining the list that claimed it
        claims = lists[0].with_suffix(".claims") if lists else None
        element = None
        if claims is not None and not claims.exists():
            element = str(position)
        elif claims is not None and (claims / str(position)).exists():
            element = ((claims / str(position)).read_text().split() or [None])[0]
        if element is not None:
            for job, index, state in _squeue(name):
                if index == element and state == "RUNNING":
                    subprocess.run(["scancel", "--signal=KILL", f"{job}_{index}"], check=True)
                    killed = position
        time.sleep(0.1)
    worker.join(300)
    assert killed is not None, "the long task was never seen running"
    assert not worker.is_alive() and "error" not in outcome, outcome.get("error")
    clean = submitted(tmp_path / "c", "clean")
    assert len(clean[2]) == 1 and clean[2][0] == clean[1][killed]  # only the killed task reran
    reference = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "ref", progress=False)
    assert outcome["prepared"].fingerprint == reference.fingerprint
    assert shard_hashes(outcome["prepared"]) == shard_hashes(reference)

"""Array tasks that drain a task list (work_units.py `--drain`, how the Slurm executor runs a long list on
data.workers array tasks): each task is run by whoever claims it first, a failing task is reported in
its own log while the others go on, and a claimed or finished task is never run again."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from runyard.data.budget import MIB
from runyard.data.partstore import is_complete
from runyard.data.sources import list_input_files
from runyard.data.work_units import Task, claim, drain, read_task_list, write_task_list
from tests.data.data_fixtures import age_file, spec_for, write_corpus

ROOT = Path(__file__).resolve().parents[2]


def clean_tasks(tmp_path: Path) -> list[Task]:
    """One clean task per file of a small corpus whose third file is not the gzip it claims to be."""
    corpus = write_corpus(tmp_path / "corpus", n_docs=4)
    broken = corpus / "doc_0002.txt.gz"
    (corpus / "doc_0002.txt").unlink()
    broken.write_bytes(b"this is not gzip")
    age_file(broken)
    spec = spec_for(str(corpus / "doc_*"))
    files = list_input_files(spec.sources)
    spec_json = spec.model_dump(mode="json")
    return [Task("clean", i, str(tmp_path / "parts" / f"part-{i}"), {"spec": spec_json, "files": [asdict(f)]},
                 (512 * MIB, 1)) for i, f in enumerate(files)]


def test_drain_runs_each_unclaimed_task_once_and_reports_a_failure_in_its_log(tmp_path: Path):
    tasks = clean_tasks(tmp_path)
    bad = next(k for k, t in enumerate(tasks) if t.args["files"][0]["path"].endswith(".gz"))
    claims = tmp_path / "claims"
    claims.mkdir()
    assert claim(claims, 0, "someone else")  # another array task holds the first one

    assert drain(tasks, claims, first=1) == 1  # the broken file's task failed; the others ran
    assert not tasks[0].done() and (claims / "0").read_text() == "someone else"
    assert [t.done() for k, t in enumerate(tasks) if k not in (0, bad)] == [True] * (len(tasks) - 2)
    assert all(is_complete(Path(t.output)) for t in tasks if t.done())
    assert not tasks[bad].done() and "cannot decompress as gzip" in (claims / f"{bad}.log").read_text()
    assert not (claims / "0.log").exists()

    assert drain(tasks, claims) == 0  # everything is claimed or done: nothing runs twice
    assert not tasks[0].done()

    # A fresh claims directory (the executor's next attempt) over the tasks still without output, from
    # the command line as an array task runs it: the good one runs, the broken one fails again.
    broken = Path(tasks[bad].args["files"][0]["path"])
    later = [tasks[0], tasks[bad]]
    write_task_list(tmp_path / "retry.json", later)
    assert [t.output for t in read_task_list(tmp_path / "retry.json")] == [t.output for t in later]
    (tmp_path / "retry.claims").mkdir()
    proc = subprocess.run([sys.executable, "-m", "runyard.data.work_units", str(tmp_path / "retry.json"), "--drain",
                           str(tmp_path / "retry.claims")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr
    assert tasks[0].done() and "task 1: FAILED" in proc.stdout and "task 0: done" in proc.stdout

    broken.write_bytes(gzip.compress(b"the river and the stone\n" * 40))  # fixed, and listed anew
    age_file(broken)
    spec_json = tasks[bad].args["spec"]
    relisted = next(f for f in list_input_files(spec_for(spec_json["sources"][0]["path"]).sources)
                    if f.path == str(broken))
    fixed = Task("clean", bad, tasks[bad].output, {"spec": spec_json, "files": [asdict(relisted)]}, (512 * MIB, 1))
    (tmp_path / "again.claims").mkdir()
    write_task_list(tmp_path / "again.json", [fixed])
    proc = subprocess.run([sys.executable, "-m", "runyard.data.work_units", str(tmp_path / "again.json"), "--drain",
                           str(tmp_path / "again.claims")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert fixed.done()
    assert json.loads((Path(fixed.output) / "meta.json").read_text())["counts"]["documents_read"] == 1

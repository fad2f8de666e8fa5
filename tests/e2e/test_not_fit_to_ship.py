"""`runyard run` exits 7 (EXIT_NOT_FIT) when the finished run is not fit to ship, after writing its
report and export and printing the summary, so a script or CI notices; fit to ship exits 0."""

from __future__ import annotations

import json

from runyard.errors import EXIT_NOT_FIT
from tests.e2e.conftest import runyard


def test_a_finished_run_that_is_not_fit_to_ship_exits_7_with_its_reasons(write_spec, tmp_path):
    # The tiny spec's 16 steps leave the held-out loss above the unigram baseline's.
    spec = write_spec({"eval": {"must_beat_unigram": True}})
    run_dir = tmp_path / "run"
    proc = runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress")
    assert proc.returncode == EXIT_NOT_FIT == 7, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "fit to ship: no" in proc.stdout
    said = " ".join(proc.stderr.split())
    assert "not fit to ship" in said and "unigram baseline" in said and "eval.unigram_margin" in said
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["fit_to_ship"] is False and (run_dir / "export" / "runyard.json").is_file()
    # The same run directory, with nothing left to do, gives the same answer.
    again = runyard("resume", str(run_dir), "--no-progress")
    assert again.returncode == EXIT_NOT_FIT, again.stderr[-2000:]


def test_run_help_documents_the_exit_codes():
    shown = " ".join(runyard("run", "--help", check=True).stdout.split())
    assert "7 finished and exported but not fit to ship" in shown and "3 a stage's gates failed" in shown

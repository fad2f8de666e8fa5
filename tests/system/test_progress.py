"""Progress without a terminal: log lines at a bounded rate from every long phase, bars only on a TTY."""

from __future__ import annotations

import logging
import time

import pytest

from runyard.system.progress import ProgressLines, duration, phase, progress_bars
from runyard.train.progress import StepProgress


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.INFO, logger="runyard.progress")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "runyard.progress"]


def test_lines_are_rate_bounded_and_say_count_rate_and_eta(lines):
    with ProgressLines(interval=0.2) as bars:
        task = bars.add_task("tokenize", total=100, info="4 parts")
        for _ in range(99):
            bars.advance(task)  # 99 updates well inside one interval: no line for them
        time.sleep(0.25)
        bars.advance(task, 0)  # the first update after the interval writes one line
        bars.advance(task)
    said = lines()
    assert said[0] == "tokenize: started of 100 (4 parts)"
    middle = [m for m in said[1:-1] if m.startswith("tokenize: 99/100")]
    assert middle and "eta" in middle[0] and "elapsed" in middle[0], said
    assert said[-1].startswith("tokenize: done 100 in"), said
    assert len(said) <= 4, said


def test_a_task_without_updates_gets_heartbeats_then_done(lines):
    with ProgressLines(interval=0.05) as bars:
        bars.add_task("train BPE tokenizer", total=None, info="vocab 4000")
        time.sleep(0.45)
    said = lines()
    beats = [m for m in said if m.startswith("train BPE tokenizer: running, vocab 4000, elapsed")]
    assert 2 <= len(beats) <= 5, said  # one per two intervals at most
    assert said[-1].startswith("train BPE tokenizer: done in"), said


def test_no_progress_still_reports_and_none_is_silent(lines, monkeypatch):
    monkeypatch.setenv("RUNYARD_PROGRESS_INTERVAL", "0.1")
    with progress_bars(None) as bars:  # ranks other than 0
        bars.add_task("clean", total=3)
    assert lines() == []
    with progress_bars(False) as bars:  # --no-progress: no bars, but news
        bars.add_task("clean", total=3)
    said = lines()
    assert said[0] == "clean: started of 3" and said[-1].startswith("clean: done 0 in"), said


def test_bars_wanted_without_a_terminal_give_lines(lines, monkeypatch):
    monkeypatch.setattr("runyard.system.progress.on_terminal", lambda: False)
    with progress_bars(True) as bars:
        assert isinstance(bars, ProgressLines)


def test_a_stage_reports_steps_when_its_output_is_a_file(lines, monkeypatch):
    monkeypatch.setattr("runyard.train.progress.on_terminal", lambda: False)
    monkeypatch.setenv("RUNYARD_PROGRESS_INTERVAL", "0.2")
    with StepProgress("stage full", total=10, start=4, progress=True) as bar:
        time.sleep(0.25)
        bar.update(6, loss=3.25, tok_s=1234.0, heldout=3.5)
        bar.update(10, loss=3.0, tok_s=1250.0)
    said = lines()
    assert said[0] == "stage full: started of 10 (from step 4)"
    assert any(m.startswith("stage full: 6/10 (60%), loss 3.250, 1,234 tok/s, held-out 3.500, elapsed")
               and "eta" in m for m in said), said
    assert said[-1].startswith("stage full: done 10 in")


def test_a_phase_says_when_it_starts_and_ends(lines):
    with phase("export", info="HF directory"):
        pass
    said = lines()
    assert said[0] == "export: started (HF directory)" and said[-1].startswith("export: done in")
    with phase("samples", progress=None):
        pass
    assert len(lines()) == 2


def test_a_failed_phase_does_not_say_done(lines):
    with pytest.raises(RuntimeError), phase("export"):
        raise RuntimeError("disk full")
    assert not any("done" in m for m in lines())


def test_durations_read_short():
    assert [duration(s) for s in (4.4, 65, 3725)] == ["4s", "1m05s", "1h02m"]

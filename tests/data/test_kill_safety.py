"""Issue 10 in the data stage: the worker pool dies with the main process and never keeps the dataset
lock (10.1); temporary files of interrupted writes are removed by the next preparation (10.5).

10.1:

The main `prepare` process is killed alone (as the OOM killer would) while the clean step's forked
workers run. Before the fix the workers survived, kept the dataset lock, and every later prepare on
that cache blocked forever. Now: the workers are gone within seconds, and the next prepare finishes.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
from pathlib import Path

from runyard.data.pipeline import prepare_data
from tests.data.data_fixtures import spec_for, write_corpus
from tests.e2e.faults import ProcessTree, finish, wait_until

# The clean step with every part held up in its worker (a marker file says a worker has started), so
# the kill lands while the pool runs. The stand-in is defined in __main__, which forked workers share.
_SLOW_PREPARE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[4])
    import runyard.data.pipeline as pipeline
    import runyard.data.work_units as tasks
    from tests.data.data_fixtures import spec_for

    real_clean = tasks.clean_part

    def slow_clean(*args, **kwargs):
        Path(sys.argv[3], f"worker-{os.getpid()}").touch()
        time.sleep(120)
        return real_clean(*args, **kwargs)

    tasks.clean_part = slow_clean
    pipeline.prepare_data(spec_for(sys.argv[1], workers=2), seed=0, report_dir=None, cache_dir=Path(sys.argv[2]),
                          progress=False)
""")


def test_killing_the_main_process_ends_its_workers_and_frees_the_dataset(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=16, words=(20_000, 24_000))  # several parts
    pattern = str(corpus / "*.txt")
    script = tmp_path / "slow_prepare.py"
    script.write_text(_SLOW_PREPARE)
    markers = tmp_path / "markers"
    markers.mkdir()
    tree = ProcessTree()
    repo = str(Path(__file__).resolve().parents[2])
    main = tree.start([sys.executable, str(script), pattern, str(tmp_path / "cache"), str(markers), repo],
                      log=tmp_path / "prepare.log")
    try:
        wait_until(lambda: list(markers.iterdir()), 60, "a clean worker to start", proc=main)
        main.send_signal(signal.SIGKILL)  # the main process alone
        finish(main, 10)
        tree.assert_none_left(timeout=15)
        # The cache is usable at once: the same dataset prepares (bounded: a held lock is a failure).
        done = {}

        def prepare_again():
            done["prepared"] = prepare_data(spec_for(pattern, workers=2), seed=0, report_dir=None,
                                            cache_dir=tmp_path / "cache", progress=False)

        worker = threading.Thread(target=prepare_again, daemon=True)
        worker.start()
        worker.join(90)
        assert not worker.is_alive(), "prepare blocked on the dataset lock after its previous holder was killed"
        assert done["prepared"].train_index.is_file()
    finally:
        tree.kill_all()


def test_temporary_files_of_an_interrupted_preparation_are_removed(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=12)
    spec = spec_for(str(corpus / "*.txt"))
    whole = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "cache", progress=False)
    dataset = whole.dataset_dir
    # What a kill mid-write leaves: a half shard, a half chunk, a half tokenizer, a half clean part
    # (its writer gone), and the dataset not marked complete.
    (dataset / "prepared.json").unlink()
    (dataset / ".train_00000.bin.tmp-999999").write_bytes(b"RYTOK")
    (dataset / "work").mkdir()
    (dataset / "work" / ".train_000000000_000000004.npz.tmp-999999").write_bytes(b"PK")
    (dataset / ".tokenizer.json.tmp").write_text("{")
    clean_dir = tmp_path / "cache" / "steps" / "clean"
    (clean_dir / ".abc.npz.tmp-999999").write_bytes(b"PK")
    live_writer = clean_dir / f".def.npz.tmp-{os.getpid()}"  # a writer that is alive: left alone
    live_writer.write_bytes(b"PK")
    again = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "cache", progress=False)
    assert again.fingerprint == whole.fingerprint
    leftovers = sorted(p.name for p in (tmp_path / "cache").rglob("*tmp*"))
    assert leftovers == [live_writer.name]

"""Each process's CPU threads (runyard/system/cpus.py): the spec's, else $OMP_NUM_THREADS, else the cores this
process may use (affinity capped by a cgroup CPU quota) shared among the node's workers."""

from __future__ import annotations

import os
from pathlib import Path

from runyard.system.cpus import affinity_cores, choose_threads, cpu_quota, local_processes, usable_cores
from runyard.train.launch import worker_threads


def _cgroup_v2(root: Path, own: str, limits: dict[str, str]) -> Path:
    """A cgroup v2 tree under `root` with this process in `own`; `limits` maps a cgroup path to cpu.max."""
    (root / "cgroup.controllers").parent.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / own.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for path, value in limits.items():
        (root / path.lstrip("/") / "cpu.max").write_text(value + "\n")
    proc = root.parent / "proc-cgroup"
    proc.write_text(f"0::{own}\n")
    return proc


def test_the_tightest_v2_quota_of_a_cgroup_and_its_parents(tmp_path):
    root = tmp_path / "fs"
    proc = _cgroup_v2(root, "/job/step", {"/job/step": "max 100000", "/job": "150000 100000"})
    assert cpu_quota(root, proc) == 1.5
    assert usable_cores(root, proc) == min(affinity_cores(), 2)  # rounded up, never above the affinity
    proc = _cgroup_v2(tmp_path / "open", "/job", {"/job": "max 100000"})
    assert cpu_quota(tmp_path / "open", proc) is None
    assert usable_cores(tmp_path / "open", proc) == affinity_cores()


def test_a_v1_cfs_quota(tmp_path):
    root = tmp_path / "fs"
    (root / "cpu" / "job").mkdir(parents=True)
    (root / "cpu" / "job" / "cpu.cfs_quota_us").write_text("50000\n")
    (root / "cpu" / "job" / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # the root: no limit
    proc = tmp_path / "proc-cgroup"
    proc.write_text("4:memory:/job\n3:cpu,cpuacct:/job\n")  # cpu mounted with cpuacct, as systemd does
    assert cpu_quota(root, proc) == 0.5 and usable_cores(root, proc) == 1  # half a CPU still gets a thread
    proc.write_text("4:memory:/job\n")  # no cpu controller: nothing limits it
    assert cpu_quota(root, proc) is None


def test_the_order_spec_then_environment_then_the_cores_shared_among_workers(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads(5, 1).to_dict() == {"threads": 5, "source": "resources.threads"}
    assert choose_threads(None, 1).to_dict() == {"threads": 3, "source": "OMP_NUM_THREADS"}
    monkeypatch.delenv("OMP_NUM_THREADS")
    cores = usable_cores()
    alone = choose_threads(None, 1)
    assert alone.threads == cores and f"the {cores} usable core" in alone.source and "1 local process" in alone.source
    assert choose_threads(None, 2).threads == max(1, cores // 2)
    assert choose_threads(None, cores * 4).threads == 1  # more workers than cores: one thread each
    monkeypatch.setenv("OMP_NUM_THREADS", "zero")  # not a number: the default applies
    assert choose_threads(None, 1).threads == cores


def test_local_workers_are_torchruns(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_processes() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_processes() == 4
    assert usable_cores() <= (os.cpu_count() or 1)


def test_torchrun_workers_split_the_jobs_threads_rather_than_each_taking_them_all(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # what the control plane gives a job of four CPU slots
    assert (worker_threads(1), worker_threads(2), worker_threads(3), worker_threads(8)) == (4, 2, 1, 1)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert worker_threads(2) == max(1, usable_cores() // 2)

"""A finished lease's folder goes after its retention time; its record stays; nothing else is touched."""

from __future__ import annotations

import json

from runyard.control.lease_retention import remove_expired_folders


def _lease(agent_dir, lease_id, **record):
    folder = agent_dir / f"lease-{lease_id}"
    (folder / "run" / "checkpoints").mkdir(parents=True)
    (folder / "run" / "checkpoints" / "step_1.safetensors").write_bytes(b"x" * 1024)
    full = {"lease_id": lease_id, "folder": str(folder), **record}
    (agent_dir / f"lease-{lease_id}.json").write_text(json.dumps(full))
    return folder


def test_only_folders_of_leases_finished_past_their_retention_are_removed(tmp_path):
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    old = _lease(agent_dir, 1, finished=True, finished_at=1_000.0)
    recent = _lease(agent_dir, 2, finished=True, finished_at=9_500.0)
    running = _lease(agent_dir, 3, finished=False)
    assert remove_expired_folders(agent_dir, keep_s=1_000.0, now=10_000.0) == [1]
    assert not old.exists() and recent.is_dir() and running.is_dir()
    record = json.loads((agent_dir / "lease-1.json").read_text())
    assert record["folder_removed_at"] == 10_000.0 and record["finished"]  # the record stays
    assert remove_expired_folders(agent_dir, keep_s=1_000.0, now=10_001.0) == []  # once
    assert remove_expired_folders(agent_dir, keep_s=0.0, now=10_002.0) == [2]
    assert running.is_dir()


def test_a_record_naming_a_folder_outside_the_agents_own_removes_nothing(tmp_path):
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    elsewhere = tmp_path / "provider-data"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("the provider's")
    (agent_dir / "lease-5.json").write_text(json.dumps({"lease_id": 5, "folder": str(elsewhere), "finished": True,
                                                        "finished_at": 0.0}))
    (agent_dir / "lease-6.json").write_text("{half a rec")  # torn: skipped, not a reason to delete
    assert remove_expired_folders(agent_dir, keep_s=0.0, now=1.0) == [5]
    assert (elsewhere / "keep.txt").read_text() == "the provider's"

"""Checkpoints are atomic, checksummed, retained by policy; a corrupt one is refused and skipped."""

from __future__ import annotations

import json

import pytest
import torch

from runyard.errors import CheckpointCorrupt
from runyard.fsutil import sha256_file
from runyard.train import checkpoint as ckpt


def write(root, step, value=1.0):
    return ckpt.write_checkpoint(root, step, {"model": {"w": torch.full((4, 4), value)}}, {"note": "x"})


def test_roundtrip_is_exact(tmp_path):
    weights = {"w": torch.randn(8, 8), "b": torch.arange(5)}
    path = ckpt.write_checkpoint(tmp_path, 7, {"model": weights}, {"loader": {"pos": 3}})
    tensors, state = ckpt.read_checkpoint(path)
    assert state["step"] == 7 and state["loader"] == {"pos": 3}
    assert all(torch.equal(tensors["model"][k], weights[k]) for k in weights)
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "no_manifest"])
def test_corrupt_checkpoint_is_refused_and_previous_used(tmp_path, damage):
    write(tmp_path, 10, 1.0)
    newest = write(tmp_path, 20, 2.0)
    target = newest / "model.pt"
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "delete":
        target.unlink()
    else:
        (newest / ckpt.MANIFEST).unlink()
    with pytest.raises(CheckpointCorrupt) as info:
        ckpt.read_checkpoint(newest)
    assert str(newest) in str(info.value)
    good = ckpt.latest_good(tmp_path)
    assert good is not None and good.step == 10
    tensors, _ = ckpt.read_checkpoint(good.path)
    assert torch.equal(tensors["model"]["w"], torch.full((4, 4), 1.0))


def test_manifest_path_escape_is_refused(tmp_path):
    path = write(tmp_path, 1)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["files"]["../../etc/passwd"] = {"sha256": "0", "bytes": 1}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorrupt, match="outside the checkpoint"):
        ckpt.verify_checkpoint(path)


def test_failed_write_leaves_previous_intact(tmp_path):
    write(tmp_path, 1, 1.0)

    class Unsaveable:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        ckpt.write_checkpoint(tmp_path, 2, {"model": {"w": Unsaveable()}}, {})
    assert [r.step for r in ckpt.list_checkpoints(tmp_path)] == [1]
    assert not list(tmp_path.glob(".tmp-*"))


def test_retention_keeps_last_k_and_best(tmp_path):
    for step in (10, 20, 30, 40, 50):
        write(tmp_path, step)
    (tmp_path / ".tmp-step_00000060-dead").mkdir()  # a crashed write
    ckpt.apply_retention(tmp_path, keep_last=2, best_step=20)
    assert [r.step for r in ckpt.list_checkpoints(tmp_path)] == [20, 40, 50]
    assert not list(tmp_path.glob(".tmp-*"))


def test_weights_only_load_refuses_pickled_code(tmp_path):
    path = write(tmp_path, 1)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"x": Evil()}, path / "model.pt")
    # Re-sign the manifest so only weights_only stands between the file and code execution.
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["files"]["model.pt"] = {"sha256": sha256_file(path / "model.pt"), "bytes": (path / "model.pt").stat().st_size}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        ckpt.read_checkpoint(path)


def test_manifest_from_sha256_era_still_verifies_and_detects_damage(tmp_path):
    path = write(tmp_path, 3)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    for rel, meta in manifest["files"].items():
        manifest["files"][rel] = {"sha256": sha256_file(path / rel), "bytes": meta["bytes"]}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    ckpt.verify_checkpoint(path)
    data = bytearray((path / "model.pt").read_bytes())
    data[10] ^= 1
    (path / "model.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="fails its sha256 checksum"):
        ckpt.verify_checkpoint(path)


def test_resaving_a_step_never_leaves_it_without_a_checkpoint(tmp_path, monkeypatch):
    write(tmp_path, 5, 1.0)
    real_rename = ckpt.os.rename
    calls = []

    def crash_on_install(src, dst):
        calls.append((src, dst))
        if str(src).endswith(".tmp-step_00000005") or ".tmp-step_00000005-" in str(src):
            raise KeyboardInterrupt("killed between setting the old checkpoint aside and installing the new")
        return real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", crash_on_install)
    with pytest.raises(KeyboardInterrupt):
        write(tmp_path, 5, 2.0)
    monkeypatch.setattr(ckpt.os, "rename", real_rename)
    assert not (tmp_path / "step_00000005").exists(), "the crash hit after the old one was set aside"
    ref = ckpt.latest_good(tmp_path)  # recovers the set-aside checkpoint
    assert ref is not None and ref.step == 5
    assert torch.equal(ckpt.read_checkpoint(ref.path)[0]["model"]["w"], torch.full((4, 4), 1.0))
    # A replacement that completes leaves only the new checkpoint.
    write(tmp_path, 5, 3.0)
    assert torch.equal(ckpt.read_checkpoint(tmp_path / "step_00000005")[0]["model"]["w"], torch.full((4, 4), 3.0))
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000005"]

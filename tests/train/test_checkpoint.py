"""Checkpoints are atomic, checksummed, retained by policy; a corrupt one is refused and skipped."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from runyard.errors import CheckpointCorrupt
from runyard.model.config import ModelConfig
from runyard.model.transformer import Transformer
from runyard.system.files import sha256_file
from runyard.train import checkpoint as ckpt
from runyard.train.checkpoint import store, tensorfile
from runyard.train.checkpoint.checksums import CHECKSUM
from runyard.train.checkpoint.parallel_read import file_checksum
from runyard.train.checkpoint.tree import UnstorableState
from runyard.train.parallel import DistContext
from runyard.train.rng import capture_rng


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
    target = newest / "model.safetensors"
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


def test_failed_write_leaves_previous_intact(tmp_path, monkeypatch):
    write(tmp_path, 1, 1.0)
    real_write = tensorfile.HashingFile.write

    def fail_midway(self, data):
        if self.nbytes > 0:  # the header is down; the tensor bytes are not
            raise RuntimeError("disk full")
        return real_write(self, data)

    monkeypatch.setattr(tensorfile.HashingFile, "write", fail_midway)
    with pytest.raises(RuntimeError):
        ckpt.write_checkpoint(tmp_path, 2, {"model": {"w": torch.ones(4, 4)}}, {})
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
    data = bytearray((path / "model.safetensors").read_bytes())
    data[10] ^= 1
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="fails its sha256 checksum"):
        ckpt.verify_checkpoint(path)


def test_resaving_a_step_never_leaves_it_without_a_checkpoint(tmp_path, monkeypatch):
    write(tmp_path, 5, 1.0)
    real_rename = store.os.rename
    calls = []

    def crash_on_install(src, dst):
        calls.append((src, dst))
        if str(src).endswith(".tmp-step_00000005") or ".tmp-step_00000005-" in str(src):
            raise KeyboardInterrupt("killed between setting the old checkpoint aside and installing the new")
        return real_rename(src, dst)

    monkeypatch.setattr(store.os, "rename", crash_on_install)
    with pytest.raises(KeyboardInterrupt):
        write(tmp_path, 5, 2.0)
    monkeypatch.setattr(store.os, "rename", real_rename)
    assert not (tmp_path / "step_00000005").exists(), "the crash hit after the old one was set aside"
    ref = ckpt.latest_good(tmp_path)  # recovers the set-aside checkpoint
    assert ref is not None and ref.step == 5
    assert torch.equal(ckpt.read_checkpoint(ref.path)[0]["model"]["w"], torch.full((4, 4), 1.0))
    # A replacement that completes leaves only the new checkpoint.
    write(tmp_path, 5, 3.0)
    assert torch.equal(ckpt.read_checkpoint(tmp_path / "step_00000005")[0]["model"]["w"], torch.full((4, 4), 3.0))
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000005"]


# -- the format: safetensors-layout files, nested state without pickle -------------------------------------
def tiny_training_state(tie: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32,
                      context_length=8, tie_embeddings=tie)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-2, betas=(0.9, 0.95))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return ckpt.TrainingState(model, opt, Position())


class Position:
    def __init__(self, position: int = 0):
        self.position = position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


CPU_CTX = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_optimizer_state_round_trips_with_its_types(tmp_path):
    state = tiny_training_state()
    saved = state.optimizer.state_dict()
    path = ckpt.write_checkpoint(tmp_path, 1, {"optimizer": saved}, {})
    loaded = ckpt.read_checkpoint(path)[0]["optimizer"]
    assert sorted(loaded["state"]) == sorted(saved["state"]) and all(isinstance(k, int) for k in loaded["state"])
    for k, per_param in saved["state"].items():
        for name, value in per_param.items():
            assert torch.equal(loaded["state"][k][name], value) and loaded["state"][k][name].dtype == value.dtype
    assert loaded["param_groups"] == saved["param_groups"]
    assert isinstance(loaded["param_groups"][0]["betas"], tuple)


def test_model_file_is_an_ordinary_safetensors_state_dict_with_tied_weights_once(tmp_path):
    state = tiny_training_state(tie=True)
    path = ckpt.save(state, tmp_path / "checkpoints", 3, {"note": "x"}, CPU_CTX)
    on_disk = load_file(str(path / "model.safetensors"))  # the safetensors library itself reads it
    live = state.model.state_dict()
    assert "lm_head.weight" not in on_disk and set(on_disk) == set(live) - {"lm_head.weight"}
    weights = ckpt.read_model_weights(path)
    assert weights.keys() == live.keys() and all(torch.equal(weights[k], live[k]) for k in live)
    row = json.loads((tmp_path / ckpt.CHECKPOINT_LOG).read_text().splitlines()[-1])
    assert row["step"] == 3 and row["mode"] == "sync" and row["bytes"] > 0


def test_checksums_taken_while_writing_match_the_files(tmp_path):
    path = ckpt.save(tiny_training_state(), tmp_path, 1, {}, CPU_CTX)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"]
    for rel, meta in manifest["files"].items():
        assert meta[CHECKSUM] == file_checksum(path / rel, CHECKSUM) and meta["bytes"] == (path / rel).stat().st_size


def test_a_value_that_is_not_plain_data_is_refused_where_it_is(tmp_path):
    with pytest.raises(UnstorableState, match=r"state at state\.layer\.w is a object"):
        ckpt.write_checkpoint(tmp_path, 1, {"model": {"state": {"layer": {"w": object()}}}}, {})
    assert not list(tmp_path.iterdir())


def test_a_format_1_checkpoint_still_resumes(tmp_path):
    """Run directories written before the safetensors layout (torch.save files, RNG JSON in state.json)
    keep resuming."""
    state = tiny_training_state()
    torch.manual_seed(42)
    rng_tensors, rng_json = capture_rng()
    expected_draw = torch.rand(3)
    tmp = tmp_path / ".tmp-step_00000007-legacy"
    tmp.mkdir()
    torch.save(state.model.state_dict(), tmp / "model.pt")
    torch.save(state.optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_tensors, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"format": 1, "step": 7, "loader": {"position": 5}, "rng": rng_json}))
    store.commit(tmp, tmp_path / "step_00000007", 7)

    fresh = tiny_training_state(seed=1)
    restored = ckpt.load(fresh, tmp_path, CPU_CTX)
    assert restored.step == 7 and fresh.loader.position == 5
    assert torch.equal(torch.rand(3), expected_draw), "RNG restored"
    for k, v in state.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[k], v), k
    assert torch.equal(fresh.optimizer.state_dict()["state"][0]["exp_avg"], state.optimizer.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize("tp", [1, 2])
def test_a_rank_restores_the_random_stream_of_its_tensor_parallel_group(tmp_path, tp):
    """Rank 1 of a job resuming a one-process checkpoint: under tp 2 it shares rank 0's tensor-parallel group,
    so it draws what rank 0 draws (dropout on activations both hold whole); with tp 1 it gets its own stream."""
    saved = tiny_training_state()
    torch.manual_seed(123)
    path = ckpt.save(saved, tmp_path / "checkpoints", 3, {}, CPU_CTX)
    expected = torch.rand(4)
    rank1 = DistContext(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"), tp=tp)
    ckpt.load_from(tiny_training_state(seed=1), path, rank1)
    assert torch.equal(torch.rand(4), expected) == (tp == 2)


# -- loading: straight into the live tensors, checked while read -------------------------------------------
def test_a_one_process_load_reads_into_the_live_tensors_and_restores_them_exactly(tmp_path):
    saved = tiny_training_state()
    path = ckpt.save(saved, tmp_path, 1, {}, CPU_CTX)
    want_model = {k: v.clone() for k, v in saved.model.state_dict().items()}
    want_optim = {k: {n: t.clone() for n, t in s.items()} for k, s in saved.optimizer.state_dict()["state"].items()}

    live = tiny_training_state(seed=1)  # other values, same layout: its optimizer already holds state
    params = {n: p.data_ptr() for n, p in live.model.named_parameters()}
    moments = {k: s["exp_avg"].data_ptr() for k, s in live.optimizer.state_dict()["state"].items()}
    ckpt.load_from(live, path, CPU_CTX)

    loaded = live.model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in want_model.items())
    assert loaded["lm_head.weight"].data_ptr() == loaded["tok_emb.weight"].data_ptr(), "tied weights stay tied"
    state = live.optimizer.state_dict()["state"]
    assert all(torch.equal(state[k][n], t) for k, s in want_optim.items() for n, t in s.items())
    assert {n: p.data_ptr() for n, p in live.model.named_parameters()} == params, "no parameter replaced"
    assert {k: s["exp_avg"].data_ptr() for k, s in state.items()} == moments, "no optimizer moment replaced"

    fresh = tiny_training_state(seed=2)
    fresh.optimizer.state.clear()  # a run resuming from scratch holds no optimizer state yet
    ckpt.load_from(fresh, path, CPU_CTX)
    assert all(torch.equal(fresh.optimizer.state_dict()["state"][k][n], t) for k, s in want_optim.items()
               for n, t in s.items())


def test_a_byte_flipped_after_verification_is_caught_while_loading(tmp_path):
    path = ckpt.save(tiny_training_state(), tmp_path, 1, {}, CPU_CTX)
    ckpt.verify_checkpoint(path)
    target = path / "optimizer.safetensors"
    data = bytearray(target.read_bytes())
    data[-5] ^= 0x01  # inside the last tensor's bytes: the size and the header stay valid
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=rf"optimizer\.safetensors fails its {CHECKSUM} checksum"):
        ckpt.load_from(tiny_training_state(seed=1), path, CPU_CTX)


@pytest.mark.parametrize("damage", ["header", "offsets", "trailing"])
def test_a_malformed_tensor_file_is_refused_by_name(tmp_path, damage):
    target = tmp_path / "t.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.bfloat16)}, str(target))
    tensors, _ = tensorfile.read_tensors(target)  # the safetensors library's own file reads back
    assert torch.equal(tensors["a"], torch.arange(6.0)) and tensors["b"].dtype == torch.bfloat16
    raw = target.read_bytes()
    head_len = int.from_bytes(raw[:8], "little")
    if damage == "header":
        raw = raw[:8] + b"[" + raw[9:]  # not a JSON object
    elif damage == "offsets":
        raw = raw[: 8 + head_len].replace(b"[0,24]", b"[0,20]").replace(b"[24,36]", b"[20,32]") + raw[8 + head_len :]
    else:
        raw += b"\0" * 8
    target.write_bytes(raw)
    with pytest.raises(CheckpointCorrupt, match=str(target)):
        tensorfile.read_tensors(target)

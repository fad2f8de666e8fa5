"""Sharded checkpoints and world-size arithmetic, in one process (no process group): the same code the
distributed loop runs, with real files, a real model, optimizer and token loader."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from runyard.data.loader import TokenLoader
from runyard.data.shards import ShardWriter, write_index
from runyard.model.compute import forward_backward
from runyard.model.transformer import ModelConfig, Transformer
from runyard.train import checkpoint as ckpt
from runyard.train import parallel
from runyard.train.checkpoint import dcp_storage, sharded, store
from runyard.train.loop import TrainSetup
from runyard.train.rng import capture_rng

CPU = torch.device("cpu")
CTX = parallel.DistContext(rank=0, world_size=1, local_rank=0, device=CPU)


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tokens")
    writer = ShardWriter(root, "train", 4096, np.dtype(np.uint16))
    tokens = np.random.default_rng(0).integers(0, 97, 20000).astype(np.uint16)
    writer.add_tokens(tokens, np.array([10000, 10000]))
    write_index(root / "index.json", writer.finish(), dtype=np.dtype(np.uint16), vocab_size=97, eos_id=0,
                shard_tokens=4096, num_documents=2)
    return root / "index.json"


def make_setup(index: Path, seed: int = 0) -> TrainSetup:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                      context_length=16, dropout=0.1)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-2)
    loader = TokenLoader(index, seq_len=16, batch_size=4, seed=3)
    return TrainSetup(model, model, cfg, opt, loader)


def train_steps(setup: TrainSetup, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        x, y = setup.loader.next_batch()
        losses.append(float(forward_backward(setup.model, x, y, 1.0 / y.numel(), CPU, "fp32")))
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("use_async", [True, False], ids=["async", "sync"])
def test_sharded_checkpoint_resumes_bitwise(index, tmp_path, use_async):
    tmp_path = tmp_path / "checkpoints"
    """Save in the sharded format at step 3, keep training to step 6; a fresh setup loaded from the
    checkpoint trains steps 4-6 to the same losses and bitwise the same weights (dropout included)."""
    torch.set_num_threads(1)
    a = make_setup(index)
    train_steps(a, 3)
    ckpt.save(a.state, tmp_path, 3, {"world_size": 1, "grad_accum": 1}, CTX, wait=True, sharded_format=True,
              use_async=use_async)
    path = tmp_path / ckpt.step_dir_name(3)
    assert ckpt.is_sharded(path) and (path / "rng" / "rank_00000.safetensors").is_file()
    manifest = ckpt.verify_checkpoint(path)
    assert any(name.startswith("dcp/") for name in manifest["files"])
    rows = [json.loads(line) for line in (tmp_path.parent / ckpt.CHECKPOINT_LOG).read_text().splitlines()]
    assert rows[-1]["step"] == 3 and rows[-1]["stall_s"] >= 0 and rows[-1]["bytes"] > 0
    expected = train_steps(a, 3)

    b = make_setup(index, seed=1)  # other initial weights: all must come from the checkpoint
    state = ckpt.load(b.state, tmp_path, CTX).values
    assert state["step"] == 3 and b.loader.position == 3 * 4
    assert train_steps(b, 3) == expected
    for (name, pa), (_, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("writer_held", [True, False], ids=["copied-at-the-step", "written-as-it-comes"])
def test_an_async_save_overlapped_with_training_holds_the_saved_step(index, tmp_path, monkeypatch, writer_held):
    """An async sharded save returns before its write and training goes on at once: parameters and
    optimizer state are written from the live tensors until the optimizer's next step, which first copies
    what is not written yet. Held: the writer starts only after that step, so every tensor is written from
    its copy. Either way the checkpoint resumes bitwise at the saved step."""
    torch.set_num_threads(1)
    go = threading.Event()
    if writer_held:
        write_state = sharded.tensorfile.write_state  # the rank's RNG file, written just before its shards

        def held(*args, **kwargs):
            assert go.wait(60)
            return write_state(*args, **kwargs)

        monkeypatch.setattr(sharded.tensorfile, "write_state", held)
    else:
        go.set()
    a = make_setup(index)
    train_steps(a, 3)
    ckpt.save(a.state, tmp_path, 3, {"world_size": 1, "grad_accum": 1}, CTX, sharded_format=True, use_async=True)
    expected = train_steps(a, 1)  # its optimizer step changes the tensors the save holds
    go.set()
    expected += train_steps(a, 2)
    ckpt.wait_pending()

    b = make_setup(index, seed=1)
    assert ckpt.load(b.state, tmp_path, CTX).values["step"] == 3
    assert train_steps(b, 3) == expected
    for (name, pa), (_, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name


def test_read_checkpoint_consolidates_a_sharded_model(index, tmp_path):
    a = make_setup(index)
    train_steps(a, 1)
    ckpt.save(a.state, tmp_path, 1, {}, CTX, wait=True, sharded_format=True)
    tensors, state = ckpt.read_checkpoint(tmp_path / ckpt.step_dir_name(1))
    assert state["step"] == 1
    live = a.model.state_dict()
    assert tensors["model"].keys() == live.keys()
    assert all(torch.equal(tensors["model"][k], live[k]) for k in live)


def test_truncated_shard_falls_back_to_the_previous_checkpoint(index, tmp_path, caplog):
    a = make_setup(index)
    for step in (1, 2):
        train_steps(a, 1)
        ckpt.save(a.state, tmp_path, step, {}, CTX, wait=True, sharded_format=True)
    shard = next((tmp_path / ckpt.step_dir_name(2) / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    with caplog.at_level("WARNING"):
        ref = ckpt.latest_good(tmp_path)
    assert ref.step == 1
    assert "manifest says" in caplog.text and "falling back" in caplog.text


def test_single_file_checkpoint_loads_through_the_name_keyed_path(index, tmp_path):
    """A one-process checkpoint (numbered optimizer state) restored through set_state_dict, the path
    a job that grew from 1 to N processes takes."""
    a = make_setup(index)
    train_steps(a, 2)
    ckpt.save(a.state, tmp_path, 2, {}, CTX)
    expected = train_steps(a, 2)
    b = make_setup(index, seed=1)
    ckpt.load(b.state, tmp_path, CTX)
    assert train_steps(b, 2) == expected


@pytest.mark.parametrize(
    ("saved_world", "saved_accum", "world", "expected"),
    [(2, 1, 1, 2), (1, 2, 2, 1), (2, 3, 3, 2), (2, 1, 3, 1), (1, 1, 1, 1)],
)
def test_grad_accum_keeps_the_global_batch_when_it_divides(saved_world, saved_accum, world, expected):
    ctx = parallel.DistContext(rank=0, world_size=world, local_rank=0, device=CPU)
    assert parallel.grad_accum_for(1, 4, ctx, {"world_size": saved_world, "grad_accum": saved_accum}) == expected
    assert parallel.grad_accum_for(5, 4, ctx, None) == 5


def test_tensor_chunks_are_raw_memory_and_dcp_stock_reader_refuses_them(index, tmp_path):
    a = make_setup(index)
    train_steps(a, 1)
    path = ckpt.save(a.state, tmp_path, 1, {}, CTX, wait=True, sharded_format=True)
    shard = next((path / "dcp").glob("*.distcp")).read_bytes()
    weight = a.model.tok_emb.weight.detach().contiguous().numpy().tobytes()
    assert weight in shard, "the embedding's bytes are in the shard as they are in memory"
    sd = {"model": {"tok_emb.weight": torch.empty_like(a.model.tok_emb.weight)}}
    with pytest.raises(CheckpointException, match="Unknown extension name='raw@runyard'"):  # never misread
        dcp.load(sd, checkpoint_id=str(path / "dcp"), no_dist=True)


@pytest.mark.parametrize("gap", [dcp_storage._GAP, -1], ids=["one-read-a-file", "one-read-a-value"])
def test_non_tensor_values_are_json_and_come_back_with_their_types(index, tmp_path, monkeypatch, gap):
    """An optimizer group's values (floats, a tuple of betas, bools, None) are stored as JSON, marked so that
    DCP's stock reader refuses them, and a sharded load gives back the same values with the same types,
    whether a file's values are read in one call (they lie together) or one by one."""
    monkeypatch.setattr(dcp_storage, "_GAP", gap)
    reads = []
    pread = dcp_storage.pread_exactly
    monkeypatch.setattr(dcp_storage, "pread_exactly", lambda fd, buf, offset, where: (reads.append(where),
                                                                                        pread(fd, buf, offset, where)))
    a = make_setup(index)
    train_steps(a, 1)
    path = ckpt.save(a.state, tmp_path, 1, {}, CTX, wait=True, sharded_format=True)
    metadata = FileSystemReader(str(path / "dcp")).read_metadata()
    marks = {k.fqn: v.transform_descriptors for k, v in metadata.storage_data.items()}
    betas = next(k for k in marks if k.endswith(".betas"))
    assert marks[betas] == [dcp_storage.JSON]
    b = make_setup(index, seed=1)
    b.optimizer.param_groups[0]["betas"] = (0.5, 0.5)
    b.optimizer.param_groups[0]["lr"] = 123.0
    ckpt.load_from(b.state, path, CTX)
    want, got = a.optimizer.state_dict()["param_groups"], b.optimizer.state_dict()["param_groups"]
    assert got == want and all(type(g[k]) is type(w[k]) for g, w in zip(got, want, strict=True) for k in w)
    assert isinstance(got[0]["betas"], tuple)
    value_reads = [w for w in reads if "values from byte" in w]
    n_values = sum(1 for m in marks.values() if m == [dcp_storage.JSON])
    assert len(value_reads) == (1 if gap >= 0 else n_values) and n_values > 10


def test_a_sharded_checkpoint_written_by_stock_dcp_still_resumes(index, tmp_path):
    """Sharded checkpoints written before the raw storage layer (torch.save chunks, RNG in .pt/.json)."""
    a = make_setup(index)
    train_steps(a, 2)
    tmp = tmp_path / ".tmp-step_00000002-stock"
    model_sd, optim_sd = get_state_dict(a.model, a.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"), no_dist=True)
    tensors, plain_values = capture_rng()
    (tmp / "rng").mkdir()
    torch.save(tensors, tmp / "rng" / "rank_00000.pt")
    (tmp / "rng" / "rank_00000.json").write_text(json.dumps(plain_values))
    (tmp / "state.json").write_text(json.dumps({"format": 1, "step": 2, "loader": a.loader.state_dict()}))
    store.commit(tmp, tmp_path / ckpt.step_dir_name(2), 2, sharded=True)
    expected = train_steps(a, 2)

    b = make_setup(index, seed=1)
    assert ckpt.load(b.state, tmp_path, CTX).step == 2
    assert train_steps(b, 2) == expected
    weights = ckpt.read_model_weights(tmp_path / ckpt.step_dir_name(2))
    assert weights.keys() == a.model.state_dict().keys()

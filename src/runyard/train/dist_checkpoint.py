"""Sharded checkpoints through torch.distributed.checkpoint (DCP), saved asynchronously.

Layout of a distributed checkpoint `step_00000123/` (same commit rules as train/checkpoint.py):

    dcp/.metadata, dcp/__<rank>_0.distcp   model + optimizer, each rank writing its own shards
    rng/rank_00000.pt, rng/rank_00000.json  every rank's RNG state (dropout stays bitwise on resume)
    state.json                             step, loader position and the loop's extra values (rank 0)
    MANIFEST.json                          checksum and size of every file, written last by rank 0

Every rank writes into the same hidden `.tmp-step_...` directory. DCP's last step gathers every rank's
write results to rank 0, which writes `.metadata`: when rank 0's save completes, all shards are down.
Rank 0 then checksums everything, writes the manifest, and renames the directory into place, so
`checkpoint.verify_checkpoint` / `latest_good` treat sharded and single-file checkpoints alike.

Async: the training loop only waits while the state is copied to CPU memory (the stall, logged per
checkpoint in `stages/<stage>/checkpoints.jsonl`); writing, checksumming and committing happen on a
background thread. One save is in flight at a time.

Loading reshards: a checkpoint written by N ranks (sharded) or by one process (single-file) loads onto
any world size, DDP or FSDP, with its optimizer state.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from runyard.errors import RunyardError
from runyard.train import checkpoint as ckpt
from runyard.train.rng import capture_rng, derive_seed, restore_rng

log = logging.getLogger(__name__)

DCP_DIR = "dcp"
RNG_DIR = "rng"
CHECKPOINT_LOG = "checkpoints.jsonl"
ASYNC_DEFAULT = True


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner unpickles non-tensor values with weights_only=False; ours refuses code objects."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class _SafeEmptyPlanner(_EmptyStateDictLoadPlanner):
    def load_bytes(self, read_item, value) -> None:
        _SafeLoadPlanner.load_bytes(self, read_item, value)


def is_sharded(path: Path) -> bool:
    return (path / DCP_DIR / ".metadata").is_file()


def log_checkpoint(ckpt_dir: Path, row: dict) -> None:
    """One line per checkpoint beside metrics.jsonl: its stall on the training loop and write time."""
    with open(ckpt_dir.parent / CHECKPOINT_LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- single process ------------------------------------------------------------------------------------
def save_single(save_fn, setup, ckpt_dir: Path, step: int, extra: dict, retain=None) -> Path:
    """The one-process format (train/checkpoint.py), written synchronously; its stall is logged too."""
    t0 = time.perf_counter()
    path = save_fn(setup, ckpt_dir, step, extra)
    stall = time.perf_counter() - t0
    if retain is not None:
        retain()
    log_checkpoint(ckpt_dir, {"step": step, "mode": "sync", "world_size": 1, "stall_s": stall,
                              "write_s": stall, "bytes": _tree_bytes(path)})
    return path


# -- the save in flight ----------------------------------------------------------------------------------
class _Pending:
    """The one checkpoint being written in the background on this rank."""

    def __init__(self, future: Future, step: int):
        self.future, self.step = future, step


_pending: _Pending | None = None
_pending_lock = threading.Lock()
_committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runyard-ckpt-commit")


def wait_pending(raise_errors: bool = True) -> None:
    """Block until the checkpoint in flight (if any) is written and, on rank 0, committed."""
    global _pending
    with _pending_lock:
        pending, _pending = _pending, None
    if pending is None:
        return
    try:
        pending.future.result()
    except Exception as exc:
        if raise_errors:
            raise RunyardError(f"checkpoint of step {pending.step} could not be written: {exc}") from exc
        log.warning("checkpoint of step %d was not completed: %s", pending.step, exc)


_stager = None


def _stager_for(device: torch.device):
    """One stager per process, kept: it copies the state into CPU buffers it allocated at the first save
    and reuses (a fresh allocation each time costs page faults, several times the copy itself)."""
    global _stager
    if _stager is None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = device.type == "cuda"
        _stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                               use_async_staging=False, use_non_blocking_copy=cuda))
    return _stager


def _write_rank_rng(tmp: Path, rank: int) -> None:
    tensors, json_state = capture_rng()
    rng_dir = tmp / RNG_DIR
    rng_dir.mkdir(parents=True, exist_ok=True)
    torch.save(tensors, rng_dir / f"rank_{rank:05d}.pt")
    (rng_dir / f"rank_{rank:05d}.json").write_text(json.dumps(json_state))


def commit(tmp: Path, final: Path, step: int) -> Path:
    """Rank 0, after the barrier: checksum every rank's files and install the sharded checkpoint."""
    return ckpt.commit(tmp, final, step, sharded=True)


def save_sharded(setup, ckpt_dir: Path, step: int, extra: dict, ctx, retain=None, wait: bool = False,
                 use_async: bool = ASYNC_DEFAULT) -> Path:
    """Every rank calls this at the same step. Returns the checkpoint's final path; it is committed in
    the background unless `wait` (then it is committed when this returns, on every rank)."""
    global _pending
    from runyard.train import parallel

    t0 = time.perf_counter()
    wait_pending()  # the previous save must be committed first; waiting for it is part of the stall
    token = parallel.broadcast_object(uuid.uuid4().hex[:8], ctx)
    final = ckpt_dir / ckpt.step_dir_name(step)
    tmp = ckpt_dir / f".tmp-{ckpt.step_dir_name(step)}-{token}"
    tmp.mkdir(parents=True, exist_ok=True)
    _write_rank_rng(tmp, ctx.rank)
    if ctx.is_main:
        state = {"format": ckpt.FORMAT_VERSION, "step": step, "loader": setup.loader.state_dict(), **extra}
        (tmp / ckpt.STATE).write_text(json.dumps(state, indent=1))
    model_sd, optim_sd = get_state_dict(setup.model, setup.optimizer)
    state_dict = {"model": model_sd, "optim": optim_sd}
    if use_async:
        write_future = dcp.async_save(state_dict, checkpoint_id=str(tmp / DCP_DIR), process_group=ctx.ckpt_group,
                                      no_dist=not ctx.distributed, async_stager=_stager_for(ctx.device))
    else:
        dcp.save(state_dict, checkpoint_id=str(tmp / DCP_DIR), process_group=ctx.ckpt_group,
                 no_dist=not ctx.distributed)
        write_future = Future()
        write_future.set_result(None)
    stall = time.perf_counter() - t0

    def finish() -> Path:
        write_future.result()
        if not ctx.is_main:
            return final
        commit(tmp, final, step)
        if retain is not None:
            retain()
        row = {"step": step, "mode": "async-sharded" if use_async else "sync-sharded",
               "world_size": ctx.world_size, "stall_s": stall, "write_s": time.perf_counter() - t0,
               "bytes": _tree_bytes(final)}
        log_checkpoint(ckpt_dir, row)
        log.info("checkpoint step %d committed: stall %.3fs, written in %.3fs", step, stall, row["write_s"])
        return final

    with _pending_lock:
        _pending = _Pending(_committer.submit(finish), step)
    if wait:
        wait_pending()
        parallel.barrier(ctx)  # every rank returns once rank 0 has committed
    return final


# -- loading -------------------------------------------------------------------------------------------
def _optimizer_by_name(legacy: dict, setup) -> dict:
    """A single-process optimizer state dict (parameters numbered in group order) keyed by parameter
    names instead, the form `set_state_dict` places onto DDP or FSDP shards."""
    names = {id(p): n for n, p in setup.model.named_parameters()}
    order = [names[id(p)] for g in setup.optimizer.param_groups for p in g["params"]]
    state = {order[int(i)]: v for i, v in legacy["state"].items()}
    groups = [{**g, "params": [order[int(i)] for i in g["params"]]} for g in legacy["param_groups"]]
    return {"state": state, "param_groups": groups}


def _restore_rank_rng(path: Path, rank: int, step: int) -> None:
    stem = path / RNG_DIR / f"rank_{rank:05d}"
    pt, js = stem.with_suffix(".pt"), stem.with_suffix(".json")
    if pt.is_file() and js.is_file():
        restore_rng(torch.load(pt, weights_only=True), json.loads(js.read_text()))
        return
    # A rank the saving job did not have (the world grew): a fresh stream, deterministic in (step, rank).
    from runyard.train.rng import seed_everything

    seed_everything(derive_seed(step, "rng", rank))


def load_any(setup, ref, ctx) -> dict:
    """Load a sharded or single-file checkpoint onto this job's world size and parallelism."""
    path: Path = ref.path
    state = json.loads((path / ckpt.STATE).read_text())
    if is_sharded(path):
        model_sd, optim_sd = get_state_dict(setup.model, setup.optimizer)
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, checkpoint_id=str(path / DCP_DIR), planner=_SafeLoadPlanner(),
                 process_group=ctx.ckpt_group, no_dist=not ctx.distributed)
        set_state_dict(setup.model, setup.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        _restore_rank_rng(path, ctx.rank, state["step"])
    else:
        model = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
        optim = _optimizer_by_name(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True), setup)
        set_state_dict(setup.model, setup.optimizer, model_state_dict=model, optim_state_dict=optim,
                       options=StateDictOptions(full_state_dict=True))
        if ctx.rank == 0:  # the one process that wrote it was rank 0
            restore_rng(torch.load(path / "rng.pt", weights_only=True), state["rng"])
        else:
            _restore_rank_rng(path, ctx.rank, state["step"])
    setup.loader.load_state_dict(state["loader"])
    return state


def read_full_state(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The whole model state dict of a sharded checkpoint, in this process alone (no collectives):
    for gates, export and tests. Returns {"model": {name: tensor}}."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, Any] = {}
    # dcp.load fills only the keys its argument already has; the low-level call builds them from metadata.
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        _load_state_dict(sd, storage_reader=dcp.FileSystemReader(str(path / DCP_DIR)),
                         planner=_SafeEmptyPlanner(keys={"model"}), no_dist=True)
    return {"model": {k: v.to(map_location) for k, v in sd["model"].items()}}

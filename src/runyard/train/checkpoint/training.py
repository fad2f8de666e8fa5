"""Saving and restoring a training run: the one `save` and one `load` the training loop calls.

A `TrainingState` names what a checkpoint holds; each part contributes its state_dict: the model, the
optimizer, the loader (its position: plain values) and this process's RNGs. One process writes the plain
format (plain.py), synchronously; several write the sharded format (sharded.py) through
torch.distributed.checkpoint, asynchronously: the loop waits only while the state is copied out of the
model (the stall, logged per checkpoint in `stages/<stage>/checkpoints.jsonl`), and rank 0 commits the
directory from a background thread once every rank's shards are down. One save is in flight at a time.

`load` picks the newest checkpoint that verifies (rank 0 decides and tells the others, so all load the
same one) and restores every part, whichever format and world size wrote it.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from runyard.errors import RunyardError
from runyard.spec.seeds import derive_seed
from runyard.system.collector import collector_paused
from runyard.train import parallel
from runyard.train.checkpoint import plain, sharded, store, tensorfile
from runyard.train.checkpoint.store import CheckpointRef
from runyard.train.parallel import DistContext
from runyard.train.rng import ProcessRNG, seed_everything
from runyard.train.tensor_parallel import fused_rows_of

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainingState:
    """The parts of a training run a checkpoint saves and restores. `model` is the model itself (FSDP
    shards it in place; a DDP wrapper is not it); `loader` has plain values only (its position)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loader: Stateful
    rng: Stateful = field(default_factory=ProcessRNG)


@dataclass(frozen=True)
class Retention:
    """Keep the newest `keep_last` checkpoints, and the one of `keep_step` (the best) if set."""

    keep_last: int
    keep_step: int | None = None

    def apply(self, root: Path) -> list[Path]:
        return store.apply_retention(root, self.keep_last, self.keep_step)


@dataclass(frozen=True)
class Restored:
    """What `load` resumed from: the checkpoint, and the plain values saved with it (`step`, the
    loop's own values such as `best_step`)."""

    ref: CheckpointRef
    values: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.values["step"])


# -- saving ------------------------------------------------------------------------------------------
def save(state: TrainingState, root: Path, step: int, values: dict[str, Any], ctx: DistContext, *,
         retention: Retention | None = None, wait: bool = False, sharded_format: bool | None = None,
         use_async: bool = True) -> Path:
    """Write the checkpoint of `step` under `root` and return its final path (committed when this
    returns, or soon after when an async save is in flight). `values` are plain values saved beside the
    state (read back by `load`). Retention runs on rank 0 after the commit. `wait` blocks until the
    commit on every rank (the last checkpoint of a stage, or before exiting on a signal).

    The format follows the world size unless `sharded_format` says otherwise; `use_async` applies to
    the sharded format (the plain one is written synchronously)."""
    if sharded_format is None:
        sharded_format = ctx.distributed
    if not sharded_format:
        if ctx.distributed:
            raise RunyardError("the plain checkpoint format is for one process; several write sharded")
        return _save_plain(state, root, step, values, retention)
    return _save_sharded(state, root, step, values, ctx, retention, wait, use_async)


def _save_plain(state: TrainingState, root: Path, step: int, values: dict, retention: Retention | None) -> Path:
    t0 = time.perf_counter()
    path = plain.write_checkpoint(
        root, step,
        parts={"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
               "rng": state.rng.state_dict()},
        state={"loader": state.loader.state_dict(), **values},
    )
    elapsed = time.perf_counter() - t0
    if retention is not None:
        retention.apply(root)
    store.log_checkpoint(root, {"step": step, "mode": "sync", "world_size": 1, "stall_s": elapsed,
                                "write_s": elapsed, "bytes": store.tree_bytes(path)})
    return path


class _Pending:
    """The one checkpoint being written in the background on this rank."""

    def __init__(self, future: Future, step: int):
        self.future, self.step = future, step


_pending: _Pending | None = None
_pending_lock = threading.Lock()
_committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runyard-ckpt-commit")


def wait_pending(raise_errors: bool = True) -> None:
    """Block until the checkpoint in flight (if any) is written and, on rank 0, committed. With
    `raise_errors=False` (cleaning up after another error) a failed save is logged, not raised."""
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


def _save_sharded(state: TrainingState, root: Path, step: int, values: dict, ctx: DistContext,
                  retention: Retention | None, wait: bool, use_async: bool) -> Path:
    """Every rank calls this at the same step."""
    global _pending
    t0 = time.perf_counter()
    wait_pending()  # the previous save must be committed first; waiting for it is part of the stall
    token = parallel.broadcast_object(uuid.uuid4().hex[:8], ctx)
    final = root / store.step_dir_name(step)
    tmp = store.staging_dir(root, step, token)
    # The plain values as they are now (a JSON copy), written with the commit: their fsync is off the stall.
    plain_values = json.loads(json.dumps({"loader": state.loader.state_dict(), **values})) if ctx.is_main else {}
    with collector_paused():  # DCP's plans are many objects: no full collection inside the stall
        shards = sharded.write_shards(state.model, state.optimizer, state.rng.state_dict(), tmp, ctx, use_async)
    stall = time.perf_counter() - t0

    def finish() -> Path:
        try:
            files = shards.result()
            if not ctx.is_main:
                return final
            files[store.STATE] = store.write_state_json(tmp, step, plain_values)
            store.commit(tmp, final, step, files, sharded=True)
        except BaseException:
            if ctx.is_main:  # every rank's write has ended (DCP raised on all of them, or all are done)
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if retention is not None:
            retention.apply(root)
        row = {"step": step, "mode": "async-sharded" if use_async else "sync-sharded",
               "world_size": ctx.world_size, "stall_s": stall, "write_s": time.perf_counter() - t0,
               "bytes": store.tree_bytes(final)}
        store.log_checkpoint(root, row)
        log.info("checkpoint step %d committed: stall %.3fs, written in %.3fs", step, stall, row["write_s"])
        return final

    with _pending_lock:
        _pending = _Pending(_committer.submit(finish), step)
    if wait:
        wait_pending()
        parallel.barrier(ctx)  # every rank returns once rank 0 has committed
    return final


# -- loading -----------------------------------------------------------------------------------------
def agreed_latest_good(root: Path, ctx: DistContext) -> CheckpointRef | None:
    """Rank 0 picks the newest checkpoint that verifies and tells the others, so all load the same one."""
    ref = store.latest_good(root) if ctx.is_main else None
    return parallel.broadcast_object(ref, ctx)


def load(state: TrainingState, root: Path, ctx: DistContext) -> Restored | None:
    """Restore every part of `state` from the newest good checkpoint under `root`; None when there is
    none (a fresh start)."""
    ref = agreed_latest_good(root, ctx)
    if ref is None:
        return None
    return Restored(ref, load_from(state, ref.path, ctx))


def load_from(state: TrainingState, path: Path, ctx: DistContext) -> dict[str, Any]:
    """Restore `state` from the checkpoint at `path` (verified by the caller), onto this job's world
    size and parallelism, whatever wrote it. Returns the plain values saved with it. A one-process
    checkpoint's files are checked against the manifest again as they are read; a mismatch (the files
    changed since they were verified) is CheckpointCorrupt with `state` partly overwritten."""
    with collector_paused():  # DCP's metadata and plans are many objects: no full collection midway
        return _load_from(state, path, ctx)


def _load_from(state: TrainingState, path: Path, ctx: DistContext) -> dict[str, Any]:
    values = store.read_state_json(path)
    # The ranks of one tensor-parallel group draw the same numbers (dropout on activations every rank holds
    # whole), so each restores the stream of its group's first rank.
    rng_rank = ctx.rank - ctx.rank % ctx.tp
    if sharded.is_sharded(path):
        sharded.load_shards(state.model, state.optimizer, path, ctx, stored=sharded.stored_order(values))
        _restore_rank_rng(state, path, rng_rank, values["step"])
    else:
        manifest = store.read_manifest(path)
        if not ctx.distributed and fused_rows_of(state.model) is None:
            # The same one-process layout that wrote it: the files are read straight into the live
            # parameters and optimizer state, so the loads below find their tensors already in place.
            live = {"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()}
            parts = plain.read_parts(path, manifest, into=live)
            state.model.load_state_dict(parts["model"])
            state.optimizer.load_state_dict(parts["optimizer"])
        else:
            # Keyed by parameter name, the one-process state lands on DDP replicas or FSDP shards alike.
            parts = plain.read_parts(path, manifest)
            sharded.load_whole(state.model, state.optimizer, parts["model"], parts["optimizer"])
        if rng_rank == 0:  # the one process that wrote it was rank 0
            state.rng.load_state_dict(plain.legacy_rng(parts, values))
        else:
            _fresh_rank_rng(values["step"], rng_rank)
    state.loader.load_state_dict(values["loader"])
    return values


def _restore_rank_rng(state: TrainingState, path: Path, rank: int, step: int) -> None:
    rng = path / sharded.rng_file(rank)
    legacy = path / sharded.RNG_DIR / f"rank_{rank:05d}{plain.LEGACY_SUFFIX}"
    if rng.is_file():
        state.rng.load_state_dict(tensorfile.read_state(rng))
    elif legacy.is_file():  # format 1: torch states in .pt, the others in .json
        state.rng.load_state_dict({**torch.load(legacy, weights_only=True),
                                   **json.loads(legacy.with_suffix(".json").read_text())})
    else:
        _fresh_rank_rng(step, rank)


def _fresh_rank_rng(step: int, rank: int) -> None:
    """A rank the saving job did not have (the world grew): a fresh stream, deterministic in (step, rank)."""
    seed_everything(derive_seed(step, "rng", rank))

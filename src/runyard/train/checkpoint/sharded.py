"""The sharded checkpoint format: torch.distributed.checkpoint (DCP), each rank writing its own shards.

    step_00000123/
      dcp/.metadata, dcp/__<rank>_0.distcp   model + optimizer (raw tensor chunks, dcp_storage.py)
      rng/rank_00000.safetensors              every rank's RNG state (dropout stays bitwise on resume)
      state.json                              step, loader position and the loop's own values (rank 0)
      MANIFEST.json                           checksum and size of every file, written last by rank 0

Every rank writes into the same hidden `.tmp-step_...` directory. DCP's last step gathers every rank's
write results (with their files' checksums) to rank 0, which writes `.metadata`: when rank 0's save
completes, all shards are down. Rank 0 then commits the directory (store.commit), so verification and
`latest_good` treat sharded and one-process checkpoints alike.

Loading reshards: a checkpoint written by N ranks, or by one process, loads onto any world size and
layout (DDP, FSDP, tensor parallel), with its optimizer state. Every tensor is stored whole-model-shaped
under its plain name and in the model's own row order (a tensor-parallel model's fused rows are put back
in order before the save and reordered for the loading layout after the load: train/tensor_parallel.py).
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from runyard.train.checkpoint import tensorfile
from runyard.train.checkpoint.checksums import FileEntry
from runyard.train.checkpoint.deferred_copies import DeferredCopies
from runyard.train.parallel import DistContext, is_dtensor
from runyard.train.tensor_parallel import FusedRows, fused_rows_of

if TYPE_CHECKING:
    from types import ModuleType

    from torch.distributed.checkpoint.staging import DefaultStager

    from runyard.train.checkpoint.dcp_storage import RawFileSystemWriter


def _dcp_storage() -> ModuleType:
    """dcp_storage.py, runyard's layer over torch.distributed.checkpoint, imported when shards are saved or
    read: every one-process run and every reader of a checkpoint imports this module, and importing DCP
    (with the DTensor module it loads) costs about a second. The one deferred import of this file."""
    from runyard.train.checkpoint import dcp_storage

    return dcp_storage

DCP_DIR = "dcp"
RNG_DIR = "rng"
MODEL_KEY, OPTIM_KEY = "model", "optim"
# The optimizer's state is saved keyed by parameter name (dcp_storage.FLAT). Checkpoints written before
# hold the groups by index ("optim.param_groups.0.params" lists the first group's parameters).
NESTED_GROUPS = f"{OPTIM_KEY}.param_groups.0.params"

# DCP warns on every save or load without a process group that it "assumes the intent" is one process;
# runyard asks for that on purpose (no_dist), so the warning says nothing.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, "
                        r"assuming the intent", category=UserWarning)


def is_sharded(path: Path) -> bool:
    return (path / DCP_DIR / ".metadata").is_file()


def rng_file(rank: int) -> str:
    return f"{RNG_DIR}/rank_{rank:05d}{tensorfile.SUFFIX}"


_stager: DefaultStager | None = None


def _stager_for(device: torch.device) -> DefaultStager:
    """One stager per process, kept: it copies the state into CPU buffers it allocated at the first save
    and reuses (a fresh allocation each time costs page faults, several times the copy itself)."""
    global _stager
    if _stager is None:
        storage = _dcp_storage()
        cuda = device.type == "cuda"
        _stager = storage.DefaultStager(storage.StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                               use_async_staging=False, use_non_blocking_copy=cuda))
    return _stager


def _plain_cpu(state_dict: dict[str, dict[str, Any]]) -> bool:
    """Whether every tensor in `state_dict` is a plain CPU tensor (data-parallel ranks on CPU): such a state
    is staged by `DeferredCopies`; one with DTensor shards or device tensors by DCP's stager."""
    return all(not isinstance(v, torch.Tensor) or (v.device.type == "cpu" and not is_dtensor(v))
               for sd in state_dict.values() for v in sd.values())


class _AsIs:
    """DCP's async stager for a state dict staged already (`DeferredCopies`)."""

    should_synchronize_after_execute = False  # nothing left to wait for

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def close(self) -> None:
        pass


_deferred = DeferredCopies()


class ShardWrite:
    """This rank's part of a sharded save in flight: `result()` blocks until its shards are written
    (on rank 0: and DCP's metadata); `files` then holds the checksums of every rank's data files."""

    def __init__(self, future: Future, writer: RawFileSystemWriter, rng: dict[str, FileEntry]):
        self._future, self._writer, self._rng = future, writer, rng

    def result(self) -> dict[str, FileEntry]:
        self._future.result()
        return {**self._rng, **{f"{DCP_DIR}/{name}": e for name, e in self._writer.files.items()}}


def write_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rng_state: dict[str, Any],
                 tmp: Path, ctx: DistContext, use_async: bool) -> ShardWrite:
    """Every rank calls this for the same `tmp`. Returns once the state is staged (async: plain CPU
    tensors by `DeferredCopies`, whose copies wait for the optimizer's next step; others copied out by
    DCP's stager) or written (sync); the write goes on in the background when async. `rng_state` must be
    this process's own copy (it is written in the background too)."""
    storage = _dcp_storage()
    model_sd, optim_sd = storage.get_state_dict(model, optimizer, options=storage.FLAT)
    laid_out = fused_rows_of(model)
    if laid_out is not None:  # stored in the model's own order: any layout can load it
        MODEL_ORDER.reorder(model_sd, optim_sd, stored=laid_out)
    state_dict = _own_copies({MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}, ctx)
    rng: dict[str, FileEntry] = {}

    def write_rng() -> None:
        # Off the training loop's path (an fsync), yet before DCP gathers the ranks' write results: when
        # rank 0's save completes, every rank's RNG file is down too.
        rng[rng_file(ctx.rank)] = tensorfile.write_state(_mkparent(tmp / rng_file(ctx.rank)), rng_state)

    deferred = use_async and _plain_cpu(state_dict)
    writer = storage.RawFileSystemWriter(tmp / DCP_DIR, before_write=write_rng, source=_deferred if deferred else None)
    kwargs = {"storage_writer": writer, "process_group": ctx.ckpt_group, "no_dist": not ctx.distributed}
    if deferred:
        future = storage.dcp.async_save(_deferred.stage(state_dict, optimizer), async_stager=_AsIs(), **kwargs)
    elif use_async:
        future = storage.dcp.async_save(state_dict, async_stager=_stager_for(ctx.device), **kwargs)
    else:
        storage.dcp.save(state_dict, **kwargs)
        future = Future()
        future.set_result(None)
    return ShardWrite(future, writer, rng)


def _own_copies(state_dict: dict[str, dict[str, Any]], ctx: DistContext) -> dict[str, dict[str, Any]]:
    """`state_dict` without the plain tensors another rank writes. Data-parallel ranks hold the same
    plain tensors under the same names, and DCP would write each once anyway (its planner's dedup), but
    only after an async save staged every rank's whole state: each rank keeping only the copies it writes
    halves that copy, the training loop's stall, at two ranks. The ranks agree on the split (largest
    first, to the least loaded rank holding it: DCP's own rule); DTensor shards and non-tensor values are
    left to DCP."""
    if not ctx.distributed:
        return state_dict
    held = {(part, key): t.numel() * t.element_size() for part, sd in state_dict.items() for key, t in sd.items()
            if isinstance(t, torch.Tensor) and not is_dtensor(t)}
    every: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(every, sorted(held.items()), group=ctx.ckpt_group)
    holders: dict[tuple[str, str], list[int]] = {}
    size: dict[tuple[str, str], int] = {}
    for rank, items in enumerate(every):
        for name, nbytes in items:
            holders.setdefault(tuple(name), []).append(rank)
            size[tuple(name)] = max(size.get(tuple(name), 0), nbytes)
    load = [0] * ctx.world_size
    drop = set()
    for name in sorted(holders, key=lambda n: (-size[n], n)):
        writer = min(holders[name], key=lambda r: (load[r], r))
        load[writer] += size[name]
        if writer != ctx.rank and name in held:
            drop.add(name)
    return {part: {k: v for k, v in sd.items() if (part, k) not in drop} for part, sd in state_dict.items()}


def _mkparent(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


MODEL_ORDER = FusedRows({}, 1)


def stored_order(values: dict[str, Any]) -> FusedRows | None:
    """The fused rows' order a checkpoint's tensors are in: None (the model's own) unless it was written
    before checkpoints were layout-independent, by a tensor-parallel job that stored them rank by rank."""
    fused = values.get("tp_fused_rows")
    return FusedRows({k: tuple(v) for k, v in fused.items()}, int(values["tp"])) if fused else None


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path, ctx: DistContext,
                stored: FusedRows | None = None) -> None:
    """Model and optimizer from a sharded checkpoint, resharded onto this job's ranks and layout.
    `stored`: the fused rows' order of the checkpoint (`stored_order`)."""
    storage = _dcp_storage()
    reader = storage.RawFileSystemReader(path / DCP_DIR)
    nested = NESTED_GROUPS in reader.read_metadata().state_dict_metadata
    options = storage.StateDictOptions() if nested else storage.FLAT
    model_sd, optim_sd = storage.get_state_dict(model, optimizer, options=options)
    sd = {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}
    # The placeholders have the global shapes and placements; the rows they receive are in `stored`'s order.
    # Each rank plans its own reads (no_dist): its placeholders already say which chunks it needs, and
    # gathering every rank's plan to a coordinator cost more than the reads (a pickled item per value).
    storage.dcp.load(sd, storage_reader=reader, planner=storage.SafeLoadPlanner(), no_dist=True)
    (fused_rows_of(model) or MODEL_ORDER).reorder(sd[MODEL_KEY], sd[OPTIM_KEY], stored=stored)
    storage.set_state_dict(model, optimizer, model_state_dict=sd[MODEL_KEY], optim_state_dict=sd[OPTIM_KEY],
                   options=options)


def load_whole(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    """A one-process checkpoint's model and optimizer (parameters numbered in group order) placed onto
    DDP or FSDP shards or a tensor-parallel split: the path a job that grew from one process to several
    takes."""
    storage = _dcp_storage()
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    by_name = {
        "state": {order[int(i)]: dict(v) for i, v in optim_sd["state"].items()},
        "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in optim_sd["param_groups"]],
    }
    laid_out = fused_rows_of(model)
    if laid_out is not None:  # whole tensors in the model's order, split by rows below: rank by rank first
        model_sd = dict(model_sd)
        laid_out.reorder(model_sd, by_name)
    storage.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=by_name,
                           options=storage.StateDictOptions(full_state_dict=True))


def read_model(path: Path, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The whole model state dict of a sharded checkpoint, in this process alone (no collectives):
    for gates, export and tests."""
    return {".".join(k): v for k, v in _read_tensors(path, MODEL_KEY, map_location).items()}


def read_optimizer_state(path: Path, map_location: str | torch.device = "cpu") -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's per-parameter state of a sharded checkpoint (parameter name -> its whole tensors,
    `exp_avg`, `exp_avg_sq`, `step` for AdamW), in this process alone: for tests and inspection."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in _read_tensors(path, OPTIM_KEY, map_location).items():
        if len(key) == 1 and key[0].startswith("state."):  # saved flat: "state.<name>.<moment>"
            name, moment = key[0][len("state."):].rsplit(".", 1)
            out.setdefault(name, {})[moment] = value
        elif key[0] == "state":  # saved nested (before optimizer state was saved by name)
            out.setdefault(".".join(key[1:-1]), {})[key[-1]] = value
    return out


def _read_tensors(path: Path, part: str, map_location) -> dict[tuple[str, ...], torch.Tensor]:
    storage = _dcp_storage()
    reader = storage.RawFileSystemReader(path / DCP_DIR)
    metadata = reader.read_metadata()
    prefix = part + "."
    # DCP flattens {"model": {name: tensor}} to "model.<name>"; the planner data maps each back to its path.
    paths = metadata.planner_data or {}
    flat: dict[str, torch.Tensor] = {}
    keys: dict[str, tuple[str, ...]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not fqn.startswith(prefix) or not isinstance(md, storage.TensorStorageMetadata):
            continue
        key_path = paths.get(fqn, (part, fqn[len(prefix):]))
        flat[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
        keys[fqn] = tuple(str(p) for p in key_path[1:])
    storage.dcp.load(flat, storage_reader=reader, planner=storage.SafeLoadPlanner(flatten_state_dict=False),
                     no_dist=True)
    return {keys[fqn]: v.to(map_location) for fqn, v in flat.items()}

"""Checkpoints: one module for saving and restoring training, in one process and many.

The training loop calls `save` and `load` (training.py) with a `TrainingState`: model, optimizer,
loader and RNG, each contributing its state_dict. One process writes the plain format (plain.py: one
safetensors-layout file per part); several write the sharded format (sharded.py: torch.distributed.
checkpoint, asynchronously, with raw tensor chunks, dcp_storage.py). Both commit the same way
(store.py): files checksummed while written and fsynced once, a checksum manifest written last, the
directory renamed into place; an unreadable or incomplete checkpoint is refused and `latest_good`
falls back to the previous one; retention keeps the newest few and the best.

For code outside the loop: `latest_good`, `list_checkpoints`, `verify_checkpoint`, `read_checkpoint`
and `read_model_weights` read what a run left, without collectives.
"""

from runyard.train.checkpoint.plain import write_checkpoint
from runyard.train.checkpoint.reader import read_checkpoint, read_model_weights
from runyard.train.checkpoint.sharded import is_sharded
from runyard.train.checkpoint.store import (
    CHECKPOINT_LOG,
    MANIFEST,
    STATE,
    CheckpointRef,
    apply_retention,
    latest_good,
    list_checkpoints,
    step_dir_name,
    verify_checkpoint,
)
from runyard.train.checkpoint.training import (
    Restored,
    Retention,
    TrainingState,
    agreed_latest_good,
    load,
    load_from,
    save,
    wait_pending,
)

__all__ = [
    "CHECKPOINT_LOG",
    "MANIFEST",
    "STATE",
    "CheckpointRef",
    "Restored",
    "Retention",
    "TrainingState",
    "agreed_latest_good",
    "apply_retention",
    "is_sharded",
    "latest_good",
    "list_checkpoints",
    "load",
    "load_from",
    "read_checkpoint",
    "read_model_weights",
    "save",
    "step_dir_name",
    "verify_checkpoint",
    "wait_pending",
    "write_checkpoint",
]

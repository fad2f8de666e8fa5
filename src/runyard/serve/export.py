"""Export a trained model as a self-contained directory, and load it back without pickle.

An export holds three files:
- `model.safetensors`: the learned weights (a tied output head is stored once, as the embedding);
- `tokenizer.json`: the HF `tokenizers` tokenizer the model was trained with;
- `config.json`: format version, the `ModelConfig`, the sha256 of the two other files, and any
  caller-supplied `extra` (run name, step, held-out loss...).

The directory is written beside its destination under a temporary name, fsynced, then renamed into
place, so a crash leaves either the old export or the new one, never a mix. Loading checks every
file's checksum and every tensor's shape before building the model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from runyard.diskspace import nbytes_of, writing
from runyard.errors import RunyardError
from runyard.fsutil import fsync_dir, fsync_file, make_temp_dir, match_umask, sha256_file
from runyard.model.transformer import ModelConfig, Transformer

EXPORT_FORMAT = "runyard-export"
EXPORT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.json"
_TIED_HEAD = "lm_head.weight"


class ExportError(RunyardError):
    """An export directory is missing a file, fails its checksums, or does not match its config."""


def _weights_to_save(model: Transformer, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if cfg.tie_embeddings:
        state.pop(_TIED_HEAD, None)  # the same tensor as tok_emb.weight; safetensors refuses shared storage
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def export_model(
    model: Transformer,
    cfg: ModelConfig,
    tokenizer_path: Path,
    out_dir: Path,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Write `out_dir` with model.safetensors, tokenizer.json and config.json, atomically.
    An existing `out_dir` is replaced only once the new export is complete. Returns `out_dir`."""
    out_dir, tokenizer_path = Path(out_dir), Path(tokenizer_path)
    if model.cfg != cfg:
        raise ExportError(f"the model was built with {model.cfg}, not the config given to export: {cfg}")
    if not tokenizer_path.is_file():
        raise ExportError(f"tokenizer file {tokenizer_path} does not exist")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise ExportError(f"tokenizer file {tokenizer_path} is not a valid tokenizers JSON: {exc}") from None
    if tokenizer.get_vocab_size() > cfg.vocab_size:
        raise ExportError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens but the model's vocab_size is {cfg.vocab_size}"
        )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out_dir.parent, f".{out_dir.name}.tmp-")  # not mkdtemp: its 0700 would stick
    try:
        weights = _weights_to_save(model, cfg)
        with writing(f"the export {out_dir}", out_dir.parent, needed=nbytes_of(weights)):
            save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": EXPORT_FORMAT})
        match_umask(tmp / WEIGHTS_FILE)  # safetensors creates it 0600
        shutil.copyfile(tokenizer_path, tmp / TOKENIZER_FILE)
        config = {
            "format": EXPORT_FORMAT,
            "format_version": EXPORT_VERSION,
            "model": cfg.to_dict(),
            "files": {name: sha256_file(tmp / name) for name in (WEIGHTS_FILE, TOKENIZER_FILE)},
            "extra": extra_config or {},
        }
        try:
            text = json.dumps(config, indent=2, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ExportError(f"extra_config must be JSON-serialisable: {exc}") from None
        (tmp / CONFIG_FILE).write_text(text + "\n", encoding="utf-8")
        for name in (WEIGHTS_FILE, TOKENIZER_FILE, CONFIG_FILE):
            fsync_file(tmp / name)
        fsync_dir(tmp)
        old = None
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        fsync_dir(out_dir.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_export_config(export_dir: Path) -> dict[str, Any]:
    """The parsed config.json of an export, checked for format and version."""
    path = Path(export_dir) / CONFIG_FILE
    if not path.is_file():
        raise ExportError(f"{path} is missing; {export_dir} is not a runyard export")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or config.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{path} is not a runyard export config (expected format {EXPORT_FORMAT!r})")
    if config.get("format_version") != EXPORT_VERSION:
        raise ExportError(
            f"{path} has format_version {config.get('format_version')!r}; this runyard reads {EXPORT_VERSION}"
        )
    return config


def load_export(
    export_dir: Path, device: str | torch.device = "cpu"
) -> tuple[Transformer, ModelConfig, Tokenizer]:
    """Load (model in eval mode, config, tokenizer) from an export directory, verifying checksums and
    shapes. Raises ExportError naming the file and the problem."""
    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise ExportError(f"export directory {export_dir} does not exist")
    config = read_export_config(export_dir)
    try:
        cfg = ModelConfig.from_dict(config.get("model"))
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{export_dir / CONFIG_FILE}: bad model config: {exc}") from None

    checksums = config.get("files")
    if not isinstance(checksums, dict):
        raise ExportError(f"{export_dir / CONFIG_FILE} has no 'files' checksum table")
    for name in (WEIGHTS_FILE, TOKENIZER_FILE):
        path = export_dir / name
        if not path.is_file():
            raise ExportError(f"{path} is missing from the export")
        if name not in checksums:
            raise ExportError(f"{export_dir / CONFIG_FILE} records no checksum for {name}")
        actual = sha256_file(path)
        if actual != checksums[name]:
            raise ExportError(
                f"{path} fails its checksum (sha256 {actual[:16]}..., config.json records "
                f"{str(checksums[name])[:16]}...): the file was modified or truncated"
            )

    try:
        tokenizer = Tokenizer.from_file(str(export_dir / TOKENIZER_FILE))
    except Exception as exc:
        raise ExportError(f"{export_dir / TOKENIZER_FILE} cannot be loaded: {exc}") from None

    try:
        weights = load_file(str(export_dir / WEIGHTS_FILE), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ExportError(f"{export_dir / WEIGHTS_FILE} cannot be read: {exc}") from None

    with torch.random.fork_rng(devices=[]):  # building must not advance the caller's RNG via init
        model = Transformer(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop(_TIED_HEAD, None)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ExportError(
            f"{export_dir / WEIGHTS_FILE} does not match its config: missing {missing}, unexpected {unexpected}"
        )
    for name, shape in expected.items():
        if weights[name].shape != shape:
            raise ExportError(
                f"{export_dir / WEIGHTS_FILE}: tensor {name} has shape {tuple(weights[name].shape)}, "
                f"config implies {tuple(shape)}"
            )

    model.load_state_dict(weights, strict=not cfg.tie_embeddings)
    return model.to(device).eval(), cfg, tokenizer

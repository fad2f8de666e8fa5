"""Export a trained model as a self-contained directory, and load it back without pickle.

An export holds:
- the model family's own files (model/registry.py; for the decoder, `model.safetensors`: the learned
  weights, a tied output head stored once, as the embedding);
- `tokenizer.json`: the HF `tokenizers` tokenizer the model was trained with;
- `config.json`: format version, the model family and its config, the sha256 of every other file, and
  any caller-supplied `extra` (run name, step, held-out loss...).

The directory is written beside its destination under a temporary name, fsynced, then renamed into
place, so a crash leaves either the old export or the new one, never a mix. Loading checks every
file's checksum, then the family checks its files against the config before building the model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from runyard.diskspace import nbytes_of, writing
from runyard.fsutil import fsync_dir, fsync_file, make_temp_dir, match_umask, sha256_file
from runyard.model.registry import DEFAULT_FAMILY, ExportError, UnknownFamily, get_family

EXPORT_FORMAT = "runyard-export"
EXPORT_VERSION = 1
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.json"

__all__ = ["CONFIG_FILE", "EXPORT_FORMAT", "EXPORT_VERSION", "TOKENIZER_FILE", "ExportError", "export_model",
           "load_export", "read_export_config", "verify_files"]


def export_model(
    model: torch.nn.Module,
    cfg: Any,
    tokenizer_path: Path,
    out_dir: Path,
    extra_config: dict[str, Any] | None = None,
    family: str = DEFAULT_FAMILY,
) -> Path:
    """Write `out_dir` with the family's model files, tokenizer.json and config.json, atomically.
    An existing `out_dir` is replaced only once the new export is complete. Returns `out_dir`."""
    out_dir, tokenizer_path = Path(out_dir), Path(tokenizer_path)
    kind = get_family(family)
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
        with writing(f"the export {out_dir}", out_dir.parent, needed=nbytes_of(model.state_dict())):
            names = [*kind.export_files(model, cfg, tmp), TOKENIZER_FILE]
        for name in names[:-1]:
            match_umask(tmp / name)  # safetensors creates its files 0600
        shutil.copyfile(tokenizer_path, tmp / TOKENIZER_FILE)
        config = {
            "format": EXPORT_FORMAT,
            "format_version": EXPORT_VERSION,
            "family": kind.name,
            "model": kind.config_to_dict(cfg),
            "files": {name: sha256_file(tmp / name) for name in names},
            "extra": extra_config or {},
        }
        try:
            text = json.dumps(config, indent=2, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ExportError(f"extra_config must be JSON-serialisable: {exc}") from None
        (tmp / CONFIG_FILE).write_text(text + "\n", encoding="utf-8")
        for name in (*names, CONFIG_FILE):
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
) -> tuple[torch.nn.Module, Any, Tokenizer]:
    """Load (model in eval mode, config, tokenizer) from an export directory, verifying checksums and
    shapes. Raises ExportError naming the file and the problem."""
    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise ExportError(f"export directory {export_dir} does not exist")
    config = read_export_config(export_dir)
    if config.get("kind", "language_model") != "language_model":  # a table or image model (serve/predict_export.py)
        raise ExportError(f"{export_dir} holds a {config['kind']} model: `runyard serve` offers it at POST /v1/predict")
    try:
        kind = get_family(config.get("family", DEFAULT_FAMILY))
    except UnknownFamily as exc:
        raise ExportError(f"{export_dir / CONFIG_FILE}: {exc}") from None
    try:
        cfg = kind.config_from_dict(config.get("model"))
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{export_dir / CONFIG_FILE}: bad model config: {exc}") from None

    verify_files(export_dir, config, required=(TOKENIZER_FILE,))

    try:
        tokenizer = Tokenizer.from_file(str(export_dir / TOKENIZER_FILE))
    except Exception as exc:
        raise ExportError(f"{export_dir / TOKENIZER_FILE} cannot be loaded: {exc}") from None
    return kind.load_files(export_dir, cfg, device), cfg, tokenizer


def verify_files(export_dir: Path, config: dict[str, Any], required: tuple[str, ...] = ()) -> None:
    """Check every file config.json lists against its sha256 (and that `required` ones are listed);
    ExportError naming the file that is missing, outside the export or modified."""
    checksums = config.get("files")
    if not isinstance(checksums, dict):
        raise ExportError(f"{export_dir / CONFIG_FILE} has no 'files' checksum table")
    for name in required:
        if name not in checksums:
            raise ExportError(f"{export_dir / CONFIG_FILE} records no checksum for {name}")
    for name, expected in checksums.items():
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise ExportError(f"{export_dir / CONFIG_FILE} names {name!r}, not a file of the export")
        path = export_dir / name
        if not path.is_file():
            raise ExportError(f"{path} is missing from the export")
        actual = sha256_file(path)
        if actual != expected:
            raise ExportError(
                f"{path} fails its checksum (sha256 {actual[:16]}..., config.json records "
                f"{str(expected)[:16]}...): the file was modified or truncated"
            )

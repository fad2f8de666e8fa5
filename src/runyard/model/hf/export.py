"""Export a trained model as a Hugging Face model directory, and load it back without pickle.

An export is what the ecosystem loads (`transformers.AutoModelForCausalLM.from_pretrained(DIR)`, vLLM):
- the model family's own files (model/registry.py; for the decoder, model/hf/: `config.json` naming
  the architecture, and `model.safetensors` under the ecosystem's tensor names, or shards of it with
  `model.safetensors.index.json`);
- `tokenizer.json` and `tokenizer_config.json`, and the chat template when the model has one in
  `chat_template.jinja`, where the installed transformers' `save_pretrained` writes it and its
  `AutoTokenizer` reads it (so tokenizer_config.json holds none);
- `generation_config.json` (the end-of-sequence id generation stops at);
- `runyard.json`: runyard's provenance beside them: format version, the model family and its config,
  the sha256 and size of every other file, and the caller's `extra` (run name, spec hash...).

`runyard generate`, `runyard serve` and the drift reference all load this one directory.

The directory is written beside its destination under a temporary name, every file of it (the drift
reference included), fsynced, then renamed into place, so a crash leaves either the old export or the
new one, never a mix or a part; runyard.json lists every file, and readers refuse an export missing one. Loading checks every
file's checksum, then the family checks its files against the config before building the model.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from runyard.data.chat import CHAT_TEMPLATE_FILE, default_template
from runyard.data.tokenizer import TOKENIZER_CONFIG_FILE, special_token, token_ids, tokenizer_config_for
from runyard.model.hf.config import CONFIG_FILE, read_json
from runyard.model.hf.errors import ModelDirectoryError
from runyard.model.registry import DEFAULT_FAMILY, ExportError, UnknownFamily, get_family
from runyard.system.diskspace import nbytes_of, writing
from runyard.system.files import fsync_dir, fsync_file, make_temp_dir, match_umask, sha256_file

EXPORT_FORMAT = "runyard-export"
EXPORT_VERSION = 2  # 1 was runyard's own layout (config.json holding runyard's config); 2 is a HF directory
TOKENIZER_FILE = "tokenizer.json"
PROVENANCE_FILE = "runyard.json"
GENERATION_CONFIG_FILE = "generation_config.json"


__all__ = ["EXPORT_FORMAT", "EXPORT_VERSION", "PROVENANCE_FILE", "TOKENIZER_FILE", "ExportError",
           "export_eos_ids", "export_model", "install_export", "language_model_export_config", "load_export",
           "read_export_config", "verify_export", "verify_files"]


def export_model(
    model: torch.nn.Module,
    cfg: Any,
    tokenizer_path: Path,
    out_dir: Path,
    extra_config: dict[str, Any] | None = None,
    family: str = DEFAULT_FAMILY,
    tokenizer_config: dict[str, Any] | None = None,
    chat_template: str | None = None,
    generation_config: dict[str, Any] | None = None,
    source_config: dict[str, Any] | None = None,
    extra_files: Callable[[Path], list[str]] | None = None,
) -> Path:
    """Write `out_dir` as a Hugging Face model directory with runyard.json beside it, atomically.
    An existing `out_dir` is replaced only once the new export is complete. Returns `out_dir`.

    `tokenizer_config`: the tokenizer_config.json of the tokenizer (a model directory's, when the model
    started from one); None writes the one of a tokenizer runyard trained. `chat_template` (Jinja, as
    transformers renders it; default: the one `tokenizer_config` holds, if any) is written to
    chat_template.jinja, as transformers 5 writes it. `generation_config`: a model directory's
    generation_config.json to carry over; None writes one from the tokenizer's special tokens.
    `source_config`: the config.json the weights came in with, whose architecture and fields the
    export keeps (model/hf/config.py's `hf_config`). `extra_files(directory)` writes files of the
    caller's into the export before it is renamed into place (the drift reference) and returns their
    names, which runyard.json lists and readers check like every other file."""
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
    tok_config = dict(tokenizer_config) if tokenizer_config is not None else tokenizer_config_for(cfg.context_length)
    in_config = default_template(tok_config.pop("chat_template", None), TOKENIZER_CONFIG_FILE, "chat_template")
    chat_template = chat_template if chat_template is not None else in_config
    ids = token_ids(tokenizer, tok_config)
    eos = special_token(tok_config, "eos_token")
    if eos is not None and ids["eos_token_id"] is None:
        raise ExportError(f"the tokenizer config's eos_token {eos!r} is not in {tokenizer_path}")
    generation = dict(generation_config) if generation_config is not None else _generation_config(ids)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out_dir.parent, f".{out_dir.name}.tmp-")  # not mkdtemp: its 0700 would stick
    try:
        with writing(f"the export {out_dir}", out_dir.parent, needed=nbytes_of(model.state_dict())):
            metadata = {**ids, "source_config": source_config} if source_config is not None else ids
            names = kind.export_files(model, cfg, tmp, metadata=metadata)
        for name in names:
            match_umask(tmp / name)  # safetensors creates its files 0600
        shutil.copyfile(tokenizer_path, tmp / TOKENIZER_FILE)
        _write_json(tmp / TOKENIZER_CONFIG_FILE, tok_config)
        _write_json(tmp / GENERATION_CONFIG_FILE, generation)
        names += [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, GENERATION_CONFIG_FILE]
        if chat_template is not None:
            (tmp / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
            names.append(CHAT_TEMPLATE_FILE)
        if extra_files is not None:
            names += [name for name in extra_files(tmp) if name not in names]
        provenance = {
            "format": EXPORT_FORMAT,
            "format_version": EXPORT_VERSION,
            "family": kind.name,
            "model": kind.config_to_dict(cfg),
            "files": {name: sha256_file(tmp / name) for name in names},
            "sizes": {name: (tmp / name).stat().st_size for name in names},
            "extra": extra_config or {},
        }
        try:
            text = json.dumps(provenance, indent=2, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ExportError(f"extra_config must be JSON-serialisable: {exc}") from None
        install_export(tmp, out_dir, names, text)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def install_export(tmp: Path, out_dir: Path, names: list[str], provenance_json: str) -> None:
    """Finish an export written in `tmp`: its runyard.json last, every file and the folder fsynced, then
    `tmp` renamed onto `out_dir` (an older export there is moved aside first and removed after). Shared
    by every model kind's export, so a reader never sees a half-written one."""
    (tmp / PROVENANCE_FILE).write_text(provenance_json + "\n", encoding="utf-8")
    for name in (*names, PROVENANCE_FILE):
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


def export_eos_ids(export_dir: Path, tokenizer: Tokenizer) -> set[int]:
    """The token ids that end a generation with this export, as transformers reads them: the
    `eos_token_id` of generation_config.json and config.json (one id or a list: Llama 3 instruct ends
    turns with `<|eot_id|>` and documents with `<|end_of_text|>`) and tokenizer_config.json's
    `eos_token`. Empty when none names one (the caller may fall back to common names)."""
    export_dir = Path(export_dir)
    ids: set[int] = set()
    for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
        listed = _json_object(export_dir / name).get("eos_token_id")
        for value in listed if isinstance(listed, list) else [listed]:
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < tokenizer.get_vocab_size():
                ids.add(value)
    token = special_token(_json_object(export_dir / TOKENIZER_CONFIG_FILE), "eos_token")
    if token is not None and (found := tokenizer.token_to_id(token)) is not None:
        ids.add(found)
    return ids


def _json_object(path: Path) -> dict[str, Any]:
    """A JSON file's object; {} when it is missing, unreadable or not an object."""
    try:
        return read_json(path)
    except ModelDirectoryError:
        return {}


def _generation_config(ids: dict[str, int | None]) -> dict[str, Any]:
    return {k: v for k, v in ids.items() if v is not None}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def read_export_config(export_dir: Path) -> dict[str, Any]:
    """The parsed runyard.json of an export (format, family, model config, checksums, extra), checked
    for format and version."""
    export_dir = Path(export_dir)
    path = export_dir / PROVENANCE_FILE
    if not path.is_file():
        hint = ""
        if (export_dir / "config.json").is_file():
            hint = (" (a Hugging Face model directory without runyard's provenance: start a stage from it with "
                    "`model.init: {from: hf, path: ...}`; or an export written by an older runyard, in its "
                    "own format: run the stage's export again)")
        raise ExportError(f"{path} is missing; {export_dir} is not a runyard export{hint}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or config.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{path} is not a runyard export record (expected format {EXPORT_FORMAT!r})")
    if config.get("format_version") != EXPORT_VERSION:
        raise ExportError(
            f"{path} has format_version {config.get('format_version')!r}; this runyard reads {EXPORT_VERSION}"
        )
    return config


def language_model_export_config(export_dir: Path) -> dict[str, Any]:
    """runyard.json of a language model's export, its files not yet checked (`verify_export` checks them).
    ExportError when the directory is missing, is no export, or holds a table or image model."""
    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise ExportError(f"export directory {export_dir} does not exist")
    config = read_export_config(export_dir)
    if config.get("kind", "language_model") != "language_model":  # a table or image model (serve/predict_export.py)
        raise ExportError(f"{export_dir} holds a {config['kind']} model: `runyard serve` offers it at POST /v1/predict")
    return config


def verify_export(export_dir: Path) -> dict[str, Any]:
    """Check a language model's export: every file runyard.json records against its sha256; return
    runyard.json. ExportError names the first missing or modified file, or a table/image export."""
    config = language_model_export_config(export_dir)
    verify_files(Path(export_dir), config, required=(TOKENIZER_FILE,))
    return config


def verify_files(export_dir: Path, config: dict[str, Any], required: tuple[str, ...] = ()) -> None:
    """Check every file runyard.json lists against its size (when it records sizes) and sha256, and that
    `required` ones are listed; ExportError naming the file that is missing, outside the export or modified."""
    record = export_dir / PROVENANCE_FILE
    checksums = config.get("files")
    if not isinstance(checksums, dict):
        raise ExportError(f"{record} has no 'files' checksum table")
    sizes = config.get("sizes") if isinstance(config.get("sizes"), dict) else {}  # exports before sizes: none
    for name in required:
        if name not in checksums:
            raise ExportError(f"{record} records no checksum for {name}")
    for name, expected in checksums.items():
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise ExportError(f"{record} names {name!r}, not a file of the export")
        path = export_dir / name
        if not path.is_file():
            raise ExportError(f"{path} is missing from the export (its {PROVENANCE_FILE} lists it)")
        size = sizes.get(name)
        if isinstance(size, int) and path.stat().st_size != size:
            raise ExportError(f"{path} fails its checksum: it has {path.stat().st_size} bytes, {PROVENANCE_FILE} "
                              f"records {size}: the file was truncated or modified")
        actual = sha256_file(path)
        if actual != expected:
            raise ExportError(
                f"{path} fails its checksum (sha256 {actual[:16]}..., {PROVENANCE_FILE} records "
                f"{str(expected)[:16]}...): the file was modified or truncated"
            )


def load_export(
    export_dir: Path, device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, Any, Tokenizer]:
    """Load (model in eval mode, config, tokenizer) from an export directory, verifying checksums and
    shapes. Raises ExportError naming the file and the problem."""
    export_dir = Path(export_dir)
    config = verify_export(export_dir)
    record = export_dir / PROVENANCE_FILE
    try:
        kind = get_family(config.get("family", DEFAULT_FAMILY))
    except UnknownFamily as exc:
        raise ExportError(f"{record}: {exc}") from None
    try:
        cfg = kind.config_from_dict(config.get("model"))
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{record}: bad model config: {exc}") from None
    try:
        tokenizer = Tokenizer.from_file(str(export_dir / TOKENIZER_FILE))
    except Exception as exc:
        raise ExportError(f"{export_dir / TOKENIZER_FILE} cannot be loaded: {exc}") from None
    return kind.load_files(export_dir, cfg, device), cfg, tokenizer

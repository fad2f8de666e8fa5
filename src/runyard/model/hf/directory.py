"""A Hugging Face model directory in and out of runyard's decoder: config.json and safetensors weights.

`load_weights_into(model, directory)` streams a directory's weights into a built model (the training
loop's `model.init`); `load_model(directory)` builds the model too (an export); `write_model` writes a
model as transformers' `save_pretrained` would (config.json, model.safetensors or shards with their
index). Tokenizer files are the data side's (runyard.data.tokenizer); an export's provenance is
model/hf/export.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from runyard.model.config import ModelConfig
from runyard.model.hf.config import CONFIG_FILE, hf_config, read_config
from runyard.model.hf.errors import ModelDirectoryError
from runyard.model.hf.names import TIED_HEAD, layout, runyard_to_hf
from runyard.model.hf.weights import (
    DEFAULT_SHARD_BYTES,
    TensorInfo,
    check_tensor,
    read_headers,
    read_tensor,
    save_shards,
)
from runyard.model.transformer import Transformer


def check_weights(directory: Path, cfg: ModelConfig, state: dict[str, torch.Tensor] | None = None) -> dict[str, TensorInfo]:
    """Check, from the safetensors headers alone (no tensor is read), that the weights of `directory` are
    what a model of `cfg` needs: every file readable and whole, every tensor config.json implies there
    with its shape and a dtype runyard loads, none it does not imply (a tied head may be stored).
    ModelDirectoryError names the file and the tensor. Returns the headers."""
    directory = Path(directory)
    headers = read_headers(directory)
    needed = {name: rows for parts in layout(cfg).values() for name, rows in parts}
    missing = sorted(set(needed) - set(headers))
    if missing:
        raise ModelDirectoryError(directory, f"the weights lack {len(missing)} tensor(s) config.json implies: "
                                  f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    extra = sorted(set(headers) - set(needed) - ({TIED_HEAD} if cfg.tie_embeddings else set()))
    if extra:
        raise ModelDirectoryError(headers[extra[0]].file, f"holds {len(extra)} tensor(s) a model of this "
                                  f"config.json does not have: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    # The shapes come from the model being loaded when there is one: building a model on the meta device
    # costs ~80 MB of resident memory the first time (torch's meta machinery), which loading must not add.
    shapes = {name: tuple(tensor.shape) for name, tensor in
              runyard_to_hf(state if state is not None else _meta_state(cfg), cfg).items()}
    if cfg.tie_embeddings:
        shapes[TIED_HEAD] = (cfg.vocab_size, cfg.d_model)
    for name, info in headers.items():
        check_tensor(info, name, shapes[name])
    return headers


def _meta_state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's state dict with no storage (shapes only)."""
    with torch.device("meta"):
        return Transformer(cfg).state_dict()


@torch.no_grad()
def load_weights_into(model: Transformer, directory: Path) -> None:
    """Copy the weights of the Hugging Face model directory `directory` into `model`, tensor by tensor,
    once `check_weights` has passed. ModelDirectoryError names the file and the tensor."""
    directory = Path(directory)
    cfg = model.cfg
    state = model.state_dict()
    headers = check_weights(directory, cfg, state)
    plan = layout(cfg)
    for ours, parts in plan.items():
        target, row = state[ours], 0
        for name, rows in parts:
            target[row : row + rows].copy_(read_tensor(headers[name], name))
            row += rows
    if cfg.tie_embeddings and TIED_HEAD in headers:
        info = headers[TIED_HEAD]
        if not torch.equal(read_tensor(info, TIED_HEAD).to(model.tok_emb.weight.dtype), model.tok_emb.weight):
            raise ModelDirectoryError(info.file, "tensor 'lm_head.weight' differs from 'model.embed_tokens.weight', "
                                      "but config.json says tie_word_embeddings: true")


def load_model(directory: Path, config: ModelConfig | None = None, device: str | torch.device = "cpu") -> Transformer:
    """The decoder held by a Hugging Face model directory, in eval mode. With `config`, config.json must
    describe the same model (dropout aside), and `config` is what the model is built with."""
    directory = Path(directory)
    found = read_config(directory)
    if config is not None and not config.same_shape(found):
        raise ModelDirectoryError(directory / CONFIG_FILE, f"describes {_differences(config, found)}, which is "
                                  "not the model recorded beside it")
    with torch.random.fork_rng(devices=[]):  # building must not advance the caller's RNG via init
        model = Transformer(config or found)
    load_weights_into(model, directory)
    return model.to(device).eval()


def _differences(expected: ModelConfig, found: ModelConfig) -> str:
    diffs = [f"{name} {getattr(found, name)!r} (expected {getattr(expected, name)!r})"
             for name in expected.to_dict() if name != "dropout" and getattr(expected, name) != getattr(found, name)]
    return ", ".join(diffs)


def write_model(
    model: Transformer,
    cfg: ModelConfig,
    directory: Path,
    token_ids: dict[str, int | None] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    source_config: dict[str, Any] | None = None,
) -> list[str]:
    """Write config.json and the weights under Hugging Face names into `directory`; return the file
    names. `token_ids` (bos/eos/pad) go into config.json; `source_config`, the config.json the weights
    came in with, gives its architecture and fields (see `hf_config`)."""
    if model.cfg != cfg:
        raise ModelDirectoryError(directory, f"the model was built with {model.cfg}, not the config given to "
                                  f"export: {cfg}")
    hf_state = runyard_to_hf(model.state_dict(), cfg)
    names = save_shards(hf_state.items(), directory, max_shard_bytes)
    (Path(directory) / CONFIG_FILE).write_text(_json(hf_config(cfg, token_ids, source_config)), encoding="utf-8")
    return [CONFIG_FILE, *names]


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2) + "\n"

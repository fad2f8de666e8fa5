"""The Llama-style decoder as a model family: the registry's first entry.

Config: `ModelConfig` (model/config.py) from the spec's `model` section and the tokenizer's vocabulary.
Model: `Transformer` (model/transformer.py, the math only). Sizing: counted on the meta device from the
model's own definition, so there is no second copy of its arithmetic. Export: `model.safetensors` with
runyard's parameter names (a tied output head stored once, as the embedding).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from runyard.model.config import ModelConfig
from runyard.model.registry import ExportError, ModelFamily, Sizing, register
from runyard.model.transformer import Transformer

WEIGHTS_FILE = "model.safetensors"
_TIED_HEAD = "lm_head.weight"


def activation_bytes(cfg: ModelConfig, micro_batch: int, bytes_per_value: int = 4) -> int:
    """A coarse estimate of saved activations for one micro-batch: ~34*d per token per layer plus the
    logits (Korthikanti et al. 2022, without recomputation, SDPA's memory-efficient attention)."""
    tokens = micro_batch * cfg.context_length
    per_layer = 34 * cfg.d_model * tokens * bytes_per_value // 2
    logits = tokens * cfg.vocab_size * bytes_per_value * 2
    return cfg.n_layers * per_layer + logits


class DecoderFamily(ModelFamily):
    name = "decoder"
    tasks = ("language_model",)

    def config_from_spec(self, spec: Any, *, vocab_size: int | None = None, **data_facts: Any) -> ModelConfig:
        if vocab_size is None:
            raise ValueError("the decoder's config needs the tokenizer's vocab_size from the prepared data")
        return ModelConfig.from_spec(spec, vocab_size)

    def config_from_dict(self, data: dict[str, Any]) -> ModelConfig:
        return ModelConfig.from_dict(data)

    def sizing(self, config: ModelConfig, micro_batch: int = 1) -> Sizing:
        with torch.device("meta"):
            model = Transformer(config)
        return Sizing(
            parameters=model.num_parameters(),
            non_embedding_parameters=model.num_parameters(non_embedding=True),
            flops_per_unit=model.flops_per_token(),
            unit="token",
            activation_bytes=activation_bytes(config, micro_batch),
            cache_bytes_per_unit=2 * config.n_layers * config.n_kv_heads * config.head_dim * 2,  # K and V, bf16
        )

    def units_per_example(self, config: ModelConfig) -> int:
        return config.context_length

    def synthetic_batch(
        self, config: ModelConfig, micro_batch: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, config.vocab_size, (micro_batch, config.context_length + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    def build(self, config: ModelConfig) -> Transformer:
        return Transformer(config)

    def optimizer_groups(self, model: torch.nn.Module, optim: Any) -> list[dict[str, Any]]:
        return model.param_groups(optim.weight_decay, optim.decay_norms_and_biases, optim.decay_embeddings)

    def shard_units(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return list(model.blocks)

    def export_files(self, model: torch.nn.Module, config: ModelConfig, directory: Path) -> list[str]:
        if model.cfg != config:
            raise ExportError(f"the model was built with {model.cfg}, not the config given to export: {config}")
        state = model.state_dict()
        if config.tie_embeddings:
            state.pop(_TIED_HEAD, None)  # the same tensor as tok_emb.weight; safetensors refuses shared storage
        weights = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        save_file(weights, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        return [WEIGHTS_FILE]

    def load_files(self, directory: Path, config: ModelConfig, device: str | torch.device = "cpu") -> Transformer:
        path = directory / WEIGHTS_FILE
        if not path.is_file():
            raise ExportError(f"{path} is missing from the export")
        try:
            weights = load_file(str(path), device="cpu")
        except (SafetensorError, OSError) as exc:
            raise ExportError(f"{path} cannot be read: {exc}") from None
        with torch.random.fork_rng(devices=[]):  # building must not advance the caller's RNG via init
            model = Transformer(config)
        expected = {k: v.shape for k, v in model.state_dict().items()}
        if config.tie_embeddings:
            expected.pop(_TIED_HEAD, None)
        missing = sorted(set(expected) - set(weights))
        unexpected = sorted(set(weights) - set(expected))
        if missing or unexpected:
            raise ExportError(f"{path} does not match its config: missing {missing}, unexpected {unexpected}")
        for name, shape in expected.items():
            if weights[name].shape != shape:
                raise ExportError(
                    f"{path}: tensor {name} has shape {tuple(weights[name].shape)}, config implies {tuple(shape)}"
                )
        model.load_state_dict(weights, strict=not config.tie_embeddings)
        return model.to(device).eval()


DECODER = register(DecoderFamily())

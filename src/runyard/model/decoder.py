"""The Llama-style decoder as a model family: the registry's first entry.

Config: `ModelConfig` (model/config.py) from the spec's `model` section and the tokenizer's vocabulary,
or from the weights a stage starts from. Model: `Transformer` (model/transformer.py, the math only).
Sizing: counted on the meta device from the model's own definition, so there is no second copy of its
arithmetic. Export: a Hugging Face model directory (model/hf/: config.json naming LlamaForCausalLM, or
Qwen2ForCausalLM / MistralForCausalLM where the model needs them, and safetensors weights under the
ecosystem's tensor names), which is also what `model.init` reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runyard.model import hf
from runyard.model.config import ModelConfig
from runyard.model.registry import (
    ExportError,
    ModelFamily,
    NoTensorParallelPlan,
    Sizing,
    TensorParallelPlan,
    register,
)
from runyard.model.transformer import Transformer


def block_activation_bytes(cfg: ModelConfig, micro_batch: int, bytes_per_value: int = 4) -> int:
    """What one block keeps for backward: ~34*d per token (Korthikanti et al. 2022, counted there in
    2-byte values; SDPA's memory-efficient attention keeps no score matrix)."""
    return 34 * cfg.d_model * micro_batch * cfg.context_length * bytes_per_value // 2


def activation_bytes(cfg: ModelConfig, micro_batch: int, bytes_per_value: int = 4) -> int:
    """A coarse estimate of saved activations for one micro-batch without recomputation: every block's
    (block_activation_bytes) plus the logits and their softmax."""
    tokens = micro_batch * cfg.context_length
    logits = tokens * cfg.vocab_size * bytes_per_value * 2
    return cfg.n_layers * block_activation_bytes(cfg, micro_batch, bytes_per_value) + logits


class DecoderFamily(ModelFamily):
    name = "decoder"
    tasks = ("language_model",)
    why_recommended = "a decoder transformer (the one language-model family)"

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
            recomputable_units=config.n_layers,
            unit_activation_bytes=block_activation_bytes(config, micro_batch),
            unit_input_bytes=micro_batch * config.context_length * config.d_model * 4,  # the residual stream, fp32
        )

    def units_per_example(self, config: ModelConfig) -> int:
        return config.context_length  # next-token targets: one per position of a sequence

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

    def tensor_parallel_plan(self, model: torch.nn.Module, tp: int) -> TensorParallelPlan:
        """Megatron's split of each block: Q/K/V and the SwiGLU gate/up column-wise (each rank its share of
        the heads and of the hidden width), the attention output and down projection row-wise; the
        embedding, norms and head stay whole on every rank."""
        cfg = model.cfg
        for what, n in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads), ("ffn_hidden", cfg.ffn_hidden)):
            if n % tp:
                raise NoTensorParallelPlan(f"tensor parallel over {tp} processes needs model.{what} ({n}) divisible "
                                           f"by {tp}")
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        styles, fused, local = {}, {}, {}
        for i in range(cfg.n_layers):
            b = f"blocks.{i}"
            styles.update({f"{b}.attn.wqkv": "colwise", f"{b}.attn.wo": "rowwise",
                           f"{b}.ffn.w_gate_up": "colwise", f"{b}.ffn.w_down": "rowwise"})
            fused[f"{b}.attn.wqkv.weight"] = (q, kv, kv)
            if cfg.qkv_bias:
                fused[f"{b}.attn.wqkv.bias"] = (q, kv, kv)
            fused[f"{b}.ffn.w_gate_up.weight"] = (cfg.ffn_hidden, cfg.ffn_hidden)
            local[f"{b}.attn.n_heads"] = cfg.n_heads // tp
            local[f"{b}.attn.n_kv_heads"] = cfg.n_kv_heads // tp
        return TensorParallelPlan(styles, fused, local)

    def config_from_weights(self, spec: Any, weights_config: ModelConfig) -> ModelConfig:
        return ModelConfig.from_spec_and_weights(spec, weights_config)

    def config_from_directory(self, directory: Path) -> ModelConfig:
        return hf.read_config(directory)

    def check_directory(self, directory: Path, config: ModelConfig) -> None:
        hf.check_weights(directory, config)

    def load_directory_into(self, model: torch.nn.Module, directory: Path) -> None:
        hf.load_weights_into(model, directory)

    def export_files(self, model: torch.nn.Module, config: ModelConfig, directory: Path, *,
                     metadata: dict[str, Any] | None = None) -> list[str]:
        if model.cfg != config:
            raise ExportError(f"the model was built with {model.cfg}, not the config given to export: {config}")
        metadata = dict(metadata or {})
        source = metadata.pop("source_config", None)  # the config.json the weights came in with
        return hf.write_model(model, config, directory, token_ids=metadata, source_config=source)

    def load_files(self, directory: Path, config: ModelConfig, device: str | torch.device = "cpu") -> Transformer:
        return hf.load_model(directory, config, device)


DECODER = register(DecoderFamily())

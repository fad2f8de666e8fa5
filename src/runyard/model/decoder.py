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
from torch import nn

from runyard.model import hf
from runyard.model.config import ModelConfig
from runyard.model.registry import (
    ExportError,
    ModelFamily,
    NoPipelinePlan,
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


def stage_blocks(n_layers: int, stages: int) -> list[range]:
    """Consecutive blocks of each pipeline stage, as even as the count allows (earlier stages take one
    more when it does not divide)."""
    per, extra = divmod(n_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + per + (1 if s < extra else 0))
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


class DecoderStage(nn.Module):
    """One pipeline stage of a `Transformer`: its blocks (under their own indices, so every parameter keeps
    the whole model's name), with the token embedding on the first stage and the final norm and head on
    the last. Shares the model's modules (no copy). Maps token ids (first stage) or the residual stream
    to the residual stream, or (last stage) to logits."""

    def __init__(self, model: Transformer, blocks: range, first: bool, last: bool):
        super().__init__()
        self.cfg = model.cfg
        self.tok_emb = model.tok_emb if first else None
        self.drop = model.drop if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        if self.tok_emb is not None:
            x = self.drop(self.tok_emb(x))
        for i, block in self.blocks.items():
            x = block(x, cos, sin, None, int(i))
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x

    def param_groups(self, weight_decay: float, decay_norms_and_biases: bool = False,
                     decay_embeddings: bool = False) -> list[dict]:
        """The whole model's groups (Transformer.param_groups), restricted to this stage's parameters."""
        embedding = self.tok_emb.weight if self.tok_emb is not None else None
        decay, no_decay = [], []
        for p in self.parameters():
            is_decayed = decay_embeddings if p is embedding else (decay_norms_and_biases if p.ndim < 2 else True)
            (decay if is_decayed else no_decay).append(p)
        groups = [{"name": "decay", "params": decay, "weight_decay": weight_decay},
                  {"name": "no_decay", "params": no_decay, "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]


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

    def pipeline_stage(self, model: torch.nn.Module, stage: int, stages: int) -> DecoderStage:
        """Stages by blocks: the embedding with the first blocks, the final norm and head (whose output the
        loss scores) with the last."""
        cfg = model.cfg
        if cfg.n_layers < stages:
            raise NoPipelinePlan(f"pipeline parallel over {stages} stages needs model.n_layers ({cfg.n_layers}) of "
                                 f"at least {stages}")
        if cfg.tie_embeddings and stages > 1:
            raise NoPipelinePlan("pipeline parallel cannot split a model whose head shares the token embedding "
                                 "(model.tie_embeddings: true): they would live on the first and the last stage")
        return DecoderStage(model, stage_blocks(cfg.n_layers, stages)[stage], stage == 0, stage == stages - 1)

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

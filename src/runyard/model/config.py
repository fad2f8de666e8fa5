"""`ModelConfig`: the shape of a Llama-style decoder, with every default resolved.

The job spec's `ModelSpec` leaves fields open (null); `ModelConfig.from_spec` fills them with runyard's
defaults so that a config alone rebuilds the same model (it is what an export's runyard.json stores).
A stage that starts from existing weights takes its shape from them instead: `ModelConfig.from_spec_and_weights`
merges the spec into the weights' config and names every field the spec contradicts.

The fields beyond runyard's own defaults (`qkv_bias`, `rope_scaling`, `sliding_window`) exist so that
the Hugging Face families that share this block (Llama, Mistral, Qwen2) load exactly (model/hf/).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runyard.spec.job import ModelSpec

FFN_MULTIPLE = 32  # SwiGLU width is rounded up to this (Llama rounds to a hardware-friendly multiple)

# What a null field of the spec's `model` section means for a model trained from scratch.
SPEC_DEFAULTS: dict[str, Any] = {
    "d_model": 256,
    "n_layers": 4,
    "n_heads": 4,
    "tie_embeddings": True,
    "rope_theta": 10000.0,
    "norm_eps": 1e-5,
}
# Fields of the spec that describe the weights' shape: with `model.init` each must be null or equal
# the weights' value. (`context_length` may be smaller: it is the training sequence length.)
SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "tie_embeddings",
                "rope_theta", "norm_eps")

# Rotary scaling variants runyard computes exactly as transformers does, and the keys each needs.
ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def default_ffn_hidden(d_model: int) -> int:
    """SwiGLU width with about the parameter count of a 4*d ReLU MLP: 8/3*d, rounded up to a multiple of 32."""
    return FFN_MULTIPLE * math.ceil(8 * d_model / 3 / FFN_MULTIPLE)


class ConfigContradiction(ValueError):
    """The spec's `model` section sets fields that differ from the weights it starts from.
    `fields` lists (field, the spec's value, the weights' value)."""

    def __init__(self, fields: list[tuple[str, Any, Any]]):
        self.fields = fields
        super().__init__("; ".join(f"{name}: spec {mine!r}, weights {theirs!r}" for name, mine, theirs in fields))


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    context_length: int
    tie_embeddings: bool = True
    dropout: float = 0.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    # None, or {"rope_type": "linear" | "llama3", ...its ROPE_SCALING_KEYS}: transformers' rope_scaling.
    rope_scaling: dict[str, Any] | None = None
    # Mistral/Qwen2 sliding-window attention. Only a window that covers the whole context is accepted
    # (it then changes nothing, so the model is exact); it is kept so an export says what it was.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_hidden",
            "context_length",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model config {name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head dimension ({self.head_dim}) must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("rope_theta and norm_eps must be positive")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)
        if self.sliding_window is not None and self.sliding_window < self.context_length:
            raise ValueError(
                f"sliding_window ({self.sliding_window}) is shorter than context_length ({self.context_length}); "
                "runyard's attention sees the whole context, so only a window covering it is exact"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_spec(cls, spec: ModelSpec, vocab_size: int) -> ModelConfig:
        """Resolve a spec's model section for a model trained from scratch. `vocab_size` (the
        tokenizer's) is used unless the spec sets one; other null fields take SPEC_DEFAULTS."""
        vocab = spec.vocab_size if spec.vocab_size is not None else vocab_size
        if vocab < vocab_size:
            raise ValueError(
                f"model.vocab_size ({vocab}) is smaller than the tokenizer's vocabulary ({vocab_size}); "
                "token ids would fall outside the embedding table"
            )
        values = {name: _spec_value(spec, name) for name in SPEC_DEFAULTS}
        return cls(
            vocab_size=vocab,
            n_kv_heads=spec.n_kv_heads or values["n_heads"],
            ffn_hidden=spec.ffn_hidden or default_ffn_hidden(values["d_model"]),
            context_length=spec.context_length,
            dropout=spec.dropout,
            **values,
        )

    @classmethod
    def from_spec_and_weights(cls, spec: ModelSpec, weights: ModelConfig) -> ModelConfig:
        """The config of a stage that starts from weights of config `weights`: their shape, the spec's
        training settings (dropout). A shape field the spec sets must equal the weights'; its
        `context_length` (the training sequence length) may not exceed theirs. Raises ConfigContradiction
        naming every field that disagrees."""
        problems = [(name, getattr(spec, name), getattr(weights, name)) for name in SHAPE_FIELDS
                    if getattr(spec, name) is not None and getattr(spec, name) != getattr(weights, name)]
        if spec.context_length > weights.context_length:
            problems.append(("context_length", spec.context_length, weights.context_length))
        if problems:
            raise ConfigContradiction(problems)
        return dataclasses.replace(weights, dropout=spec.dropout)

    def same_shape(self, other: ModelConfig) -> bool:
        """True when both configs build the same weights and the same function (dropout aside)."""
        return dataclasses.replace(self, dropout=0.0) == dataclasses.replace(other, dropout=0.0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Rebuild from `to_dict()` output. Unknown or missing keys raise ValueError naming them."""
        if not isinstance(data, dict):
            raise ValueError(f"model config must be a mapping, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown model config keys: {unknown}")
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"model config is missing keys: {missing}")
        return cls(**data)


def _spec_value(spec: ModelSpec, name: str) -> Any:
    value = getattr(spec, name)
    return SPEC_DEFAULTS[name] if value is None else value


def check_rope_scaling(scaling: dict[str, Any]) -> None:
    """ValueError unless `scaling` is a rotary scaling runyard computes exactly (ROPE_SCALING_KEYS)."""
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be a mapping, got {type(scaling).__name__}")
    kind = scaling.get("rope_type")
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(f"rope_scaling rope_type {kind!r} is not supported; runyard computes "
                         f"{sorted(ROPE_SCALING_KEYS)} (and no scaling)")
    expected = {"rope_type", *ROPE_SCALING_KEYS[kind]}
    if set(scaling) != expected:
        raise ValueError(f"rope_scaling of type {kind!r} needs exactly the keys {sorted(expected)}, "
                         f"got {sorted(scaling)}")
    for key in ROPE_SCALING_KEYS[kind]:
        value = scaling[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"rope_scaling {key} must be a positive number, got {value!r}")

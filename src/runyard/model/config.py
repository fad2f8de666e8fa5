"""`ModelConfig`: the shape of a Llama-style decoder, with every default resolved.

The job spec's `ModelSpec` leaves some fields open (`n_kv_heads`, `ffn_hidden`, `vocab_size`);
`ModelConfig.from_spec` fills them so that a config alone rebuilds the same model (it is what an
export's config.json stores).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runyard.spec import ModelSpec

FFN_MULTIPLE = 32  # SwiGLU width is rounded up to this (Llama rounds to a hardware-friendly multiple)


def default_ffn_hidden(d_model: int) -> int:
    """SwiGLU width with about the parameter count of a 4*d ReLU MLP: 8/3*d, rounded up to a multiple of 32."""
    return FFN_MULTIPLE * math.ceil(8 * d_model / 3 / FFN_MULTIPLE)


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

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_spec(cls, spec: ModelSpec, vocab_size: int) -> ModelConfig:
        """Resolve a spec's model section. `vocab_size` (the tokenizer's) is used unless the spec sets one."""
        vocab = spec.vocab_size if spec.vocab_size is not None else vocab_size
        if vocab < vocab_size:
            raise ValueError(
                f"model.vocab_size ({vocab}) is smaller than the tokenizer's vocabulary ({vocab_size}); "
                "token ids would fall outside the embedding table"
            )
        return cls(
            vocab_size=vocab,
            d_model=spec.d_model,
            n_layers=spec.n_layers,
            n_heads=spec.n_heads,
            n_kv_heads=spec.n_kv_heads or spec.n_heads,
            ffn_hidden=spec.ffn_hidden or default_ffn_hidden(spec.d_model),
            context_length=spec.context_length,
            tie_embeddings=spec.tie_embeddings,
            dropout=spec.dropout,
            rope_theta=spec.rope_theta,
            norm_eps=spec.norm_eps,
        )

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

"""The fine-tuning parts of a stage's spec: its objective's settings (sft, dpo) and LoRA adapters.

`runyard.spec.sections.StageSpec` embeds them; the instruction data section is the data stage's
(runyard.spec.data_instruct).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Projection names as Hugging Face Llama models call them; runyard's fused projections (q/k/v in one
# matrix, gate/up in another) get one adapter per named slice, so the adapters mean what they mean there.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SFTSpec(_Strict):
    """Held-out evaluation of an instruction stage beyond its response loss: a task metric over
    held-out prompts, each answered greedily by the model."""

    task_metric: Literal["exact_match", "python_syntax"] = Field(
        default="exact_match",
        description="the checker applied to each held-out answer: `exact_match` (the answer equals the "
        "reference response, surrounding whitespace aside) or `python_syntax` (the prompt and the answer "
        "together parse as Python)",
    )
    task_prompts: int = Field(
        default=16, ge=0, description="held-out prompts answered for the task metric (0 turns it off)"
    )
    max_new_tokens: int = Field(default=96, ge=1, description="tokens an answer may have at most")
    samples: int = Field(
        default=3, ge=0, description="held-out prompts whose answers before and after the stage the report shows"
    )


class DPOSpec(_Strict):
    """Direct preference optimisation against a frozen reference: the stage's initial weights."""

    beta: float = Field(
        default=0.1,
        gt=0,
        description="strength of the pull towards the reference: the implicit reward is beta x (policy - "
        "reference) log-probability of a response",
    )


class LoRASpec(_Strict):
    """Low-rank adapters (Hu et al. 2021): only the adapters train; the base stays frozen and is merged
    with them at export."""

    rank: int = Field(default=8, ge=1, description="rank r of each adapter (A is r x in, B is out x r)")
    alpha: float = Field(default=16.0, gt=0, description="scale numerator: the update is (alpha / rank) x B A")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on an adapter's input during training")
    targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description=f"projections that get adapters, by their Hugging Face names: {', '.join(LORA_TARGETS)}",
    )

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, v: list[str]) -> list[str]:
        unknown = [t for t in v if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"unknown LoRA targets {unknown}; choose from {list(LORA_TARGETS)}")
        if len(set(v)) != len(v):
            raise ValueError(f"LoRA targets repeat: {v}")
        return v


class PromptMessage(_Strict):
    """One message of a chat prompt in eval.prompts (rendered with the model's chat template)."""

    role: Literal["system", "user", "assistant"] = Field(description="who says it: `system`, `user` or `assistant`")
    content: str = Field(description="what the message says")

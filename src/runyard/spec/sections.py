"""The sections of a job spec other than `data` (runyard.spec.data): model, optimizer, schedule,
training length, stages and their gates, evaluation, checkpoints, resources, costs and traffic.

`runyard.spec.job` assembles them into `JobSpec` and re-exports them. Every field carries a description (what
it means, its unit); the spec reference and the JSON Schema are generated from them.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from runyard.market.requirement import ACCELERATOR_KINDS, Requirement
from runyard.spec.data_instruct import InstructDataSpec
from runyard.spec.finetune import DPOSpec, LoRASpec, PromptMessage, SFTSpec
from runyard.spec.predictive import CnnSpec, LinearSpec, PredictionEvalSpec, TreesSpec

# The model families a spec may name (runyard.model.registry registers each under the same name).
Family = Literal["cnn", "decoder", "lightgbm", "linear"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _InitRules(_Strict):
    """Where a stage's initial weights come from instead of a random initialisation."""

    @property
    def source(self) -> str:
        """The `from` field (a Python keyword, so the model is built by create_model below)."""
        return getattr(self, "from")

    @model_validator(mode="after")
    def _fields_match_source(self) -> _InitRules:
        if self.source == "stage":
            if self.name is None or self.path is not None:
                raise ValueError("{from: stage} takes `name` (an earlier stage) and no `path`")
        elif self.path is None or self.name is not None:
            raise ValueError(f"{{from: {self.source}}} takes `path` (a model directory) and no `name`")
        return self


InitSpec = create_model(
    "InitSpec",
    __base__=_InitRules,
    __doc__="Where a stage's initial weights come from instead of a random initialisation.",
    **{
        "from": (Literal["stage", "export", "hf"], Field(
            description="`stage`: an earlier stage's final weights (its verified last checkpoint); `export`: a "
            "runyard export directory (checksums verified); `hf`: a local Hugging Face model directory "
            "(config.json naming LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM, model.safetensors or "
            "shards with model.safetensors.index.json, tokenizer.json, tokenizer_config.json). Nothing is "
            "downloaded",
        )),
        "name": (str | None, Field(default=None, description="with `from: stage`: the earlier stage's name")),
        "path": (str | None, Field(
            default=None, description="with `from: export` or `from: hf`: the model directory (relative paths from "
            "where runyard runs)",
        )),
    },
)

_NULL_FROM_WEIGHTS = "; with model.init, null takes the weights' value and a set value must equal it"


class ModelSpec(_Strict):
    """The model. Language models: a Llama-style decoder (RMSNorm, rotary positions, SwiGLU, grouped-query
    attention), shaped by the fields below, trained from random weights or started from existing ones
    (`init`). Tabular tasks: `lightgbm` or `linear` (section `trees` or `linear`); images: `cnn` (section
    `cnn`)."""

    family: Family | None = Field(
        default=None,
        description="the model family: `decoder` (language_model), `lightgbm` or `linear` (tabular tasks), `cnn` "
        "(image_classification). null: `decoder` for a language model, else the one the data recommends "
        "(runyard.model.choice, the rule `runyard plan` recommends by: trees for tables of 100 rows or more, a linear model below; a CNN for "
        "images), recorded in the manifest. The flat fields below are the decoder's",
    )
    init: InitSpec | None = Field(
        default=None,
        description="start from existing weights instead of random ones: `{from: stage, name: NAME}`, "
        "`{from: export, path: DIR}` or `{from: hf, path: DIR}`. The model's shape comes from the weights, and "
        "with an export or a Hugging Face directory so does the run's tokenizer (data is tokenized with it; "
        "no BPE is trained). Set at the top level, every stage inherits it; null: random weights",
    )
    vocab_size: int | None = Field(
        default=None,
        ge=2,
        description="rows of the embedding table (token ids the model knows); null takes the tokenizer's "
        "vocabulary size. It must be at least the tokenizer's; rows beyond it are never used (warned)"
        + _NULL_FROM_WEIGHTS,
    )
    d_model: int | None = Field(
        default=None, ge=8, description="width of the residual stream (hidden size), in units; null: 256" + _NULL_FROM_WEIGHTS
    )
    n_layers: int | None = Field(default=None, ge=1, description="transformer blocks; null: 4" + _NULL_FROM_WEIGHTS)
    n_heads: int | None = Field(
        default=None,
        ge=1,
        description="attention (query) heads; d_model must divide by it and d_model / n_heads must be "
        "even (rotary embeddings); null: 4" + _NULL_FROM_WEIGHTS,
    )
    n_kv_heads: int | None = Field(
        default=None,
        ge=1,
        description="key/value heads (grouped-query attention); null means n_heads. n_heads must be a "
        "multiple of it" + _NULL_FROM_WEIGHTS,
    )
    ffn_hidden: int | None = Field(
        default=None,
        ge=1,
        description="width of the SwiGLU feed-forward layer; null means 8/3 d_model rounded up to a "
        "multiple of 32" + _NULL_FROM_WEIGHTS,
    )
    context_length: int = Field(
        default=256,
        ge=2,
        description="tokens per training sequence, and the most the model attends to when generating; "
        "each split must hold at least context_length + 1 tokens. With model.init, at most the weights' "
        "context (max_position_embeddings), which the model keeps",
    )
    tie_embeddings: bool | None = Field(
        default=None,
        description="share one matrix between the input embedding and the output projection; null: true"
        + _NULL_FROM_WEIGHTS,
    )
    dropout: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="dropout probability during training (0 turns it off)"
    )
    rope_theta: float | None = Field(
        default=None, gt=0, description="base of the rotary embedding frequencies; null: 10000" + _NULL_FROM_WEIGHTS
    )
    norm_eps: float | None = Field(
        default=None, gt=0, description="epsilon added inside RMSNorm; null: 1e-5" + _NULL_FROM_WEIGHTS
    )
    trees: TreesSpec | None = Field(default=None, description="family `lightgbm`: the boosting settings (null: the defaults)")
    linear: LinearSpec | None = Field(
        default=None, description="family `linear` (and the trees' baseline): the linear model's settings (null: the defaults)"
    )
    cnn: CnnSpec | None = Field(default=None, description="family `cnn`: the network's shape (null: the defaults)")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.init is not None:
            return self  # the shape is the weights'; checked against them before the run starts
        d_model, heads = self.d_model or 256, self.n_heads or 4
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({heads})")
        if (d_model // heads) % 2:
            raise ValueError("head dimension d_model/n_heads must be even for rotary embeddings")
        kv = self.n_kv_heads or heads
        if heads % kv:
            raise ValueError(f"n_heads ({heads}) must be a multiple of n_kv_heads ({kv})")
        return self


class OptimSpec(_Strict):
    """The optimizer: AdamW. Norm weights, biases and embeddings are not decayed unless the flags say so."""

    lr: float = Field(default=3e-3, gt=0, le=10, description="peak learning rate, reached at the end of warmup")
    betas: tuple[float, float] = Field(
        default=(0.9, 0.95),
        description="AdamW's [beta1, beta2]: decay rates of the gradient's first and second moment "
        "estimates, each in [0, 1)",
    )
    eps: float = Field(default=1e-8, gt=0, description="AdamW's epsilon, added to the denominator")
    weight_decay: float = Field(
        default=0.1, ge=0, description="decoupled weight decay (per step, scaled by the learning rate)"
    )
    decay_norms_and_biases: bool = Field(default=False, description="apply weight decay to norm weights and biases too")
    decay_embeddings: bool = Field(default=False, description="apply weight decay to the embedding table too")
    grad_clip: float | None = Field(
        default=1.0,
        gt=0,
        description="clip the gradients' global L2 norm to this before each step; null turns clipping off",
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v


class ScheduleSpec(_Strict):
    """The learning-rate schedule: linear warmup to optim.lr, then decay to optim.lr x min_lr_ratio at
    the stage's last step."""

    warmup_steps: int = Field(
        default=20,
        ge=0,
        description="optimizer steps of linear warmup; longer than a stage's train.steps is warned (the rate "
        "would never reach optim.lr)",
    )
    decay: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="shape after warmup: `cosine`, `linear`, or `constant` (no decay)"
    )
    min_lr_ratio: float = Field(
        default=0.1, ge=0.0, le=1.0, description="the learning rate at the last step, as a fraction of optim.lr"
    )


class TrainSpec(_Strict):
    """How long and how wide a stage trains. Global batch = batch_size x grad_accum x processes."""

    steps: int = Field(default=200, ge=1, description="optimizer steps in the stage")
    batch_size: int = Field(default=16, ge=1, description="sequences per micro-batch per process")
    grad_accum: int = Field(default=1, ge=1, description="micro-batches accumulated into one optimizer step")
    log_interval: int | None = Field(
        default=None,
        ge=1,
        description="steps between the loop's readbacks of the device (losses, gradient norms, token counts and "
        "metrics stay on the device until then; metrics.jsonl still has a row per step, written then) and between "
        "its checks for a stop request; evaluations and checkpoints also log. null: 1 on a CPU, 10 on a GPU",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        default="none",
        description="recompute blocks' activations in backward instead of keeping them: `none`, `full` (every "
        "block keeps only its input; about a third more compute) or `selective` (every "
        "`activation_checkpointing_every`-th block); losses are unchanged and the plan counts the memory saved",
    )
    activation_checkpointing_every: int = Field(
        default=2, ge=1, description="with `activation_checkpointing: selective`: recompute blocks k, 2k, 3k, ... (k this)"
    )
    nonfinite: Literal["stop", "skip_step"] = Field(
        default="stop",
        description="a non-finite loss or gradient norm: `stop` the stage before that step's optimizer step (exit "
        "6; the checkpoints before it stay the latest) or `skip_step` (its gradients dropped, no optimizer step, "
        "counted in metrics as `nonfinite_skipped`; costs one readback of a flag per step)",
    )
    nonfinite_budget: int = Field(
        default=5, ge=0, description="with `nonfinite: skip_step`: steps the stage may skip; one more stops it (exit 6)"
    )


class GateSpec(_Strict):
    """A stage's gates: a stage passes only if every set gate passes, and a later stage never starts
    on a failed one. null turns a gate off."""

    min_loss_drop: float | None = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="fraction by which the training loss must fall: the mean of the stage's first steps "
        "(up to 10) against the mean of its last ones",
    )
    require_finite: bool = Field(default=True, description="every training and held-out loss must be finite (no NaN or Inf)")
    max_heldout_loss: float | None = Field(
        default=None, gt=0, description="bound on the held-out loss (nats per token) at the end of the stage"
    )
    min_heldout_loss_drop: float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description="fraction by which the held-out loss must fall during the stage: from the stage's initial "
        "weights (sft and dpo stages, evaluated before their first step) or its first held-out evaluation "
        "(pretrain stages), to its last evaluation",
    )
    checkpoint_roundtrip: bool = Field(
        default=True, description="reload the stage's final checkpoint and compare every tensor bitwise with the model"
    )
    min_tokens_per_s: float | None = Field(
        default=None, gt=0, description="floor on steady-state training throughput, tokens per second over all processes"
    )
    min_samples_per_s: float | None = Field(
        default=None,
        gt=0,
        description="image_classification: floor on steady-state training throughput, images per second over all processes",
    )
    min_reward_accuracy: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="dpo stages: floor on the held-out reward accuracy at the end (the fraction of pairs whose "
        "chosen response gets the higher implicit reward)",
    )
    min_reward_margin: float | None = Field(
        default=None,
        description="dpo stages: floor on the held-out mean reward margin (chosen minus rejected) at the end",
    )


class StageSpec(_Strict):
    """One stage. Unset sections inherit the top level; set fields override it one by one."""

    name: str = Field(
        description="the stage's name (1-64 letters, digits, '_', '.' or '-'); it names stages/<name>/ in "
        "the run directory"
    )
    model: dict[str, Any] = Field(
        default_factory=dict, description="fields of the top-level `model` this stage changes (same keys)"
    )
    optim: dict[str, Any] = Field(
        default_factory=dict, description="fields of the top-level `optim` this stage changes (same keys)"
    )
    schedule: dict[str, Any] = Field(
        default_factory=dict, description="fields of the top-level `schedule` this stage changes (same keys)"
    )
    train: dict[str, Any] = Field(
        default_factory=dict, description="fields of the top-level `train` this stage changes (same keys)"
    )
    gates: GateSpec = Field(default_factory=GateSpec, description="the checks this stage must pass")
    kind: Literal["pretrain", "sft", "dpo"] = Field(
        default="pretrain",
        description="the objective: `pretrain` (next token on the top-level data), `sft` (instruction tuning: "
        "the loss on the assistant's tokens only) or `dpo` (preference pairs against a frozen reference, the "
        "stage's initial weights); sft and dpo read the stage's own `data`",
    )
    data: InstructDataSpec | None = Field(
        default=None, description="the instruction (sft) or preference (dpo) records; only those kinds have it"
    )
    sft: SFTSpec = Field(default_factory=SFTSpec, description="sft stages: the task metric and samples")
    dpo: DPOSpec = Field(default_factory=DPOSpec, description="dpo stages: beta")
    lora: LoRASpec | None = Field(
        default=None, description="train low-rank adapters on a frozen base instead of every weight; null: all"
    )

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", v):
            raise ValueError("a stage name is 1-64 letters, digits, '_', '.' or '-'")
        return v

    @model_validator(mode="after")
    def _kind_has_its_data(self) -> StageSpec:
        if self.kind == "pretrain" and self.data is not None:
            raise ValueError("a pretrain stage reads the top-level data; `data` is for sft and dpo stages")
        if self.kind != "pretrain" and self.data is None:
            raise ValueError(f"a {self.kind} stage needs its own `data` (instruction or preference records)")
        if self.kind != "dpo" and (self.gates.min_reward_accuracy is not None or self.gates.min_reward_margin is not None):
            raise ValueError("reward gates (min_reward_accuracy, min_reward_margin) apply to dpo stages only")
        return self


class EvalSpec(_Strict):
    """Held-out evaluation (during training and at the end), the fit-to-ship verdict and sample
    generations."""

    interval: int = Field(default=50, ge=1, description="optimizer steps between held-out evaluations during training")
    batches: int = Field(default=8, ge=1, description="held-out batches scored at each evaluation during training")
    final_batches: int = Field(
        default=32,
        ge=1,
        description="held-out batches (each the last stage's batch_size sequences of context_length tokens) "
        "scored by the final evaluation; fewer when the held-out split is smaller (warned)",
    )
    max_heldout_perplexity: float | None = Field(
        default=None, gt=1, description="fit to ship only if the final held-out perplexity is at most this"
    )
    max_gap: float | None = Field(
        default=None,
        gt=0,
        description="fit to ship only if held-out loss minus train loss (nats per token) is at most this "
        "(a memorisation bound)",
    )
    must_beat_unigram: bool = Field(
        default=True,
        description="fit to ship only if the held-out loss beats the unigram baseline (each token predicted by "
        "its frequency in the training split) by unigram_margin",
    )
    unigram_margin: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="fraction by which the held-out loss (nats per token) must fall below the unigram "
        "baseline's for must_beat_unigram: 0.1 means at least 10% lower, 0 means any lower",
    )
    min_response_loss_drop: float | None = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="when the last stage is sft: fit to ship only if its held-out response loss fell by at "
        "least this fraction from the stage's initial weights' (evaluated before its first step); 0 means any "
        "fall, null no bound. Such a run is judged on its last stage's own figures, not on the unigram baseline",
    )
    min_task_score: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="when the last stage is sft with a task metric (sft.task_metric): fit to ship only if the "
        "share of held-out prompts it answers right is at least this; null: at least the initial weights' share",
    )
    min_reward_accuracy: float | None = Field(
        default=0.5,
        ge=0,
        le=1,
        description="when the last stage is dpo: fit to ship only if its held-out reward accuracy (pairs whose "
        "chosen response gets the higher implicit reward) is at least this; null no bound",
    )
    min_reward_margin: float | None = Field(
        default=0.0,
        description="when the last stage is dpo: fit to ship only if its held-out mean reward margin (chosen "
        "minus rejected) is above this; null no bound",
    )
    stall_fraction: float | None = Field(
        default=0.2,
        gt=0,
        le=1,
        description="flag a stage in the report when its best held-out loss came this fraction of its steps "
        "or more before its end, with no better evaluation since (overfitting, or steps that did not help); "
        "null turns the flag off. A flag does not change the verdict",
    )
    prompts: list[str | list[PromptMessage]] = Field(
        default_factory=lambda: ["def ", "import ", "class "],
        description="prompts completed by the exported model; the completions are shown in the report. A prompt is "
        "text as it is, or a chat (a list of {role, content}) rendered with the model's chat template and its "
        "generation prompt, as the chat endpoint serves it. When the last stage is sft or dpo each prompt is "
        "also completed by the weights that stage began with, shown beside the export's",
    )
    sample_tokens: int = Field(default=48, ge=1, description="tokens generated per sample")
    temperature: float = Field(default=0.8, ge=0, description="sampling temperature of the samples; 0 is greedy")
    top_k: int | None = Field(default=40, ge=1, description="sample among the k most likely tokens; null: among all")
    prediction: PredictionEvalSpec | None = Field(
        default=None,
        description="tabular and image tasks: the metric bounds and baseline check of the fit-to-ship verdict (null: "
        "the defaults, which require beating the baseline)",
    )


class CheckpointSpec(_Strict):
    """Checkpoints: written atomically at an interval and at a stage's last step, kept by a retention
    policy."""

    interval: int = Field(default=50, ge=1, description="optimizer steps between checkpoints (the last step is always saved)")
    keep_last: int = Field(
        default=2,
        ge=1,
        description="newest checkpoints kept per stage; older ones are deleted. Disk needed before a run "
        "starts counts keep_last + 1 (one being written) checkpoints per stage, + 1 with keep_best",
    )
    keep_best: bool = Field(default=True, description="also keep the checkpoint with the lowest held-out loss")


class ParallelSpec(_Strict):
    """A layout on one device mesh (torchtitan's): data-parallel replicas, FSDP2 shards, tensor and
    pipeline parallelism; dp_replicate x dp_shard x tp x pp must equal the world size. `ddp` and `fsdp`
    are shorthands."""

    dp_replicate: int = Field(default=1, ge=1, description="full replicas (DDP's axis)")
    dp_shard: int = Field(default=1, ge=1, description="processes that shard parameters, gradients and optimizer state (FSDP2)")
    tp: int = Field(
        default=1,
        ge=1,
        description="tensor-parallel degree: each block's projections split column- and row-wise over this many "
        "processes (the family's plan; for the decoder its heads and its feed-forward width must divide by it); "
        "pretrain and sft stages (dpo and LoRA refused); alone (tp = world size) or inside FSDP (dp_shard x tp, "
        "pretrain only), not yet with dp_replicate",
    )
    pp: int = Field(
        default=1,
        ge=1,
        description="pipeline-parallel degree: the model's blocks split into this many consecutive stages, one per "
        "process (the decoder: embeddings on the first, final norm, head and loss on the last), driven by "
        "torch.distributed.pipelining; pretrain and sft stages (dpo and LoRA refused), not yet combined with data or "
        "tensor parallelism",
    )
    pp_microbatches: int | None = Field(
        default=None,
        ge=1,
        description="micro-batches each `train.batch_size` batch is split into along the batch for the pipeline "
        "schedule (it must divide train.batch_size; 1f1b needs at least pp of them). null: pp",
    )
    pp_schedule: Literal["1f1b", "gpipe"] = Field(
        default="1f1b",
        description="the pipeline schedule: `1f1b` (one forward, one backward: at most pp micro-batches' "
        "activations alive) or `gpipe` (every forward, then every backward)",
    )

    @model_validator(mode="after")
    def _pipeline_fields_need_a_pipeline(self) -> ParallelSpec:
        if self.pp == 1 and self.pp_microbatches is not None:
            raise ValueError("resources.parallel.pp_microbatches is set but resources.parallel.pp is 1 (no pipeline)")
        if self.pp > 1 and self.pp_microbatches is not None and self.pp_schedule == "1f1b" \
                and self.pp_microbatches < self.pp:
            raise ValueError(f"resources.parallel.pp_microbatches ({self.pp_microbatches}) must be at least "
                             f"resources.parallel.pp ({self.pp}) under pp_schedule 1f1b")
        return self


class ResourcesSpec(_Strict):
    """Where and how the run computes, and the requirement a market or scheduler acts on."""

    device: Literal["cpu", "cuda", "auto"] = Field(default="auto", description="`cpu`, `cuda`, or `auto` (cuda when available)")
    precision: Literal["fp32", "bf16", "auto"] = Field(
        default="auto",
        description="`fp32`, or `bf16` autocast on CUDA (`auto` is bf16 on CUDA and fp32 on CPU; bf16 on a "
        "CPU trains in fp32)",
    )
    compile: bool = Field(default=False, description="compile the model with torch.compile")
    nproc: int = Field(default=1, ge=1, description="worker processes on this node, under torchrun (`--nproc` overrides)")
    parallel: Literal["ddp", "fsdp"] | ParallelSpec = Field(
        default="ddp",
        description="with several processes: `ddp` (a full replica each), `fsdp` (parameters, gradients and "
        "optimizer state sharded; FSDP2), or a layout `{dp_replicate, dp_shard, tp, pp}` whose product is the "
        "world size (`{tp: 2}`: tensor parallel over two processes; `{dp_shard: 2, tp: 2}`: FSDP over two "
        "tensor-parallel pairs on one 2-D mesh; `{pp: 2}`: two pipeline stages; tensor and pipeline parallel "
        "train pretrain and sft stages without LoRA, and are not yet combined with replicas, with each other, "
        "nor pipeline parallel with FSDP)",
    )
    deterministic: bool = Field(
        default=True, description="use deterministic algorithms (torch.use_deterministic_algorithms, warn only)"
    )
    threads: int | None = Field(
        default=None,
        ge=1,
        description="CPU threads per process, for torch and LightGBM alike. null: $OMP_NUM_THREADS when set, else "
        "the cores this process may use (its CPU affinity, capped by a cgroup CPU quota) divided by the worker "
        "processes on this node, at least 1; the run records the number and its source in the manifest "
        "(`threads`)",
    )
    requirement: Requirement = Field(
        default_factory=Requirement,
        description="the hardware the run needs, where and when; the same schema as a market demand's",
    )


class CostsSpec(_Strict):
    """What compute costs: prices per device-hour (rented on demand, or reserved at a discount) and the
    facility's overhead on power. `runyard plan` prices training and serving with them."""

    currency: str = Field(
        default="USD",
        pattern=r"^[A-Z]{3}$",
        description="ISO 4217 code of the prices; every amount is in its minor units (cents for USD). runyard's "
        "own price table is in USD, so another currency needs a price in costs.prices for every kind a plan uses",
    )
    prices: dict[str, int] = Field(
        default_factory=dict,
        description="price per device-hour in minor units, by accelerator kind (`cpu` is one core), e.g. "
        "{h100-80gb: 299}; a kind not listed takes runyard's table (runyard.plan.devices, 2025 on-demand list "
        "prices in US cents)",
    )
    capacity: Literal["rented", "reserved"] = Field(
        default="rented",
        description="`rented`: on-demand prices as they are; `reserved`: capacity committed ahead, at "
        "reserved_discount off",
    )
    reserved_discount: float = Field(
        default=0.35,
        ge=0,
        lt=1,
        description="fraction off the rented price for reserved capacity (0.35: a typical one-year commitment); "
        "used when capacity is `reserved`",
    )
    pue: float = Field(
        default=1.0,
        ge=1,
        le=3,
        description="power usage effectiveness: the facility's draw over the devices' own (cooling, power "
        "conversion); energy in kWh is the devices' draw times time times this. 1.0 counts the devices alone",
    )

    @field_validator("prices")
    @classmethod
    def _known_kinds(cls, v: dict[str, int]) -> dict[str, int]:
        unknown = sorted(set(v) - set(ACCELERATOR_KINDS))
        if unknown:
            raise ValueError(f"unknown accelerator kind(s) {unknown}; expected some of {list(ACCELERATOR_KINDS)}")
        negative = sorted(k for k, price in v.items() if price < 0)
        if negative:
            raise ValueError(f"prices must be 0 or more minor units per device-hour; {negative} are negative")
        return v


class TrafficSpec(_Strict):
    """Expected inference traffic once the model serves: `runyard plan` and the evaluation report weigh the
    training cost against the cumulative cost of serving it."""

    requests_per_day: float = Field(ge=0, description="requests the served model answers per day, on average")
    tokens_per_request: int | None = Field(
        default=None,
        ge=1,
        description="language models: tokens each request processes, prompt and completion together (each "
        "costs one forward pass of the model per token); null takes the final stage's context_length",
    )
    rows_per_request: int | None = Field(
        default=None,
        ge=1,
        description="tabular and image models: rows (or images) each request predicts; null means 1",
    )
    peak_to_mean: float = Field(
        default=2.0,
        ge=1,
        description="the busiest hour's traffic over the day's mean: serving hardware is provisioned for the peak",
    )
    horizon_days: int = Field(
        default=365, ge=1, le=3650, description="days of serving the lifetime table and plot cover"
    )

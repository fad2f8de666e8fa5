"""A Hugging Face `config.json` <-> runyard's `ModelConfig`, for the decoder families that share runyard's
block: LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM.

Reading is strict: every field is either understood (and its value supported), or known to change
nothing in the computation (bookkeeping such as `transformers_version`, token ids, generation
defaults), or refused with an error naming the field and the file. A model runyard loads computes the
same function transformers computes, never an approximation of it.

Both ways of writing rotary settings are read: transformers 4's `rope_theta` + `rope_scaling` and
transformers 5's `rope_parameters`. Both are written, so either version loads an export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runyard.model.config import ROPE_SCALING_KEYS, ModelConfig, check_rope_scaling
from runyard.model.hf.errors import ModelDirectoryError

CONFIG_FILE = "config.json"

# The architectures runyard loads, with their `model_type`.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
MODEL_TYPES = {model_type: arch for arch, model_type in ARCHITECTURES.items()}
MISTRAL_DEFAULT_WINDOW = 4096  # MistralConfig's sliding_window when config.json does not set it

# runyard's config field -> the Hugging Face field that holds it (for messages that name both).
HF_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_hidden": "intermediate_size",
    "context_length": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings")
# transformers' defaults for the optional fields (the same in all three classes).
_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}

# Fields that change nothing runyard computes: bookkeeping, token ids, initialisation, caching flags,
# and PretrainedConfig's generic attributes (which older transformers wrote out in full).
_INERT = frozenset({
    "_name_or_path", "_commit_hash", "_attn_implementation_autoset", "transformers_version", "architectures",
    "model_type", "torch_dtype", "dtype", "use_cache", "initializer_range", "bos_token_id", "eos_token_id",
    "pad_token_id", "sep_token_id", "decoder_start_token_id", "tokenizer_class", "output_attentions",
    "output_hidden_states", "return_dict", "torchscript", "use_bfloat16", "id2label", "label2id",
    "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "tie_encoder_decoder", "cross_attention_hidden_size", "prefix", "task_specific_params",
    "finetuning_task", "pruned_heads", "tf_legacy_loss", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "max_window_layers",
})


class _Reader:
    """Takes fields out of one config.json, so that whatever is left over at the end is named."""

    def __init__(self, data: dict[str, Any], path: Path):
        self.data, self.path, self.used = data, path, set()

    def fail(self, field: str | None, message: str) -> ModelDirectoryError:
        return ModelDirectoryError(self.path, message, field)

    def has(self, field: str) -> bool:
        return self.data.get(field) is not None

    def take(self, field: str, default: Any = None) -> Any:
        self.used.add(field)
        value = self.data.get(field)
        if value is None:
            if field in _REQUIRED:
                raise self.fail(field, "is missing; runyard needs it to build the model")
            return _DEFAULTS.get(field, default)
        return value

    def integer(self, field: str, default: int | None = None) -> int:
        value = self.take(field, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(field, f"must be a positive integer, got {value!r}")
        return value

    def number(self, field: str) -> float:
        value = self.take(field)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise self.fail(field, f"must be a positive number, got {value!r}")
        return float(value)

    def expect(self, field: str, allowed: tuple[Any, ...], why: str) -> None:
        """The field, when present, must hold one of `allowed` (values runyard computes exactly)."""
        value = self.take(field)
        if value is not None and value not in allowed:
            raise self.fail(field, f"= {value!r} is not supported ({why}); runyard computes {list(allowed)}")

    def leftover(self) -> list[str]:
        return sorted(k for k in self.data if k not in self.used and k not in _INERT)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or ModelDirectoryError saying why not."""
    if not path.is_file():
        raise ModelDirectoryError(path, "is missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelDirectoryError(path, f"is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelDirectoryError(path, f"must hold a JSON object, not {type(data).__name__}")
    return data


def read_config(directory: Path) -> ModelConfig:
    """The ModelConfig of the Hugging Face model directory `directory` (its config.json)."""
    path = Path(directory) / CONFIG_FILE
    return config_from_hf(read_json(path), path)


def config_from_hf(data: dict[str, Any], path: Path) -> ModelConfig:
    """ModelConfig from a parsed config.json (read from `path`, named in errors). Raises
    ModelDirectoryError naming the first field runyard does not support."""
    r = _Reader(data, path)
    arch = _architecture(r)
    d_model, n_heads = r.integer("hidden_size"), r.integer("num_attention_heads")
    n_kv_heads = r.integer("num_key_value_heads", n_heads)
    context = r.integer("max_position_embeddings")
    if r.has("head_dim") and r.take("head_dim") != d_model // n_heads:
        raise r.fail("head_dim", f"= {data['head_dim']!r} differs from hidden_size / num_attention_heads "
                                 f"= {d_model // n_heads}; runyard's attention derives it")
    r.take("head_dim")
    r.expect("hidden_act", ("silu",), "the feed-forward activation")
    r.expect("attention_dropout", (0, 0.0), "dropout inside attention")
    r.expect("partial_rotary_factor", (1, 1.0), "rotary embedding over part of each head")
    if "quantization_config" in data:
        raise r.fail("quantization_config", "quantized weights are not supported; use an unquantized model")
    qkv_bias = arch == "Qwen2ForCausalLM"  # Qwen2's q/k/v projections always carry biases
    if arch == "LlamaForCausalLM":
        r.expect("attention_bias", (False,), "biases on every attention projection")
        r.expect("mlp_bias", (False,), "biases in the feed-forward layer")
        r.expect("pretraining_tp", (1,), "tensor-parallel slicing of the projections")
    theta, scaling = _rope(r, context)
    window = _sliding_window(r, arch, context)
    shape = {"vocab_size": r.integer("vocab_size"), "n_layers": r.integer("num_hidden_layers"),
             "ffn_hidden": r.integer("intermediate_size"), "tie_embeddings": _boolean(r, "tie_word_embeddings"),
             "norm_eps": r.number("rms_norm_eps")}
    extra = r.leftover()
    if extra:
        others = f" (nor are {extra[1:]})" if extra[1:] else ""
        raise r.fail(extra[0], f"is not a field runyard knows for {arch}{others}; refusing rather than ignoring it")
    try:
        return ModelConfig(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, context_length=context,
                           rope_theta=theta, qkv_bias=qkv_bias, rope_scaling=scaling, sliding_window=window, **shape)
    except ValueError as exc:
        raise r.fail(None, f"describes a model runyard cannot build: {exc}") from None


def _architecture(r: _Reader) -> str:
    archs = r.take("architectures")
    model_type = r.take("model_type")
    if archs is None:
        if model_type not in MODEL_TYPES:
            raise r.fail("model_type", f"= {model_type!r} names no architecture runyard loads "
                                       f"(it loads {sorted(ARCHITECTURES)}), and there is no 'architectures'")
        return MODEL_TYPES[model_type]
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise r.fail("architectures", f"= {archs!r}: runyard loads exactly one of {sorted(ARCHITECTURES)}")
    arch = archs[0]
    if model_type is not None and model_type != ARCHITECTURES[arch]:
        raise r.fail("model_type", f"= {model_type!r} does not match architecture {arch} "
                                   f"(model_type {ARCHITECTURES[arch]!r})")
    return arch


def _boolean(r: _Reader, field: str) -> bool:
    value = r.take(field)
    if not isinstance(value, bool):
        raise r.fail(field, f"must be true or false, got {value!r}")
    return value


def _rope(r: _Reader, context: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers 5's rope_parameters or 4's rope_theta/rope_scaling."""
    if r.has("rope_parameters"):
        params, field = r.take("rope_parameters"), "rope_parameters"
        r.used.update({"rope_theta", "rope_scaling"})  # older copies of the same, if present
        if not isinstance(params, dict) or "rope_theta" not in params:
            raise r.fail(field, f"= {params!r}: expected one mapping with rope_theta (per-layer rotary "
                                "settings are not supported)")
        params = dict(params)
        theta = params.pop("rope_theta")
    else:
        theta = r.number("rope_theta")
        params, field = r.take("rope_scaling") or {}, "rope_scaling"
        if not isinstance(params, dict):
            raise r.fail(field, f"must be a mapping or null, got {params!r}")
        params = dict(params)
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise r.fail(f"{field}.rope_theta", f"must be a positive number, got {theta!r}")
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if params.pop("partial_rotary_factor", 1.0) not in (1, 1.0):
        raise r.fail(f"{field}.partial_rotary_factor", "rotary embedding over part of each head is not supported")
    if kind == "default":
        if params:
            raise r.fail(f"{field}.{sorted(params)[0]}", "is not used by the default rotary embedding")
        return float(theta), None
    if kind not in ROPE_SCALING_KEYS:
        raise r.fail(f"{field}.rope_type", f"= {kind!r} is not supported; runyard computes "
                                            f"{['default', *sorted(ROPE_SCALING_KEYS)]} exactly")
    if kind == "llama3":
        params.setdefault("original_max_position_embeddings", context)  # as transformers does
    scaling = {"rope_type": kind, **params}
    try:
        check_rope_scaling(scaling)
    except ValueError as exc:
        raise r.fail(field, str(exc)) from None
    return float(theta), scaling


def _sliding_window(r: _Reader, arch: str, context: int) -> int | None:
    """The sliding window when it is in force and covers the whole context (so it changes nothing);
    ModelDirectoryError when it is in force and shorter."""
    if arch == "LlamaForCausalLM":
        return None
    if arch == "MistralForCausalLM" and "sliding_window" not in r.data:
        r.data = {**r.data, "sliding_window": MISTRAL_DEFAULT_WINDOW}  # what transformers' MistralConfig uses
    window = r.take("sliding_window")
    in_force = window is not None
    if arch == "Qwen2ForCausalLM":
        layer_types = r.take("layer_types") or []
        if not isinstance(layer_types, list) or set(layer_types) - {"full_attention", "sliding_attention"}:
            raise r.fail("layer_types", f"= {layer_types!r}: runyard knows full_attention and sliding_attention")
        use_window = bool(r.take("use_sliding_window"))
        in_force = window is not None and (use_window or "sliding_attention" in layer_types)
    if not in_force:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise r.fail("sliding_window", f"must be a positive integer or null, got {window!r}")
    if window < context:
        raise r.fail("sliding_window", f"= {window} is shorter than max_position_embeddings = {context}: "
                                       "runyard's attention sees the whole context, so it would not be exact")
    return window


# Fields of the config.json a model came in with that its export keeps as they were: each is read and
# checked on the way in (it changes nothing runyard computes, or what it says runyard computes exactly),
# and rewriting it would hand back another file than the one that came in.
KEPT_FIELDS = {
    "LlamaForCausalLM": (),
    "MistralForCausalLM": ("sliding_window",),
    "Qwen2ForCausalLM": ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
}


def source_architecture(data: dict[str, Any]) -> str | None:
    """The architecture a parsed config.json names (its `architectures`, else its `model_type`), when it
    is one runyard loads."""
    archs = data.get("architectures")
    if isinstance(archs, list) and len(archs) == 1 and archs[0] in ARCHITECTURES:
        return archs[0]
    return MODEL_TYPES.get(data.get("model_type")) if archs is None else None


def _holds(arch: str, cfg: ModelConfig) -> bool:
    """Whether architecture `arch` computes what `cfg` describes."""
    if arch == "Qwen2ForCausalLM":
        return cfg.qkv_bias
    return not cfg.qkv_bias and (arch == "MistralForCausalLM" or cfg.sliding_window is None)


def hf_config(cfg: ModelConfig, token_ids: dict[str, int | None] | None = None,
              source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of `cfg` as transformers writes it. `source`: the config.json the weights came in
    with; its architecture goes out again (a Mistral stays MistralForCausalLM) with its KEPT_FIELDS as
    they were. Without one, the architecture is the plainest that holds the model: Qwen2ForCausalLM with
    q/k/v biases, MistralForCausalLM with a sliding window, LlamaForCausalLM otherwise. `token_ids`:
    bos_token_id, eos_token_id, pad_token_id."""
    theirs = source_architecture(source) if source is not None else None
    if theirs is not None and _holds(theirs, cfg):
        arch = theirs
    elif cfg.qkv_bias:
        arch = "Qwen2ForCausalLM"
    elif cfg.sliding_window is not None:
        arch = "MistralForCausalLM"
    else:
        arch = "LlamaForCausalLM"
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": ARCHITECTURES[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.context_length,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})},
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch == "LlamaForCausalLM":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch == "MistralForCausalLM":
        out["sliding_window"] = cfg.sliding_window
    else:
        del out["head_dim"]  # Qwen2's attention derives it
        # max_window_layers 0: every layer would use the window, which covers the whole context anyway.
        out.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                   max_window_layers=0 if cfg.sliding_window is not None else cfg.n_layers)
    if arch == theirs:
        out.update({key: source[key] for key in KEPT_FIELDS[arch] if key in source})
    out.update({k: v for k, v in (token_ids or {}).items() if v is not None})
    return out

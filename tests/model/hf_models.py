"""Small randomly initialised Hugging Face models of each architecture runyard loads, built with
transformers from a config and saved to disk by the test (nothing is downloaded), with a real
tokenizer.json and tokenizer_config.json beside them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nimport sys\n\nclass Thing:\n    pass\n",
    "for i in range(10):\n    print(i)  # café ✓\n",
    "while True:\n    break\n",
] * 20

SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64}

# name -> (architecture, extra config): each exercises something runyard's block must match exactly.
CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-tied-llama3-rope": ("LlamaForCausalLM", {"tie_word_embeddings": True, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    "llama-linear-rope": ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                               "rms_norm_eps": 1e-5}),
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "mistral-window-covers-context": ("MistralForCausalLM", {"sliding_window": 64}),
    "qwen2": ("Qwen2ForCausalLM", {"rope_theta": 1000000.0}),
    "qwen2-tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
}


def write_tokenizer(directory: Path, eos: str = "</s>", bos: str | None = "<s>") -> Tokenizer:
    """A byte-level BPE with a Llama-style start token (added to every encoding) and end token, saved as
    tokenizer.json + tokenizer_config.json in `directory`."""
    specials = [eos] + ([bos] if bos else [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos,
              "model_max_length": SHAPE["max_position_embeddings"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def hf_model(case: str, vocab_size: int = 320, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A model of `case` with every parameter drawn at random (biases and norms too, so a mapping that
    swaps or drops one shows in the logits)."""
    arch, extra = CASES[case]
    cls = getattr(transformers, arch)
    config = cls.config_class(vocab_size=vocab_size, **SHAPE, **{**extra, **overrides})
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


def save_hf_model(model: transformers.PreTrainedModel, directory: Path, max_shard_size: str | int = "5GB",
                  tokenizer: bool = True) -> Path:
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    if tokenizer:
        write_tokenizer(directory)
    return directory

"""Hugging Face model directories in and out of runyard's decoder (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM): the config (config.py), the tensor-name mapping (names.py), the safetensors files
(weights.py) and the directory as a whole (directory.py)."""

from runyard.model.hf.config import ARCHITECTURES, CONFIG_FILE, config_from_hf, hf_config, read_config
from runyard.model.hf.directory import check_weights, load_model, load_weights_into, write_model
from runyard.model.hf.errors import ModelDirectoryError
from runyard.model.hf.names import hf_to_runyard, layout, runyard_to_hf
from runyard.model.hf.weights import DEFAULT_SHARD_BYTES, INDEX_FILE, WEIGHTS_FILE, weight_files

__all__ = ["ARCHITECTURES", "CONFIG_FILE", "DEFAULT_SHARD_BYTES", "INDEX_FILE", "WEIGHTS_FILE", "ModelDirectoryError",
           "check_weights", "config_from_hf", "hf_config", "hf_to_runyard", "layout", "load_model", "load_weights_into",
           "read_config", "runyard_to_hf", "weight_files", "write_model"]

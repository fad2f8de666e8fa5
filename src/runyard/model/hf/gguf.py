"""An export as one GGUF file: the format llama.cpp loads (and Ollama, LM Studio, llama-cpp-python through it).

The file is written with the `gguf` package, llama.cpp's own writer, and read from the export's Hugging
Face files, as llama.cpp's convert_hf_to_gguf.py reads a LlamaForCausalLM directory:
- metadata: the `llama` architecture's hyperparameters (model/hf/config.py's ModelConfig);
- the tokenizer: every token of tokenizer.json in id order with its type (normal, control for special added
  tokens, user-defined for other added tokens, unused for ids past the tokenizer's vocabulary), its BPE
  merges, the special tokens and the chat template (read by the package's own `SpecialVocab`);
- every tensor under the name the package's tensor-name map gives it, the query and key projections
  permuted rows-wise: transformers' Llama rotates the two halves of each head, llama.cpp's `llama` rotates
  adjacent pairs, so each head's rows are interleaved (first half, second half) -> pairs.

The pre-tokenizer is declared, not guessed: llama.cpp's converter recognises a tokenizer by hashing how it
splits a test text against a table of known models, and refuses the ones it does not know (every tokenizer
runyard trains). runyard's trained BPE is byte-level with GPT-2's split, so the file says `gpt-2`; a
tokenizer.json whose pre-tokenizer is anything else is refused here, naming it, rather than written with a
split llama.cpp would get wrong.

Tensor types: f32 (the export's float32 weights bit for bit), f16, bf16, and q8_0 (blocks of 32 weights
with one f16 scale). As the converter does, 1-D tensors (the norms) stay f32, and a matrix whose rows do
not divide into q8_0 blocks falls back to f16. Tensors are read and written one at a time, so converting
costs about one tensor's memory beyond the writer's. The file is written under a temporary name beside
its destination and renamed into place, so a crash never leaves a partial file under the final name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer

from runyard.model.config import ModelConfig
from runyard.model.hf.config import read_config
from runyard.model.hf.export import TOKENIZER_FILE, verify_export
from runyard.model.hf.names import hf_names
from runyard.model.hf.weights import read_headers, read_tensor
from runyard.model.registry import ExportError
from runyard.system.files import fsync_dir

ARCHITECTURE = gguf.MODEL_ARCH.LLAMA
PRE_TOKENIZER = "gpt-2"  # llama.cpp's name for GPT-2's byte-level split (LLAMA_VOCAB_PRE_TYPE_GPT2)
TOKENIZER_MODEL = "gpt2"  # llama.cpp's name for a byte-level BPE vocabulary
Q = gguf.GGMLQuantizationType
# `--type` -> (the matrices' tensor type, the file type the header declares)
TYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f32": (Q.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
_PERMUTED = (".self_attn.q_proj.weight", ".self_attn.k_proj.weight")

__all__ = ["PRE_TOKENIZER", "TYPES", "default_gguf_path", "gguf_tensor_name", "rotary_pairs", "tensor_type",
           "write_gguf"]


def default_gguf_path(export_dir: Path, type_name: str) -> Path:
    """Where `runyard export-gguf` writes by default: RUN_DIR/model.TYPE.gguf for a run's export/,
    else NAME.TYPE.gguf beside an export directory NAME."""
    export_dir = Path(export_dir)
    stem = "model" if export_dir.name == "export" else export_dir.name
    return export_dir.parent / f"{stem}.{type_name}.gguf"


def write_gguf(export_dir: Path, out: Path, type_name: str = "f32") -> Path:
    """Write the decoder export `export_dir` as the GGUF file `out` with tensors of `type_name` (a key of
    TYPES). The export's checksums are verified first. ExportError when the model or its tokenizer is one
    llama.cpp's `llama` architecture would not compute exactly. Returns `out`."""
    export_dir, out = Path(export_dir), Path(out)
    if type_name not in TYPES:
        raise ExportError(f"GGUF tensor type {type_name!r} is not one runyard writes; choose one of {sorted(TYPES)}")
    provenance = verify_export(export_dir)
    if provenance.get("family", "decoder") != "decoder":
        raise ExportError(f"{export_dir} holds a {provenance['family']!r} model; only the decoder has a GGUF form")
    cfg = read_config(export_dir)
    _check_llama(cfg, export_dir)
    tokens, token_types = _vocabulary(export_dir / TOKENIZER_FILE, cfg.vocab_size)
    headers = read_headers(export_dir)
    names = hf_names(cfg)
    matrix_type, file_type = TYPES[type_name]
    name_map = gguf.get_tensor_name_map(ARCHITECTURE, cfg.n_layers)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[ARCHITECTURE])
    try:
        _hyperparameters(writer, cfg, file_type, _model_name(export_dir, provenance))
        _tokenizer(writer, export_dir, tokens, token_types)
        planned = []
        for name in names:
            shape = headers[name].shape
            qtype = tensor_type(shape, matrix_type)
            writer.add_tensor_info(gguf_tensor_name(name_map, name), _byte_shape(shape, qtype), np.dtype(np.uint8),
                                   _nbytes(shape, qtype), raw_dtype=qtype)
            planned.append((name, qtype))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, qtype in planned:  # one tensor in memory at a time
            data = _converted(read_tensor(headers[name], name), name, cfg)
            writer.write_tensor_data(gguf.quants.quantize(data, qtype).view(np.uint8))
        writer.close()
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def gguf_tensor_name(name_map: gguf.TensorNameMap, hf_name: str) -> str:
    """The GGUF name of a Hugging Face tensor name, from the gguf package's map for the architecture."""
    found = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if found is None:
        raise ExportError(f"the gguf package maps no {gguf.MODEL_ARCH_NAMES[ARCHITECTURE]} tensor to {hf_name!r}")
    return found


def tensor_type(shape: tuple[int, ...], matrix_type: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """The type a tensor of `shape` is stored in: 1-D ones in f32; matrices in `matrix_type`, or f16 when
    their rows do not divide into its blocks (as convert_hf_to_gguf.py falls back)."""
    if len(shape) < 2:
        return Q.F32
    block, _ = gguf.GGML_QUANT_SIZES[matrix_type]
    return matrix_type if shape[-1] % block == 0 else Q.F16


def rotary_pairs(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """A query or key projection's rows reordered from transformers' rotary layout (each head's first half
    rotates with its second half) to llama.cpp's (adjacent rows rotate together): within each head, row i
    of the first half and row i of the second half become rows 2i and 2i+1."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _converted(tensor: torch.Tensor, name: str, cfg: ModelConfig) -> np.ndarray:
    """A Hugging Face tensor as llama.cpp wants it: float32 numpy, Q/K rows in rotary pairs."""
    if name.endswith(_PERMUTED[0]):
        tensor = rotary_pairs(tensor, cfg.n_heads)
    elif name.endswith(_PERMUTED[1]):
        tensor = rotary_pairs(tensor, cfg.n_kv_heads)
    return np.ascontiguousarray(tensor.to(torch.float32).numpy())


def _byte_shape(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> tuple[int, ...]:
    return tuple(gguf.quants.quant_shape_to_byte_shape(shape, qtype))


def _nbytes(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> int:
    return int(np.prod(_byte_shape(shape, qtype)))


def _check_llama(cfg: ModelConfig, export_dir: Path) -> None:
    """Refuse what llama.cpp's `llama` architecture would not compute as runyard does."""
    where = export_dir / "config.json"
    if cfg.qkv_bias:
        raise ExportError(f"{where}: the model has query/key/value biases (Qwen2-style), which the GGUF `llama` "
                          "architecture runyard writes has no place for")
    if cfg.rope_scaling is not None and cfg.rope_scaling.get("rope_type") != "linear":
        raise ExportError(f"{where}: rope_scaling {cfg.rope_scaling.get('rope_type')!r} is not written to GGUF by "
                          "runyard (it writes default and linear rotary embeddings)")
    if cfg.head_dim % 2:
        raise ExportError(f"{where}: head_dim {cfg.head_dim} is odd; rotary embeddings need an even one")


def _hyperparameters(writer: gguf.GGUFWriter, cfg: ModelConfig, file_type: gguf.LlamaFileType, name: str) -> None:
    writer.add_name(name)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.context_length)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.ffn_hidden)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    if cfg.rope_scaling is not None:  # linear (_check_llama refuses the others)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(cfg.rope_scaling["factor"]))
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _model_name(export_dir: Path, provenance: dict[str, Any]) -> str:
    extra = provenance.get("extra") if isinstance(provenance.get("extra"), dict) else {}
    for key in ("run_name", "run", "name"):
        if isinstance(extra.get(key), str) and extra[key]:
            return extra[key]
    return export_dir.parent.name if export_dir.name == "export" else export_dir.name


def _vocabulary(path: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """(tokens, token types) for ids 0..vocab_size-1, as llama.cpp reads a byte-level BPE: ids the
    tokenizer does not use (the model's vocabulary may be larger) are `[PADi]`, unused."""
    spec = json.loads(path.read_text(encoding="utf-8"))
    _check_byte_level(spec, path)
    tok = Tokenizer.from_file(str(path))
    by_id = {i: token for token, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    if max(by_id, default=-1) >= vocab_size:
        raise ExportError(f"{path} has token id {max(by_id)}, past the model's vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def _check_byte_level(spec: dict[str, Any], path: Path) -> None:
    """The tokenizer must be what `tokenizer.ggml.pre = gpt-2` tells llama.cpp it is: a BPE over GPT-2's
    byte-level split (runyard's trained tokenizer), with no normaliser."""
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE":
        raise ExportError(f"{path}: model type {model.get('type')!r}; runyard writes GGUF for byte-level BPE tokenizers")
    if spec.get("normalizer") is not None:
        raise ExportError(f"{path}: a normalizer ({spec['normalizer'].get('type')!r}) that GGUF's gpt-2 "
                          "pre-tokenizer does not apply")
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) or pre.get("add_prefix_space"):
        raise ExportError(
            f"{path}: pre_tokenizer {json.dumps(pre)[:200]} is not GPT-2's byte-level split (ByteLevel with its "
            "regex, no prefix space), the one runyard declares to llama.cpp; convert this model with llama.cpp's "
            "convert_hf_to_gguf.py, which knows the pre-tokenizers of published models"
        )


def _tokenizer(writer: gguf.GGUFWriter, export_dir: Path, tokens: list[str], token_types: list[int]) -> None:
    writer.add_tokenizer_model(TOKENIZER_MODEL)
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    # Merges, special token ids, add_bos/add_eos and the chat template, as llama.cpp's converter reads them
    # from tokenizer.json, tokenizer_config.json and chat_template.jinja.
    special = gguf.SpecialVocab(export_dir, load_merges=True, n_vocab=len(tokens))
    if not special.merges:
        raise ExportError(f"{export_dir / TOKENIZER_FILE} holds no BPE merges")
    if "eos" not in special.special_token_ids:
        raise ExportError(f"{export_dir}: the tokenizer config names no end-of-sequence token in the vocabulary")
    # A runyard tokenizer has no start token: llama.cpp must not prepend one (its BPE default would be
    # id 11), and its bos id points at the end-of-document token, as GPT-2's does.
    special.special_token_ids.setdefault("bos", special.special_token_ids["eos"])
    special.add_special_token.setdefault("bos", False)
    special.add_special_token.setdefault("eos", False)
    special.add_to_gguf(writer, quiet=True)


"""runyard's tensor names <-> Hugging Face's, for the Llama-style decoder (after torchtune's
`hf_to_tune` / `tune_to_hf`).

runyard fuses two projections that transformers keeps apart: the query, key and value projections are
one `wqkv` (rows: queries, then keys, then values) and the SwiGLU gate and up projections one
`w_gate_up` (rows: gate, then up). Everything else maps one to one. Both sides use the same rotary
convention (rotate the two halves of each head), so no weight is permuted.

`layout(cfg)` is the whole mapping: for each runyard tensor, the Hugging Face tensors it is made of,
stacked along dim 0 in order. The loader streams through it tensor by tensor; `hf_to_runyard` and
`runyard_to_hf` apply it to whole state dicts.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from runyard.model.config import ModelConfig

TIED_HEAD = "lm_head.weight"  # runyard's and Hugging Face's name for the output projection
# Buffers older transformers saved with the weights; derived from the config, so skipped on load.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

Part = tuple[str, int]  # (Hugging Face name, rows it contributes)


def layout(cfg: ModelConfig) -> dict[str, list[Part]]:
    """runyard tensor name -> [(Hugging Face name, rows)], in state-dict order. A tied output head is
    left out (it is the embedding)."""
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out: dict[str, list[Part]] = {"tok_emb.weight": [("model.embed_tokens.weight", cfg.vocab_size)]}
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        attn = theirs + "self_attn."
        out[ours + "attn_norm.weight"] = [(theirs + "input_layernorm.weight", cfg.d_model)]
        out[ours + "attn.wqkv.weight"] = [(attn + "q_proj.weight", q_rows), (attn + "k_proj.weight", kv_rows),
                                          (attn + "v_proj.weight", kv_rows)]
        if cfg.qkv_bias:
            out[ours + "attn.wqkv.bias"] = [(attn + "q_proj.bias", q_rows), (attn + "k_proj.bias", kv_rows),
                                            (attn + "v_proj.bias", kv_rows)]
        out[ours + "attn.wo.weight"] = [(attn + "o_proj.weight", cfg.d_model)]
        out[ours + "ffn_norm.weight"] = [(theirs + "post_attention_layernorm.weight", cfg.d_model)]
        out[ours + "ffn.w_gate_up.weight"] = [(theirs + "mlp.gate_proj.weight", cfg.ffn_hidden),
                                              (theirs + "mlp.up_proj.weight", cfg.ffn_hidden)]
        out[ours + "ffn.w_down.weight"] = [(theirs + "mlp.down_proj.weight", cfg.d_model)]
    out["norm.weight"] = [("model.norm.weight", cfg.d_model)]
    if not cfg.tie_embeddings:
        out[TIED_HEAD] = [(TIED_HEAD, cfg.vocab_size)]
    return out


def hf_names(cfg: ModelConfig) -> list[str]:
    """Every Hugging Face tensor name a model of `cfg` has, in runyard's state-dict order."""
    return [name for parts in layout(cfg).values() for name, _ in parts]


def runyard_to_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A runyard state dict under Hugging Face names. Fused tensors are split into views (no copy);
    a tied head is left out. KeyError names a runyard tensor that is missing."""
    out = {}
    for ours, parts in layout(cfg).items():
        pieces = state[ours].split([rows for _, rows in parts], dim=0)
        out.update({name: piece for (name, _), piece in zip(parts, pieces, strict=True)})
    return out


def hf_to_runyard(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict under runyard's names (fused tensors concatenated). KeyError names a
    Hugging Face tensor that is missing; a tied head is left out, as runyard's exports store it."""
    return {ours: torch.cat([state[name] for name, _ in parts]) if len(parts) > 1 else state[parts[0][0]]
            for ours, parts in layout(cfg).items()}

"""A tiny but real export made in seconds, without a training run: a byte-level BPE tokenizer and a seeded
random decoder over the stdlib's json sources, with the drift reference of those sources (what a run's
export holds), so a test can serve it, start a lease job from it, and see drift when the traffic changes
kind. Small enough (about 130 KB) to travel uploaded with a demand."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from runyard.model.hf.export import export_model
from runyard.model.transformer import ModelConfig, Transformer
from runyard.serve.drift import DriftReference

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CONTEXT = 64  # a spec starting from this export sets model.context_length to at most this


def code_texts() -> list[str]:
    """The texts the export's tokenizer and drift reference come from: the stdlib's json sources."""
    return [p.read_text(encoding="utf-8") for p in sorted((STDLIB / "json").glob("*.py"))]


def make_tiny_export(out: Path, seed: int = 0) -> Path:
    """Write `out/export` (tokenizer, seeded weights, drift reference of the json sources); returns it."""
    texts = code_texts()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    cfg = ModelConfig(vocab_size=tokenizer.get_vocab_size(), d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_hidden=64, context_length=CONTEXT)
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    export = export_model(model, cfg, out / "tokenizer.json", out / "export", extra_config={"run_name": "tiny"})
    # The reference the served model's traffic is judged against: its training text, in documents of
    # a few hundred tokens as a run's token store holds them.
    ids = np.concatenate([np.asarray(tokenizer.encode(t).ids, dtype=np.int64) for t in texts])
    documents = [ids[i : i + 300] for i in range(0, len(ids) - 300, 300)]
    counts = np.bincount(ids, minlength=tokenizer.get_vocab_size())
    DriftReference.from_documents(counts, documents, seed=seed).save(export)
    return export

"""Writes that run out of space, run inside a small tmpfs by tests/system/test_diskspace.py (in its own mount
namespace, so the filesystem disappears with the process). Prints one JSON line: what was raised and
what was left behind."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from runyard.data.tokenizer import train_bpe
from runyard.errors import DiskFull
from runyard.model.config import ModelConfig
from runyard.model.hf.export import export_model
from runyard.model.transformer import Transformer
from runyard.system.files import atomic_write_bytes
from runyard.train.checkpoint import write_checkpoint


def _write(kind: str, full: Path, roomy: Path) -> None:
    if kind == "atomic":
        atomic_write_bytes(full / "data" / "big.bin", b"x" * (4 << 20))
    elif kind == "checkpoint":
        write_checkpoint(full / "ckpt", 7, {"model": {"w": torch.zeros(1 << 20)}}, {"note": "probe"})
    elif kind == "export":
        tok = train_bpe(["def f(x):\n    return x + 1\n"] * 50, 300, 1, 1 << 20)
        tok_path = roomy / "tokenizer.json"
        tok.save(str(tok_path))
        cfg = ModelConfig(vocab_size=tok.get_vocab_size(), d_model=256, n_layers=4, n_heads=4, n_kv_heads=4,
                          ffn_hidden=512, context_length=32)
        export_model(Transformer(cfg), cfg, tok_path, full / "export")
    else:
        raise SystemExit(f"unknown probe {kind}")


def main() -> None:
    kind, full, roomy = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    result = {"raised": None, "message": ""}
    try:
        _write(kind, full, roomy)
    except DiskFull as exc:
        result = {"raised": "DiskFull", "message": str(exc)}
    except Exception as exc:  # reported, so the test shows what came instead
        result = {"raised": type(exc).__name__, "message": str(exc)}
    result["left"] = sorted(str(p.relative_to(full)) for p in full.rglob("*") if p.is_file())
    print(json.dumps(result))


if __name__ == "__main__":
    main()

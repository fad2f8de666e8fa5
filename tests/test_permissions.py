"""Files and directories runyard writes take the umask's permissions, exports included (an export made
through tempfile.mkdtemp used to be 0700 while the rest of the run was 0755)."""

from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from pathlib import Path

import pytest

from runyard.data.tokenizer import train_bpe
from runyard.model.config import ModelConfig
from runyard.model.hf.export import export_model
from runyard.model.transformer import Transformer
from runyard.system.files import atomic_write_bytes, make_temp_dir


@contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask, dirs, files", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_export_directory_and_files_follow_the_umask(tmp_path, mask, dirs, files):
    tok = train_bpe(["def f(x):\n    return x + 1\n"] * 20, 300, 1, 1 << 20)
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), d_model=16, n_layers=1, n_heads=2, n_kv_heads=2,
                      ffn_hidden=32, context_length=8)
    with umask(mask):
        out = export_model(Transformer(cfg), cfg, tmp_path / "tokenizer.json", tmp_path / "run" / "export")
    assert mode(out) == dirs
    written = sorted(p.name for p in out.iterdir())
    assert written == ["config.json", "generation_config.json", "model.safetensors", "runyard.json", "tokenizer.json",
                       "tokenizer_config.json"]
    assert {p.name: mode(p) for p in out.iterdir()} == dict.fromkeys(written, files)


def test_atomic_writes_and_temp_dirs_follow_the_umask_unless_a_mode_is_asked(tmp_path):
    with umask(0o022):
        atomic_write_bytes(tmp_path / "a.json", b"{}")
        atomic_write_bytes(tmp_path / "secret", b"k", mode=0o600)
        made = make_temp_dir(tmp_path, ".export.tmp-")
    assert mode(tmp_path / "a.json") == 0o644 and mode(tmp_path / "secret") == 0o600
    assert mode(made) == 0o755 and made.name.startswith(".export.tmp-")
    assert make_temp_dir(tmp_path, ".export.tmp-") != made

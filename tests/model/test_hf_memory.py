"""Loading a Hugging Face directory never holds two full copies of the model: the peak resident memory
of a fresh process grows by about one model (plus one tensor), where reading the whole file and then
loading the state dict grows by two. Measured in a subprocess with the kernel's peak-RSS counter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from runyard.model import hf
from runyard.model.config import ModelConfig
from runyard.model.transformer import Transformer

pytestmark = pytest.mark.slow

MEASURE = r"""
import json, sys
import torch
from safetensors.torch import load_file
from runyard.model import hf
from runyard.model.transformer import Transformer

def peak_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak to the current resident size
before = peak_kib()
directory = sys.argv[2]
if sys.argv[1] == "streamed":
    model = hf.load_model(directory)
else:  # the naive way: the whole file in memory, then copied into the model
    cfg = hf.read_config(directory)
    model = Transformer(cfg)
    model.load_state_dict(hf.hf_to_runyard(load_file(directory + "/model.safetensors"), cfg), strict=False)
print(json.dumps({"growth_bytes": (peak_kib() - before) * 1024}))
"""


def peak_growth(mode: str, directory) -> int:
    proc = subprocess.run([sys.executable, "-c", MEASURE, mode, str(directory)], capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])["growth_bytes"]


def test_streamed_loading_peaks_at_one_model_not_two(tmp_path):
    cfg = ModelConfig(vocab_size=8000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_hidden=1536,
                      context_length=64, tie_embeddings=False)
    with torch.device("cpu"):
        model = Transformer(cfg)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    hf.write_model(model, cfg, tmp_path)
    del model
    streamed, naive = peak_growth("streamed", tmp_path), peak_growth("naive", tmp_path)
    print(f"model {model_bytes / 2**20:.0f} MiB: peak growth streamed {streamed / 2**20:.0f} MiB, "
          f"whole file then load_state_dict {naive / 2**20:.0f} MiB")
    assert naive > 1.8 * model_bytes  # the measurement sees a second copy when there is one
    assert streamed < 1.3 * model_bytes

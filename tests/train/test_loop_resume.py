"""A stage stopped mid-way and resumed in-process ends bitwise equal to one that never stopped, and its
held-out evaluations score the same fixed sample (drawn across the whole split) before and after."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from runyard.data.loader import eval_sample
from runyard.data.pipeline import PreparedData
from runyard.data.shards import ShardWriter, write_index
from runyard.errors import Preempted
from runyard.spec.job import parse_spec, resolved_stage
from runyard.spec.seeds import evaluation_seeds
from runyard.train import checkpoint, parallel
from runyard.train.loop import train_stage
from runyard.train.signals import StopRequest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train_loop_resume")]  # one dataset (module fixture)

VOCAB = 97
CTX = parallel.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
SPEC = parse_spec({
    "name": "resume", "seed": 5, "data": {"sources": [{"path": "unused"}]},
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "context_length": 16, "dropout": 0.1},
    "optim": {"lr": 0.01}, "schedule": {"warmup_steps": 2},
    "train": {"steps": 12, "batch_size": 4},
    "eval": {"interval": 3, "batches": 2},
    "checkpoint": {"interval": 4, "keep_last": 2},
    "resources": {"device": "cpu"},
})


def write_split(root: Path, name: str, docs: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(30, 300, size=docs)
    w = ShardWriter(root, name, 1024, np.dtype(np.uint16))
    w.add_tokens(rng.integers(1, VOCAB, size=int(lengths.sum())).astype(np.uint16), lengths)
    write_index(root / f"{name}.json", w.finish(), dtype=np.dtype(np.uint16), vocab_size=VOCAB, eos_id=0,
                shard_tokens=1024, num_documents=docs)
    return root / f"{name}.json"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> PreparedData:
    root = tmp_path_factory.mktemp("data")
    return PreparedData(tokenizer_path=root / "unused.json", vocab_size=VOCAB, eos_id=0,
                        train_index=write_split(root, "train", 60, 0), heldout_index=write_split(root, "heldout", 20, 1),
                        fingerprint="test", stats={}, input_fingerprints={})


class StopAtStep(StopRequest):
    """A SIGTERM that arrives once step `step` is logged."""

    def __init__(self, metrics: Path, step: int):
        super().__init__()
        self.metrics, self.step = metrics, step

    @property
    def requested(self) -> bool:
        if not self._event.is_set() and self.metrics.is_file() and \
                len(self.metrics.read_text().splitlines()) >= self.step:
            self.request("SIGTERM")
        return self._event.is_set()


def metric_rows(stage_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("time", "tokens_per_s", "mfu")} for r in rows]


def test_resumed_stage_is_bitwise_equal_and_scores_the_same_heldout_sample(prepared, tmp_path):
    torch.set_num_threads(1)
    stage = resolved_stage(SPEC, "main")
    reference = train_stage(SPEC, stage, prepared, tmp_path / "reference", CTX, show_progress=False)

    stopped = tmp_path / "stopped"
    with pytest.raises(Preempted, match="stopped by SIGTERM at step 6"):
        train_stage(SPEC, stage, prepared, stopped, CTX, stop=StopAtStep(stopped / "metrics.jsonl", 6), show_progress=False)
    assert [r.step for r in checkpoint.list_checkpoints(stopped / "checkpoints")] == [4, 6]
    resumed = train_stage(SPEC, stage, prepared, stopped, CTX, show_progress=False)
    assert resumed.resumed_from == 6

    rows, expected_rows = metric_rows(stopped), metric_rows(tmp_path / "reference")
    assert rows == expected_rows, "every step's loss and every held-out figure as in the uninterrupted run"
    held = [r for r in rows if "heldout_loss" in r]
    assert [r["step"] for r in held] == [3, 6, 9, 12]
    sample = eval_sample(prepared.heldout_index, 16, 4, 8, evaluation_seeds(SPEC.seed)["eval.heldout"])
    assert {(r["heldout_tokens"], r["heldout_documents"]) for r in held} == {(sample.tokens, sample.documents)}
    assert sample.documents > 4, "the sample reaches well beyond the split's first documents"

    final = checkpoint.read_model_weights(checkpoint.latest_good(stopped / "checkpoints").path)
    for name, tensor in reference.model.state_dict().items():
        assert torch.equal(final[name], tensor), name
    assert checkpoint.latest_good(stopped / "checkpoints").step == 12

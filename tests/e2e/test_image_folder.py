"""An image folder written as the docs write it (a folder with a subfolder of PNGs per class) is planned
and then run: the plan's images, shape and classes are the ones the run records in its manifest."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from runyard.cli import main
from runyard.run.execute import execute_run
from runyard.spec.job import load_spec

pytest.importorskip("onnx")


def test_an_image_folder_is_planned_and_run_with_the_same_facts(tmp_path, capsys):
    rng = np.random.default_rng(0)
    for c, level in (("dark", 40), ("light", 200)):
        (tmp_path / "glyphs" / c).mkdir(parents=True)
        for i in range(16):
            pixels = np.clip(rng.normal(level, 30, size=(12, 10)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels, mode="L").save(tmp_path / "glyphs" / c / f"{i}.png")
    spec = {"task": "image_classification", "name": "glyphs", "seed": 0,
            "data": {"sources": [{"path": str(tmp_path / "glyphs"), "format": "image_folder"}], "heldout_fraction": 0.25},
            "model": {"family": "cnn", "cnn": {"channels": [4], "hidden": 8}},
            "optim": {"lr": 0.01}, "schedule": {"warmup_steps": 2},
            "train": {"steps": 24, "batch_size": 8}, "stages": [{"name": "main", "gates": {"min_loss_drop": 0.0}}],
            "eval": {"interval": 12, "batches": 1}, "checkpoint": {"interval": 24},
            "resources": {"device": "cpu", "threads": 1}}
    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps(spec))
    assert main(["plan", str(path), "--no-calibrate", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    facts = planned["data"]["facts"]
    assert (facts["rows"], facts["image_shape"], facts["classes"]) == (32, [1, 12, 10], 2)
    assert planned["stages"][0]["family"] == "cnn" and planned["stages"][0]["parameters"] > 0

    summary = execute_run(load_spec(path), tmp_path / "run", show_progress=False)
    assert summary.evaluated
    ran = json.loads((tmp_path / "run" / "manifest.json").read_text())["task"]["data"]
    assert (ran["rows"], list(ran["image_shape"]), ran["classes"]) == (facts["rows"], facts["image_shape"], facts["classes"])
    assert (tmp_path / "run" / "export" / "runyard.json").is_file()

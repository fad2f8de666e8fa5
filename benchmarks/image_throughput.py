"""Image training throughput: runyard's loop training the CNN family against a plain torch loop over the
same network and the same batches.

runyard's side is `runyard.train.loop.train_stage` as a run calls it: the family builds the CNN, the
loader draws the batches, and every step sets the learning rate, runs forward/backward, clips, steps
AdamW, logs a metrics row; a checkpoint is written at the last step and the held-out sample scored then.
The peer is the loop a person writes by hand: the same SmallCNN (same config and initial weights), the
same AdamW groups and learning-rate schedule, the same clipping, fed the very batches runyard's loader
yields (their image ids drawn before timing, each batch gathered from the training split in memory),
and at the end the same held-out batches scored and a checkpoint saved (`torch.save` of the model and
optimizer state). Target: runyard's images/s at least 0.95x the peer's.

Data: the example's 8x8 digits (scikit-learn's, bundled) and generated 32x32 RGB images (CIFAR-sized,
no download), so both a per-step-overhead-bound and a compute-bound case are measured.

Run: python benchmarks/image_throughput.py [--steps N] [--rgb-steps N] [--threads N] [--repeats N] [--record]   (needs runyard[predict])
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, add_common_args, interleaved, paired_ratio  # noqa: E402

from runyard.data.image_loader import ImageLoader, image_eval_sample  # noqa: E402
from runyard.data.image_prep import prepare_images  # noqa: E402
from runyard.model import get_family  # noqa: E402
from runyard.spec.job import parse_spec, resolved_stage  # noqa: E402
from runyard.spec.seeds import derive_seed, evaluation_seeds  # noqa: E402
from runyard.train import batches, parallel  # noqa: E402
from runyard.train.loop import train_stage  # noqa: E402
from runyard.train.rng import seed_everything  # noqa: E402
from runyard.train.schedule import lr_at  # noqa: E402

CTX = parallel.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per timed repeat on the digits")
    p.add_argument("--rgb-steps", type=int, default=20, help="optimizer steps per timed repeat on the 32x32 images")
    p.add_argument("--batch", type=int, default=64, help="images per step")
    # One thread by default: this machine's two cores are shared, and spin-waiting intra-op threads
    # make both sides' timings swing with other processes' load rather than with the work measured.
    p.add_argument("--threads", type=int, default=1, help="torch threads, the same on both sides (default 1)")
    add_common_args(p, repeats=5)
    return p.parse_args(argv)


def spec_for(source: dict, channels: list[int], steps: int, batch: int):
    return parse_spec({
        "task": "image_classification", "name": "bench", "seed": 3,
        "data": {"sources": [source], "heldout_fraction": 0.2},
        "model": {"family": "cnn", "cnn": {"channels": channels, "hidden": 64}},
        "optim": {"lr": 0.003}, "schedule": {"warmup_steps": 5},
        "train": {"steps": steps, "batch_size": batch},
        "eval": {"interval": 10 * steps, "batches": 2},
        "checkpoint": {"interval": 10 * steps, "keep_last": 1},
        "resources": {"device": "cpu"},
    })


def generated_npz(directory: Path, n: int = 4000) -> Path:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, size=n)
    x = rng.integers(0, 200, size=(n, 32, 32, 3), dtype=np.uint8) + (labels[:, None, None, None] * 5).astype(np.uint8)
    np.savez(directory / "generated.npz", x=x, y=labels)
    return directory / "generated.npz"


def compare(report: Report, name: str, spec, workdir: Path, repeats: int) -> None:
    prepared = prepare_images(spec.data, seed=1, cache_root=workdir / "cache")
    stage = resolved_stage(spec, "main")
    family = get_family("cnn")
    config = family.config_from_spec(stage.model, **batches.data_facts(prepared))
    steps, batch = stage.train.steps, stage.train.batch_size
    loader = ImageLoader(prepared, "train", batch, derive_seed(spec.seed, "data", stage.name))
    # The same batches runyard's loader yields: their image ids are drawn before timing, and the peer
    # gathers each batch from the training split held in memory inside its timed loop, as a plain loop does.
    step_ids = []
    for _ in range(steps):
        step_ids.append(loader.image_ids(loader.position))
        loader.position += loader.global_batch
    train_x, train_y = (torch.from_numpy(np.array(a)) for a in prepared.arrays("train"))  # read into memory
    train_x, train_y = train_x.float(), train_y.long()
    heldout = image_eval_sample(prepared, "validation", batch, spec.eval.batches * batch,
                                evaluation_seeds(spec.seed)["eval.heldout"])
    stage_dir = workdir / f"{name}-stage"

    def runyard_loop() -> None:
        shutil.rmtree(stage_dir, ignore_errors=True)
        train_stage(spec, stage, prepared, stage_dir, CTX, show_progress=False)

    def plain_loop() -> None:
        seed_everything(derive_seed(spec.seed, "init", stage.name))
        model = family.build(config)
        o = stage.optim
        optimizer = torch.optim.AdamW(family.optimizer_groups(model, o), lr=o.lr, betas=o.betas, eps=o.eps)
        model.train()
        for step, ids in enumerate(step_ids):
            index = torch.from_numpy(ids)
            x, y = train_x[index], train_y[index]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, o.lr, stage.schedule, steps)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip or math.inf)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()  # the loss a loop prints
        model.eval()
        with torch.no_grad():
            sum(F.cross_entropy(model(x), y, reduction="sum").item() for x, y in heldout.batches)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, workdir / f"{name}-plain.pt")

    times = interleaved({"runyard": runyard_loop, "torch": plain_loop}, repeats)
    images = steps * batch
    print(f"{name}: {config.in_channels}x{config.height}x{config.width}, channels {list(config.channels)}; "
          f"runyard {times['runyard'].rate(images).spread()} images/s, torch {times['torch'].rate(images).spread()} images/s")
    # images/s ratio = peer time / runyard time, per round
    report.ratio(f"{name}_images_per_s_vs_torch_loop", paired_ratio(times["torch"], times["runyard"]),
                 "a plain torch loop, same network, batches, schedule, clipping, final eval and checkpoint", ">=", 0.95,
                 {"runyard_s": times["runyard"].values, "torch_s": times["torch"].values, "images": images})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    report = Report("image_throughput", args)
    with tempfile.TemporaryDirectory(prefix="runyard-image-bench-") as tmp:
        work = Path(tmp)
        compare(report, "digits_8x8", spec_for({"path": "digits", "format": "sklearn"}, [16, 32], args.steps, args.batch),
                work, args.repeats)
        npz = generated_npz(work)
        compare(report, "generated_32x32_rgb", spec_for({"path": str(npz), "format": "npz"}, [32, 64], args.rgb_steps,
                                                        args.batch), work, args.repeats)
    report.note(f"CPU, {args.threads} torch threads, fp32; the machine is shared (see the load average)")
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())

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

Accuracy at equal time (the CNN's recipe): glyphs rendered from this machine's fonts (digits and
letters, 24x24 grey, several sizes, offsets and slants per font; the DejaVu fonts of /usr/share/fonts
to train on, matplotlib's STIX and Computer Modern fonts, families never seen in training, held out).
runyard trains `runyard spec init --task image_classification`'s template as written (its model, optim,
schedule and batch; --glyph-recipe augmented adds augmentation and label smoothing) for --glyph-steps steps
through train_stage; the peer is a plain torch loop over the same network (same SmallCNN config: the
same size), the same training split, cross-entropy, Adam at 1e-3 and shuffled batches, stopped when it has
used the same wall time as runyard's stage. Both are scored on the held-out fonts; each round uses its
own seed on both sides. Target: runyard's accuracy at least 1.0x the peer's.

Run: python benchmarks/image_throughput.py [--steps N] [--rgb-steps N] [--glyph-steps N] [--threads N] [--repeats N] [--record]   (needs runyard[predict])
"""

from __future__ import annotations

import argparse
import glob
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, Samples, add_common_args, interleaved, paired_ratio  # noqa: E402

from runyard.data.image_loader import ImageLoader, image_eval_sample  # noqa: E402
from runyard.data.image_prep import prepare_images  # noqa: E402
from runyard.model import get_family  # noqa: E402
from runyard.spec.job import parse_spec, resolved_stage  # noqa: E402
from runyard.spec.seeds import derive_seed, evaluation_seeds  # noqa: E402
from runyard.spec.templates import TEMPLATES  # noqa: E402
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
    p.add_argument("--glyph-steps", type=int, default=300, help="runyard's optimizer steps on the glyphs (0 skips them)")
    p.add_argument("--glyph-variants", type=int, default=8, help="renderings of each glyph per font")
    p.add_argument("--glyph-recipe", choices=["template", "augmented"], default="template",
                   help="augmented: the template with shift 0.1, rotate 10, scale 0.1 and label smoothing 0.1")
    p.add_argument("--only-glyphs", action="store_true", help="skip the throughput comparisons")
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


GLYPHS = "0123456789ABCDEFGHKMNPRTWXY"
GLYPH_SIZE = 24
SYSTEM_FONTS = "/usr/share/fonts/truetype/dejavu/DejaVu*.ttf"
MPL_FONTS = ("STIXGeneral.ttf", "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf", "STIXGeneralBolIta.ttf",
             "cmr10.ttf", "cmb10.ttf", "cmti10.ttf", "cmss10.ttf", "cmtt10.ttf")


def glyph_fonts() -> tuple[list[str], list[str]]:
    """(training fonts, held-out fonts): DejaVu (not its math font) vs STIX and Computer Modern."""
    train = sorted(f for f in glob.glob(SYSTEM_FONTS) if "Math" not in f)
    try:
        import matplotlib  # noqa: PLC0415 (only the benchmark needs its fonts)
        ttf = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
        heldout = [str(ttf / name) for name in MPL_FONTS if (ttf / name).is_file()]
    except ImportError:
        heldout = []
    return train, heldout


def render_glyphs(fonts: list[str], variants: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """[N, H, W] uint8 (black glyph on white) and labels: every glyph of every font, `variants` times at
    a random size (13-19 px), offset (±2 px) and slant (±6 degrees)."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for path in fonts:
        for _ in range(variants):
            font = ImageFont.truetype(path, int(rng.integers(13, 20)))
            dx, dy, angle = rng.uniform(-2, 2), rng.uniform(-2, 2), rng.uniform(-6, 6)
            for label, ch in enumerate(GLYPHS):
                img = Image.new("L", (GLYPH_SIZE, GLYPH_SIZE), 255)
                ImageDraw.Draw(img).text((GLYPH_SIZE / 2 + dx, GLYPH_SIZE / 2 + dy), ch, font=font, fill=0, anchor="mm")
                images.append(np.asarray(img.rotate(angle, resample=Image.Resampling.BILINEAR, fillcolor=255)))
                labels.append(label)
    return np.stack(images), np.asarray(labels)


def glyph_folder(directory: Path, x: np.ndarray, y: np.ndarray) -> Path:
    """The training fonts' glyphs as an image folder (a subfolder of PNGs per class), as a user brings them."""
    for i, (img, label) in enumerate(zip(x, y, strict=True)):
        folder = directory / f"glyph_{GLYPHS[label]}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(folder / f"{i:05d}.png")
    return directory


def glyph_spec(folder: Path, steps: int, seed: int, recipe: str):
    values = TEMPLATES["image_classification"]("glyphs")
    values["seed"] = seed
    values["data"]["sources"] = [{"path": str(folder), "format": "image_folder"}]
    values["train"]["steps"] = steps
    values["stages"] = [{"name": "main"}]
    values["eval"] = {"interval": 10 * steps, "batches": 2}
    values["checkpoint"] = {"interval": 10 * steps, "keep_last": 1}
    values["resources"] = {"device": "cpu"}
    if recipe == "augmented":
        values["model"]["cnn"]["label_smoothing"] = 0.1
        values["model"]["cnn"]["augment"] = {"shift": 0.1, "rotate": 10.0, "scale": 0.1, "horizontal_flip": False}
    return parse_spec(values)


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return float((model(x).argmax(dim=1) == y).float().mean())


def glyph_accuracy(report: Report, workdir: Path, args: argparse.Namespace) -> None:
    train_fonts, heldout_fonts = glyph_fonts()
    if len(train_fonts) < 4 or len(heldout_fonts) < 2:
        report.note(f"glyph accuracy skipped: {len(train_fonts)} training and {len(heldout_fonts)} held-out fonts found "
                    f"({SYSTEM_FONTS}, matplotlib's fonts)")
        return
    x, y = render_glyphs(train_fonts, args.glyph_variants, seed=0)
    hx, hy = render_glyphs(heldout_fonts, args.glyph_variants, seed=1)
    folder = glyph_folder(workdir / "glyphs", x, y)
    test_x = torch.from_numpy(hx[:, None].astype(np.float32) / 255.0)
    test_y = torch.from_numpy(hy.astype(np.int64))
    base = glyph_spec(folder, args.glyph_steps, 0, args.glyph_recipe)
    prepared = prepare_images(base.data, seed=1, cache_root=workdir / "cache")
    family = get_family("cnn")
    config = family.config_from_spec(resolved_stage(base, "main").model, **batches.data_facts(prepared))
    # Same class order on both sides: the folder names sort as GLYPHS' order does not, so map them.
    names = [n.removeprefix("glyph_") for n in prepared.class_names]
    test_y = torch.tensor([names.index(GLYPHS[int(i)]) for i in test_y])
    train_x, train_y = (torch.from_numpy(np.array(a)) for a in prepared.arrays("train"))
    train_x, train_y = train_x.float(), train_y.long()
    ours, peers, seconds, peer_steps = Samples(), Samples(), [], []

    def runyard_round(seed: int) -> float:
        spec = glyph_spec(folder, args.glyph_steps, seed, args.glyph_recipe)
        stage_dir = workdir / "glyph-stage"
        shutil.rmtree(stage_dir, ignore_errors=True)
        t0 = time.perf_counter()
        result = train_stage(spec, resolved_stage(spec, "main"), prepared, stage_dir, CTX, show_progress=False)
        seconds.append(time.perf_counter() - t0)
        ours.values.append(accuracy(result.model, test_x, test_y))
        return seconds[-1]

    def plain_round(seed: int, budget: float) -> None:
        torch.manual_seed(seed)
        model = family.build(config)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        order, at, steps = torch.randperm(len(train_y)), 0, 0
        t0 = time.perf_counter()
        model.train()
        while time.perf_counter() - t0 < budget:
            if at + args.batch > len(order):
                order, at = torch.randperm(len(train_y)), 0
            index = order[at:at + args.batch]
            at += args.batch
            loss = F.cross_entropy(model(train_x[index]), train_y[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
        peer_steps.append(steps)
        peers.values.append(accuracy(model, test_x, test_y))

    for r in range(args.repeats):
        plain_round(r, runyard_round(r))  # the peer gets the wall time runyard's stage took in this round
        print(f"  glyph round {r + 1}/{args.repeats}: runyard {ours.values[-1]:.3f} in {seconds[-1]:.1f}s, "
              f"torch {peers.values[-1]:.3f} in {peer_steps[-1]} steps", file=sys.stderr, flush=True)
    print(f"glyphs: {len(train_fonts)} training fonts ({len(y)} images, {len(train_y)} in the training split), "
          f"{len(heldout_fonts)} held-out fonts ({len(hy)} images), {len(GLYPHS)} classes, {GLYPH_SIZE}x{GLYPH_SIZE}; "
          f"runyard ({args.glyph_recipe} recipe, {args.glyph_steps} steps) {ours.spread()}, "
          f"plain torch {peers.spread()} (steps {peer_steps})")
    report.ratio("glyphs_heldout_font_accuracy_vs_torch_equal_time", paired_ratio(ours, peers),
                 "a plain torch loop, same network and training split, Adam 1e-3, cross-entropy, same wall time",
                 ">=", 1.0, {"runyard_accuracy": ours.values, "torch_accuracy": peers.values, "runyard_s": seconds,
                             "torch_steps": peer_steps, "recipe": args.glyph_recipe})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    report = Report("image_throughput", args)
    with tempfile.TemporaryDirectory(prefix="runyard-image-bench-") as tmp:
        work = Path(tmp)
        if args.glyph_steps > 0:
            glyph_accuracy(report, work, args)
        if args.only_glyphs:
            return report.finish()
        compare(report, "digits_8x8", spec_for({"path": "digits", "format": "sklearn"}, [16, 32], args.steps, args.batch),
                work, args.repeats)
        npz = generated_npz(work)
        compare(report, "generated_32x32_rgb", spec_for({"path": str(npz), "format": "npz"}, [32, 64], args.rgb_steps,
                                                        args.batch), work, args.repeats)
    report.note(f"CPU, {args.threads} torch threads, fp32; the machine is shared (see the load average)")
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())

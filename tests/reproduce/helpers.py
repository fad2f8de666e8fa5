"""Real files for reproduction tests: a wheel made by hand (installed with pip itself), and run
directories with the files `compare` reads."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(directory: Path, name: str = "ry_demo", version: str = "1.0", body: str = "VALUE = 1\n",
               tags: str = "py3-none-any") -> Path:
    """A valid wheel (PEP 427) holding one module; `body` is the module's text."""
    directory.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": body.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: {tags}\n".encode(),
    }
    record = "".join(f"{p},{_record_hash(d)},{len(d)}\n" for p, d in files.items()) + f"{info}/RECORD,,\n"
    path = directory / f"{name}-{version}-{tags}.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, d in files.items():
            z.writestr(p, d)
        z.writestr(f"{info}/RECORD", record)
    return path


def pip_install_target(wheel: Path, target: Path) -> None:
    """Install `wheel` into the folder `target` with pip (a real installer's RECORD, INSTALLER, ...)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--quiet", "--no-deps",
                    "--no-index", "--target", str(target), str(wheel)], check=True, capture_output=True)


def write_run(run_dir: Path, losses: list[float], heldout: dict[int, float] | None = None, seed: int = 7,
              stage: str = "main", weights: bytes = b"weights", metrics: dict | None = None,
              manifest: dict | None = None, lock: dict | None = None) -> Path:
    """A run directory as `runyard run` leaves it, reduced to what `compare` reads."""
    rows = []
    for i, loss in enumerate(losses, start=1):
        row = {"step": i, "loss": loss, "grad_norm": 1.0}
        if heldout and i in heldout:
            row["heldout_loss"] = heldout[i]
        rows.append(row)
    sdir = run_dir / "stages" / stage
    sdir.mkdir(parents=True)
    (sdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "eval").mkdir()
    final = metrics or {"heldout_loss": losses[-1] + 0.1, "train_loss": losses[-1]}
    (run_dir / "eval" / "report.json").write_text(json.dumps({"metrics": final}))
    (run_dir / "export").mkdir()
    (run_dir / "export" / "model.safetensors").write_bytes(weights)
    base = {"spec_sha256": "a" * 64, "seeds": {"spec": seed}, "hardware": {"cpu": "cpu-model", "cores": 2, "gpus": []}}
    (run_dir / "manifest.json").write_text(json.dumps({**base, **(manifest or {})}))
    if lock is not None:
        (run_dir / "env").mkdir()
        (run_dir / "env" / "environment.json").write_text(json.dumps(lock))
    return run_dir

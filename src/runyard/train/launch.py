"""Launching several worker processes under torchrun (torch.distributed.run).

`runyard run SPEC --nproc N` re-runs the same command line in N workers through torchrun; each
worker finds RANK/WORLD_SIZE in its environment and joins the process group (train/parallel.py).
Multi-node is the same command with --nnodes, --node-rank and a rendezvous endpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys

UNDER_LAUNCHER = "RUNYARD_UNDER_TORCHRUN"


def under_launcher() -> bool:
    return os.environ.get(UNDER_LAUNCHER) == "1" or "TORCHELASTIC_RUN_ID" in os.environ


def torchrun_command(
    worker_argv: list[str],
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}"]
    if nnodes > 1:
        if not rdzv_endpoint:
            raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT")
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    else:
        cmd += ["--standalone"]
    return cmd + ["-m", "runyard", *worker_argv]


def launch(worker_argv: list[str], nproc: int, **kwargs) -> int:
    """Run the workers and return torchrun's exit status (the first failing worker's)."""
    env = dict(os.environ, **{UNDER_LAUNCHER: "1"})
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(torchrun_command(worker_argv, nproc, **kwargs), env=env)

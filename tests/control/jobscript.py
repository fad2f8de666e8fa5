"""A small real job for control-plane tests (standard library only, starts fast).

It counts `--steps` steps of a deterministic computation, checkpointing its state to the run
directory every step, and behaves like the spine where the control plane cares:
SIGTERM -> write a checkpoint, exit 4; started again -> resume from the checkpoint.
Every start is appended to EVENTS (env RUNYARD_TEST_EVENTS) so tests can check order and counts.

    python jobscript.py [--steps N] [--step-s S] [--exit CODE] [--fail-first K --fail-code C|--fail-kill]
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def log_event(kind: str, **extra) -> None:
    path = os.environ.get("RUNYARD_TEST_EVENTS")
    if not path:
        return
    record = {"kind": kind, "job": os.environ.get("RUNYARD_JOB_ID"), "t": time.time(),
              "restart": int(os.environ.get("RUNYARD_RESTART_COUNT", "0")),
              "devices": os.environ.get("RUNYARD_DEVICES", ""), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
              "pid": os.getpid(), **extra}
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def save(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--step-s", type=float, default=0.0)
    p.add_argument("--exit", type=int, default=0)
    p.add_argument("--fail-first", type=int, default=0, help="fail on the first K attempts")
    p.add_argument("--fail-code", type=int, default=1)
    p.add_argument("--fail-kill", action="store_true", help="fail by SIGKILL (an infra failure)")
    args = p.parse_args()
    run_dir = Path(os.environ.get("RUNYARD_RUN_DIR", "."))
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = run_dir / "checkpoint.json"
    state = json.loads(ckpt.read_text()) if ckpt.exists() else {"step": 0, "x": 7}
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    log_event("start", step=state["step"])
    restart = int(os.environ.get("RUNYARD_RESTART_COUNT", "0"))
    if restart < args.fail_first:
        log_event("fail")
        if args.fail_kill:
            os.kill(os.getpid(), signal.SIGKILL)
        return args.fail_code
    while state["step"] < args.steps:
        if stop["now"]:
            save(ckpt, state)
            log_event("preempted", step=state["step"])
            return 4
        time.sleep(args.step_s)
        state["x"] = (state["x"] * 31 + state["step"]) % 1_000_003
        state["step"] += 1
        save(ckpt, state)
        print(f"step {state['step']} x {state['x']}", flush=True)
    (run_dir / "result.json").write_text(json.dumps(state))
    log_event("done", x=state["x"])
    return args.exit


if __name__ == "__main__":
    sys.exit(main())

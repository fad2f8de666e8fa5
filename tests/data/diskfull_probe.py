"""Run by test_diskfull.py inside a small tmpfs (its own mount namespace): prepare a corpus into a
cache on that tmpfs until the disk fills, report what was raised and what was left, then give the
tmpfs room and prepare again. Prints one JSON line.

The up-front space check is switched off here (it would refuse the preparation before any write; it
has its own test): this probe is about a disk that fills mid-way."""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from pathlib import Path

import runyard.data.pipeline as pipeline
from runyard.errors import DiskFull
from tests.data.data_fixtures import spec_for


def listing(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())


def main() -> None:
    corpus, mount = Path(sys.argv[1]), Path(sys.argv[2])
    cache = mount / "cache"
    spec = spec_for(str(corpus / "*.txt"))
    pipeline.check_cache_space = lambda *a, **k: None
    result: dict = {"raised": None}
    try:
        pipeline.prepare_data(spec, seed=0, report_dir=None, cache_dir=cache, progress=False)
    except DiskFull as exc:
        result.update(raised="DiskFull", message=str(exc))
    except Exception as exc:  # reported, so the test shows what came instead
        result.update(raised=type(exc).__name__, message=str(exc), where=traceback.format_exc()[-1500:])
    result["left"] = listing(cache)
    subprocess.run(["mount", "-o", "remount,size=256m", str(mount)], check=True)
    again = pipeline.prepare_data(spec, seed=0, report_dir=None, cache_dir=cache, progress=False)
    result["fingerprint"] = again.fingerprint
    print(json.dumps(result))


if __name__ == "__main__":
    main()

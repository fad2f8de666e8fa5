"""The one way every benchmark here measures, reports and records a figure.

- `interleaved(contenders, repeats)` times every contender once per round, the order alternating
  round by round (forward, then reversed), so load from other processes and warm caches fall on
  runyard and its peer alike. Each contender gets the same number of timed repeats.
- `Samples` keeps every timing; a figure is its median with its spread (min..max over the repeats).
- A ratio between two contenders measured in the same rounds is the median of the per-round ratios
  (each round's pair saw the same machine state), with their min..max as its spread.
- `Report.ratio(...)` prints the one machine-readable line per figure,

      RATIO <name> <value> (<peer>, target <op> <value>) spread <lo>..<hi> n=<repeats>

  and `Report.finish()` writes benchmarks/results/<benchmark>.json when `--record` was given
  (machine, versions, commit, date, figures), then regenerates the table in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import json
import operator
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "benchmarks" / "README.md"
sys.path.insert(0, str(REPO / "src"))  # the worktree's code even without an install

from runyard.system.files import atomic_write_json, atomic_write_text  # noqa: E402

OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt,
}
RATIO_LINE = re.compile(
    r"^RATIO (?P<name>\S+) (?P<value>\S+) \((?P<peer>.+), target (?P<op>[<>]=?) (?P<target>\S+)\)"
)


@dataclass
class Samples:
    """Every timing (or any per-repeat figure) of one contender."""

    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    def spread(self) -> str:
        """Median with min..max, for a human line."""
        return f"{self.median:.4g} [{self.low:.4g}..{self.high:.4g}, n={len(self.values)}]"

    def rate(self, amount: float) -> Samples:
        """amount / each timing: e.g. MB per second from seconds."""
        return Samples([amount / v for v in self.values])


def interleaved(
    contenders: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    progress: bool = True,
    before: Callable[[str], object] | None = None,
) -> dict[str, Samples]:
    """Time each contender `repeats` times, one call each per round, the order reversed every other
    round. `warmup` untimed rounds come first (caches, lazy imports, thread pools). `before(name)`, if
    given, runs untimed before every call (e.g. to remove the previous call's output)."""
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            if before:
                before(name)
            contenders[name]()
    out = {name: Samples() for name in names}
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            if before:
                before(name)
            t0 = time.perf_counter()
            contenders[name]()
            out[name].values.append(time.perf_counter() - t0)
        if progress:
            done = ", ".join(f"{n} {out[n].values[-1]:.3g}s" for n in names)
            print(f"  round {r + 1}/{repeats}: {done}", file=sys.stderr, flush=True)
    return out


def paired_ratio(numerator: Samples, denominator: Samples) -> Samples:
    """Per-round ratios of two contenders timed in the same rounds."""
    if len(numerator.values) != len(denominator.values):
        raise ValueError("paired_ratio needs the same number of repeats on both sides")
    return Samples([a / b for a, b in zip(numerator.values, denominator.values, strict=True)])


def add_common_args(parser: argparse.ArgumentParser, repeats: int) -> None:
    parser.add_argument("--repeats", type=int, default=repeats,
                        help=f"timed repeats per contender, interleaved (default {repeats})")
    parser.add_argument("--record", action="store_true",
                        help="write benchmarks/results/<name>.json and refresh benchmarks/README.md's table")


class Report:
    """Collects one benchmark's figures, prints RATIO lines, records them on request."""

    def __init__(self, benchmark: str, args: argparse.Namespace, packages: Sequence[str] = ()):
        self.benchmark, self.args = benchmark, args
        self.packages = ["runyard", "torch", "numpy", *packages]
        self.figures: list[dict] = []
        self.notes: list[str] = []
        self.load_before = os.getloadavg()
        self.started = dt.datetime.now(dt.UTC)

    def ratio(self, name: str, ratio: Samples, peer: str, op: str, target: float,
              detail: dict | None = None) -> bool:
        """Print and keep one figure: a ratio (runyard over peer, higher means runyard is better
        unless the target says <=) against its target. Returns whether the target is met."""
        if op not in OPS:
            raise ValueError(f"unknown target operator {op!r}; use one of {list(OPS)}")
        value = ratio.median
        met = OPS[op](value, target)
        print(f"RATIO {name} {value:.3g} ({peer}, target {op} {target:g}) "
              f"spread {ratio.low:.3g}..{ratio.high:.3g} n={len(ratio.values)}", flush=True)
        self.figures.append({
            "name": name, "value": value, "low": ratio.low, "high": ratio.high, "n": len(ratio.values),
            "peer": peer, "op": op, "target": target, "met": met, "detail": detail or {},
        })
        return met

    def note(self, text: str) -> None:
        """A caveat that belongs with the figures (printed now, kept in the record)."""
        print(f"note: {text}", flush=True)
        self.notes.append(text)

    def finish(self) -> int:
        if getattr(self.args, "record", False):
            path = RESULTS / f"{self.benchmark}.json"
            atomic_write_json(path, self.record())
            write_readme_table()
            print(f"recorded {path.relative_to(REPO)}; benchmarks/README.md table refreshed")
        return 0

    def record(self) -> dict:
        return {
            "benchmark": self.benchmark,
            "date": self.started.isoformat(timespec="seconds"),
            "seconds": round((dt.datetime.now(dt.UTC) - self.started).total_seconds(), 1),
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
            "commit": git_commit(),
            "machine": machine(self.load_before),
            "versions": versions(self.packages),
            "figures": self.figures,
            "notes": self.notes,
        }


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        # The results and the table they generate do not make the measured code dirty.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":!benchmarks/results", ":!benchmarks/README.md"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine(load_before: tuple[float, float, float]) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    with contextlib.suppress(ValueError, OSError):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "system": f"{platform.system()} {platform.release()}",
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": memory,
        "python": platform.python_version(),
        # Other work on the machine shapes every figure: the 1-minute load before and after the run.
        "load_1min_before": round(load_before[0], 2),
        "load_1min_after": round(os.getloadavg()[0], 2),
    }


def versions(packages: Sequence[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


TABLE_START = "<!-- results table: generated by benchmarks/harness.py from benchmarks/results/*.json -->"
TABLE_END = "<!-- end of results table -->"


def results_table(results_dir: Path = RESULTS) -> str:
    """A Markdown table of the latest recorded figures, one row per RATIO."""
    rows = ["| benchmark | figure | value | spread (n) | peer | target | met | date | commit |",
            "|---|---|---|---|---|---|---|---|---|"]
    for path in sorted(results_dir.glob("*.json")):
        rec = json.loads(path.read_text())
        for f in rec["figures"]:
            rows.append(
                f"| {rec['benchmark']} | `{f['name']}` | {f['value']:.3g} | {f['low']:.3g}..{f['high']:.3g} "
                f"({f['n']}) | {f['peer']} | {f['op']} {f['target']:g} | {'yes' if f['met'] else '**no**'} "
                f"| {rec['date'][:10]} | {rec['commit'][:10]} |"
            )
    return "\n".join(rows)


def write_readme_table(readme: Path = README, results_dir: Path = RESULTS) -> None:
    """Replace the text between the table markers in benchmarks/README.md."""
    text = readme.read_text()
    start, end = text.find(TABLE_START), text.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"{readme} has no results-table markers ({TABLE_START!r} ... {TABLE_END!r})")
    table = results_table(results_dir)
    atomic_write_text(readme, text[: start + len(TABLE_START)] + "\n" + table + "\n" + text[end:])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Regenerate benchmarks/README.md's table from results/*.json")
    parser.parse_args()
    write_readme_table()
    print(results_table())

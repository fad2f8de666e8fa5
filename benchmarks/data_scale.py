"""The data stage at corpus scale: throughput and peak memory of `runyard prepare` on 100 MB, 1 GB and 4 GB
corpora, worker scaling, and the Slurm executor against the local one on the same machine.

Corpus: real text from this machine, no network: the interpreter's standard library and the packages
installed beside it (.py, .rst, .txt, .md, .c, .h, .html), and /usr/share/doc (gzipped files
decompressed). The first copy of every document is as found; later copies are edited, document by
document and seeded: 20% left identical (exact duplicates), 50% with 1-3% of their words replaced
(near-duplicates, Jaccard of word 5-grams ~0.85-0.95), 30% with 25-40% replaced (new documents). The
corpus is written as JSONL files of ~8 MB, as large corpora are kept.

Figures (each prepare is `runyard prepare` in its own process, a fresh cache, the process tree's
resident memory sampled every 50 ms, children included):
- per size: MB/s of input, peak RSS (the sum over the tree: forked workers' shared pages count in
  each, so it errs high) and peak PSS (shared pages split between their sharers: the memory used);
- `data_scale_peak_rss_flatness`: largest peak RSS over smallest, across the sizes (target <= 1.2);
- `data_scale_peak_rss_vs_limit`: the largest peak RSS over data.memory_limit (target <= 1);
- `data_scale_two_workers_vs_one`: throughput with data.workers 2 over 1, same corpus (target >= 1.7);
- `data_scale_slurm_vs_local`: throughput with `--executor slurm` over local, 2 workers each, same
  corpus, on this machine's single-node Slurm (target >= 0.9).
- where the time goes, load-insensitive: each run's CPU seconds per step (prepared.json's
  stats.cpu_seconds: the main process's own steps, and the tasks' summed), and from the one-worker runs
  the most two workers could gain (Amdahl: the main process's steps run alone, the tasks share 2 CPUs).
  On a shared machine the wall-clock ratios measure the neighbours as much as runyard; print the load.

Run: python benchmarks/data_scale.py [--sizes 100M,1G,4G] [--ratio-size 100M] [--repeats 2] [--record]
Disk: the corpora and caches go under --work (default /tmp/runyard-data-scale), removed at the end;
the 4 GB case needs about 15 GB free there.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, Samples, add_common_args, interleaved, paired_ratio  # noqa: E402

from runyard.system.diskspace import free_bytes, human_bytes  # noqa: E402

SUFFIXES = {".py", ".rst", ".txt", ".md", ".c", ".h", ".html", ".pyi", ".cfg", ".toml"}
SHARD_BYTES = 8 << 20
MEMORY_LIMIT = 2 << 30
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _size(text: str) -> int:
    units = {"K": 1e3, "M": 1e6, "G": 1e9}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def real_documents(limit_bytes: int) -> list[str]:
    """Distinct text documents found on this machine, up to `limit_bytes` of them."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"]), Path("/usr/share/doc")]
    docs, total, seen = [], 0, set()
    for root in roots:
        for path in sorted(root.rglob("*")):
            if "__pycache__" in path.parts or not path.is_file() or path.is_symlink():
                continue
            suffixes = path.suffixes
            gz = suffixes[-1:] == [".gz"]
            if (suffixes[-2] if gz and len(suffixes) > 1 else path.suffix) not in SUFFIXES and not (
                gz and root.name == "doc"
            ):
                continue
            try:
                raw = path.read_bytes()
                raw = gzip.decompress(raw) if gz else raw
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
                continue
            if len(text) < 200 or text in seen:
                continue
            seen.add(text)
            docs.append(text)
            total += len(text)
            if total >= limit_bytes:
                return docs
    return docs


def edit(text: str, rate: float, rng: random.Random) -> str:
    """Replace a `rate` fraction of the words (chosen at random) by fresh ones."""
    words = list(WORD.finditer(text))
    if not words:
        return text
    chosen = sorted(rng.sample(range(len(words)), max(1, int(rate * len(words)))))
    out, last = [], 0
    for i in chosen:
        m = words[i]
        out += [text[last : m.start()], f"w{rng.randrange(10**9):x}"]
        last = m.end()
    out.append(text[last:])
    return "".join(out)


def write_corpus(directory: Path, size: int, base: list[str], seed: int = 0) -> int:
    """JSONL files of ~SHARD_BYTES under `directory` holding `size` bytes of documents: the base as it
    is, then edited copies (see the module doc). Returns the bytes written."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    written, shard, out = 0, 0, None
    copy = 0
    while written < size:
        for doc in base:
            if copy:
                r = rng.random()
                doc = doc if r < 0.2 else edit(doc, rng.uniform(0.01, 0.03) if r < 0.7 else rng.uniform(0.25, 0.4), rng)
            line = (json.dumps({"text": doc}) + "\n").encode()
            if out is None or out.tell() >= SHARD_BYTES:
                if out is not None:
                    out.close()
                out = open(directory / f"shard-{shard:05d}.jsonl", "wb")  # noqa: SIM115
                shard += 1
            out.write(line)
            written += len(line)
            if written >= size:
                break
        copy += 1
    if out is not None:
        out.close()
    old = time.time() - 60  # not "racy": the files existed before the data stage ran
    for path in directory.iterdir():
        os.utime(path, (old, old))
    return written


def spec_file(path: Path, corpus: Path, workers: int) -> Path:
    path.write_text(
        "name: data-scale\n"
        "data:\n"
        f"  sources: [{{path: '{corpus}/*.jsonl', format: jsonl}}]\n"
        f"  workers: {workers}\n"
        f"  memory_limit: {MEMORY_LIMIT}\n"
        "  heldout_fraction: 0.05\n"
        "  tokenizer: {vocab_size: 8192, train_max_bytes: 20000000}\n"
    )
    return path


class TreeMemory:
    """The peak summed RSS and PSS of a process and all its descendants, sampled every 50 ms."""

    def __init__(self, pid: int):
        self.pid, self.peak_rss, self.peak_pss = pid, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _field(path: str, name: str) -> int:
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(name):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
        out, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo += children.get(p, [])
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            tree = self._tree()
            self.peak_rss = max(self.peak_rss, sum(self._field(f"/proc/{p}/status", "VmRSS:") for p in tree))
            self.peak_pss = max(self.peak_pss, sum(self._field(f"/proc/{p}/smaps_rollup", "Pss:") for p in tree))
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def prepare(spec: Path, cache: Path, *extra: str) -> dict:
    """One `runyard prepare` in its own process (into a cache the caller emptied); its wall time, memory
    peaks, the load average around it and its recorded CPU seconds per step."""
    argv = [sys.executable, "-m", "runyard", "prepare", str(spec), "--cache-dir", str(cache), "--no-progress", *extra]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    memory = TreeMemory(proc.pid)
    _, err = proc.communicate()
    memory.stop()
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"runyard prepare failed ({proc.returncode}):\n{err[-3000:]}")
    stats = json.loads(next((cache / "datasets").glob("*/prepared.json")).read_text())["stats"]
    return {"seconds": seconds, "peak_rss": memory.peak_rss, "peak_pss": memory.peak_pss,
            "load": [round(load, 2), round(os.getloadavg()[0], 2)], "cpu_seconds": stats.get("cpu_seconds", {}),
            "step_seconds": stats.get("timings", {})}


def _autogroup_on() -> bool:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def amdahl_two_workers(cpu_seconds: dict[str, float]) -> float:
    """The most 2 workers can gain over 1 given a run's CPU seconds per step: the tasks' work split in two,
    the main process's steps (deduplication, tokenizer training, assembly) as they are."""
    tasks = sum(v for k, v in cpu_seconds.items() if k.endswith("_tasks"))
    main = sum(v for k, v in cpu_seconds.items() if not k.endswith("_tasks"))
    return (main + tasks) / (main + tasks / 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100M,1G", help="corpus sizes (default 100M,1G; add 4G for the note)")
    parser.add_argument("--ratio-size", default="100M", help="corpus for the worker and Slurm ratios")
    parser.add_argument("--work", type=Path, default=Path("/tmp/runyard-data-scale"), help="scratch directory")
    parser.add_argument("--no-slurm", action="store_true", help="skip the Slurm comparison")
    parser.add_argument("--keep", action="store_true", help="keep the corpora and caches")
    add_common_args(parser, repeats=2)
    args = parser.parse_args()
    report = Report("data_scale", args, packages=["tokenizers", "pyarrow"])
    sizes = [_size(s) for s in args.sizes.split(",")]
    ratio_size = _size(args.ratio_size)
    work = args.work
    need = int(max(sizes) * 3.5)
    if free_bytes(work.parent) < need:
        raise SystemExit(f"{work.parent} has {human_bytes(free_bytes(work.parent))} free; the largest case needs ~{human_bytes(need)}")
    work.mkdir(parents=True, exist_ok=True)
    try:
        print("gathering real text ...", file=sys.stderr, flush=True)
        base = real_documents(120_000_000)
        print(f"  {len(base)} documents, {sum(map(len, base)) / 1e6:.0f} MB", file=sys.stderr, flush=True)
        peaks: dict[int, dict] = {}
        for size in sorted(set(sizes) | {ratio_size}):
            corpus = work / f"corpus-{size}"
            written = write_corpus(corpus, size, base)
            if size not in sizes:
                continue
            shutil.rmtree(work / "cache", ignore_errors=True)
            run = prepare(spec_file(work / "spec.yaml", corpus, 2), work / "cache")
            peaks[size] = run
            print(f"size {written / 1e6:.0f} MB: {written / 1e6 / run['seconds']:.2f} MB/s "
                  f"({run['seconds']:.0f} s), peak RSS {run['peak_rss'] / 2**20:.0f} MiB, "
                  f"peak PSS {run['peak_pss'] / 2**20:.0f} MiB (limit {MEMORY_LIMIT / 2**20:.0f} MiB), "
                  f"load {run['load'][0]}-{run['load'][1]}, CPU s {run['cpu_seconds']}", flush=True)
            if size != ratio_size and not args.keep:
                shutil.rmtree(corpus, ignore_errors=True)
        rss = Samples([p["peak_rss"] for p in peaks.values()])
        detail = {str(s): {k: round(v, 1) for k, v in p.items() if isinstance(v, float | int)}
                  for s, p in peaks.items()}
        report.ratio("data_scale_peak_rss_flatness", Samples([rss.high / rss.low]),
                     f"the smallest corpus's peak RSS ({', '.join(map(str, sizes))} bytes)", "<=", 1.2, detail)
        report.ratio("data_scale_peak_rss_vs_limit", Samples([rss.high / MEMORY_LIMIT]),
                     f"data.memory_limit {MEMORY_LIMIT >> 20} MiB", "<=", 1.0, detail)

        corpus = work / f"corpus-{ratio_size}"
        one, two = spec_file(work / "one.yaml", corpus, 1), spec_file(work / "two.yaml", corpus, 2)
        runs: dict[str, list[dict]] = {}

        def contender(name: str, spec: Path, *extra: str):
            return lambda: runs.setdefault(name, []).append(prepare(spec, work / "cache", *extra))

        contenders = {"1 worker": contender("1 worker", one), "2 workers": contender("2 workers", two)}
        if not args.no_slurm:
            contenders["slurm, 2 workers"] = contender("slurm, 2 workers", two, "--executor", "slurm")
        times = interleaved(contenders, args.repeats, warmup=0,
                            before=lambda _: shutil.rmtree(work / "cache", ignore_errors=True))
        for name, samples in times.items():
            print(f"{name}: {samples.rate(ratio_size / 1e6).spread()} MB/s", flush=True)
            for run in runs[name]:
                print(f"  {run['seconds']:.1f} s at load {run['load'][0]}-{run['load'][1]}; CPU s per step "
                      f"{run['cpu_seconds']}; wall s per step {run['step_seconds']}", flush=True)
        bound = Samples([amdahl_two_workers(r["cpu_seconds"]) for r in runs["1 worker"]])
        report.note(f"two workers over one, the most the CPU seconds allow (main-process steps alone, tasks "
                    f"on 2 CPUs): {bound.spread()}")
        report.ratio("data_scale_two_workers_vs_one", paired_ratio(times["1 worker"], times["2 workers"]),
                     "the same prepare with data.workers 1", ">=", 1.7)
        if not args.no_slurm:
            report.ratio("data_scale_slurm_vs_local", paired_ratio(times["2 workers"], times["slurm, 2 workers"]),
                         "the local executor, 2 workers, same machine", ">=", 0.9)
        report.note(f"1-minute load average before: {report.load_before[0]:.1f} on {os.cpu_count()} cores")
        if _autogroup_on():
            report.note("CFS autogroup is on: CPU is shared between sessions, and Slurm's array tasks each run in "
                        "a session of their own while the local workers share the preparer's; on a busy machine "
                        "the wall-clock ratios measure that as much as the executors")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())

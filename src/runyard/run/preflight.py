"""Checks before any work: the spec's sources resolve to files (a glob that matches nothing fails
here, not after the data stage has started; an image_folder source is listed by the image reader's own
`class_folders`), and the disk holds what the run will write. (A table's or images' content is checked
by runyard.plan.task_data, which `runyard plan` and `runyard run` both call before any work.)

`preflight(spec, run_dir)` gathers both for `runyard plan`; `check_run_disk(spec, run_dir)` refuses a run
whose checkpoints and export will not fit (the data cache is checked by the data stage itself, once it
knows whether the dataset is already prepared).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from runyard.data.footprint import data_need
from runyard.data.images import image_folder_files
from runyard.data.pipeline import resolve_cache_dir
from runyard.data.sklearn_sets import LOADERS as BUNDLED_SETS
from runyard.data.sources import InputFile, files_or_problem
from runyard.errors import DataError, SpecError
from runyard.plan.disk import run_dir_needs
from runyard.plan.task_data import refusal
from runyard.plan.weights_in import run_vocab
from runyard.spec.data import DataSpec
from runyard.spec.job import JobSpec, reference_hint, spec_warnings
from runyard.system.diskspace import DiskNeed, FilesystemCheck, check_disk, group_by_filesystem, human_bytes
from runyard.train.gates import read_gates


@dataclass(frozen=True)
class SourceListing:
    index: int
    path: str
    files: int
    bytes: int


@dataclass
class Preflight:
    sources: list[SourceListing]
    files: list[InputFile]
    disk: list[FilesystemCheck]
    warnings: list[tuple[str, object, str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "sources": [vars(s) for s in self.sources],
            "disk": [
                {
                    "filesystem": str(c.mount),
                    "free_bytes": c.free,
                    "needed_bytes": c.needed,
                    "fits": c.fits,
                    "needs": [{"what": n.what, "path": str(n.path), "bytes": n.bytes} for n in c.needs],
                }
                for c in self.disk
            ],
            "warnings": [{"field": f, "value": v, "message": m} for f, v, m in self.warnings],
        }

    def lines(self) -> list[str]:
        """The preflight as `runyard plan` prints it."""
        out = [
            f"source data.sources[{s.index}] {s.path!r}: "
            + ("a data set scikit-learn ships" if s.path.startswith("sklearn:") else f"{s.files:,} files, {human_bytes(s.bytes)}")
            for s in self.sources
        ]
        for c in self.disk:
            out += ["disk: " + c.describe()[0]] + [f"  {line}" for line in c.describe()[1:]]
        out += [f"warning: {f} = {v!r}: {m}" for f, v, m in self.warnings]
        return out


def resolve_sources(spec: DataSpec) -> tuple[list[InputFile], list[SourceListing]]:
    """Every source's files; a source that matches none is a SpecError naming it, its expansion and,
    where that is why, the exclude patterns that left nothing."""
    files: list[InputFile] = []
    listings: list[SourceListing] = []
    problems: list[tuple[str, object, str]] = []
    for i, source in enumerate(spec.sources):
        where = f"data.sources[{i}].path"
        if source.format == "sklearn":  # a set inside scikit-learn's wheel: no files to list
            if source.path not in BUNDLED_SETS:
                problems.append((where, source.path, f"one of scikit-learn's bundled sets {sorted(BUNDLED_SETS)} "
                                                     f"{reference_hint(where)}"))
            else:
                listings.append(SourceListing(i, f"sklearn:{source.path}", 0, 0))
            continue
        if source.format == "image_folder":  # a folder of class folders (or a glob of images): the reader's listing
            try:
                found, problem = image_folder_files(source, i), None
            except DataError as exc:
                raise refusal(exc) from None  # as the run's own check words it (plan.task_data)
        else:
            found, problem = files_or_problem(source, i, where)
        if problem is not None:
            problems.append(problem)
            continue
        files += found
        listings.append(SourceListing(i, source.path, len(found), sum(f.size for f in found)))
    if problems:
        raise SpecError("data.sources", problems)
    return files, listings


def _stages_done(spec: JobSpec, run_dir: Path) -> set[str]:
    done = set()
    for stage in spec.stages:
        record = read_gates(run_dir / "stages" / stage.name)
        if record is not None and record["passed"]:
            done.add(stage.name)
    return done


_vocab = run_vocab


def preflight(spec: JobSpec, run_dir: Path, cache_dir: Path | None = None) -> Preflight:
    """Resolve the sources (SpecError if one matches nothing) and estimate the disk the run needs."""
    files, listings, needs = [], [], []
    if spec.data is not None:  # an sft/dpo-only spec has no top-level data to read (its stages' records are checked apart)
        files, listings = resolve_sources(spec.data)
        need = data_need(spec.data, files, resolve_cache_dir(spec.data, cache_dir))
        needs.append(DiskNeed(need.what + " (unless already prepared)", need.path, need.bytes))
    if spec.task == "language_model":
        # A table's or an image model's size needs the data's facts (features, classes, image shape), read
        # by the plan itself; their checkpoints are kilobytes to megabytes, not worth a disk check here.
        needs += run_dir_needs(spec, run_dir, _vocab(spec), _stages_done(spec, run_dir))
    return Preflight(listings, files, group_by_filesystem(needs), spec_warnings(spec))


def check_run_disk(spec: JobSpec, run_dir: Path, stages_done: Collection[str] | None = None) -> None:
    """Refuse, with the figures, a run whose checkpoints and export will not fit under `run_dir`."""
    done = _stages_done(spec, run_dir) if stages_done is None else set(stages_done)
    check_disk(
        run_dir_needs(spec, run_dir, _vocab(spec), done),
        hint="free some space, point --run-dir at a larger disk, or lower checkpoint.keep_last",
    )

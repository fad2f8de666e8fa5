"""A table's or images' data read and checked before any work, by the run's own readers.

`check_task_data(task, data, seed)` reads the sources exactly as the run's data stage will (a table
through data/tabular.py's `prepare_table`, images through data/images.py's `read_images` and
data/image_prep.py's `check_images`: same split seed, same cleaning, nothing written) and returns what
it saw: the summary the run chooses its family from, the data report's counts, and how long the reading
took here. `runyard plan` sizes its plan from it (plan/dataprep.py) and `runyard run` calls
`check_data_in` before its run directory is opened, so every problem the data holds (no target column,
one class, a column mixing numbers and text, a missing value a policy refuses, an empty class folder,
images of different sizes without resize, an image that does not decode) is `DataRefused`, exit 2, with
nothing written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from runyard.data.image_prep import check_images
from runyard.data.images import read_images
from runyard.data.sources import list_source_files
from runyard.data.tabular import PreparedTable, prepare_table
from runyard.errors import EXIT_BAD_SPEC, DataError
from runyard.plan.families import DataSummary, table_summary
from runyard.spec.checks import IMAGE_TASK, TABULAR_TASKS
from runyard.spec.data import DataSpec
from runyard.spec.job import JobSpec
from runyard.spec.seeds import derive_seed


class DataRefused(DataError):
    """The data cannot train the spec, found before any work (the message names the file, row, column or
    field); nothing was written."""

    exit_code = EXIT_BAD_SPEC


@dataclass(frozen=True)
class CheckedData:
    """What the run's readers saw: the summary (rows, features, classes, image shape, as the run counts
    them), the data report's counts (removed rows, duplicates) and the seconds the reading took here."""

    summary: DataSummary
    seconds: float
    stats: dict[str, Any] = field(default_factory=dict)
    table: PreparedTable | None = None  # a table as prepared: the plan's fit calibration samples its rows


def split_seed(seed: int) -> int:
    """The seed the run's data stage splits with (run/predictive.py derives it the same way)."""
    return derive_seed(seed, "split")


def check_task_data(task: str, data: DataSpec, seed: int) -> CheckedData:
    """Read and check a table's or images' data as the run will (see the module's docstring); `seed` is
    the spec's. DataRefused (exit 2) naming the problem."""
    started = time.perf_counter()
    prepared = None
    try:
        if task in TABULAR_TASKS:
            prepared = prepare_table(data, task, split_seed(seed))
            summary, stats = table_summary(task, prepared), prepared.stats
        elif task == IMAGE_TASK:
            images = read_images(data)
            checked = check_images(images, data, split_seed(seed))
            n, c, h, w = checked.pixels.shape
            summary = DataSummary(task, "images", rows=n, features=c * h * w, classes=len(images.class_names),
                                  image_shape=(c, h, w), bytes=int(checked.pixels.nbytes))
            stats = {"images_read": len(images.labels), "removed": checked.removed}
        else:
            raise ValueError(f"check_task_data reads tables and images, not {task!r} data")
    except DataRefused:
        raise
    except DataError as exc:
        raise refusal(exc) from None
    return CheckedData(summary, time.perf_counter() - started, stats, prepared)


def refusal(exc: DataError) -> DataRefused:
    """A reader's DataError as the refusal before any work (the one wording plan and run both print)."""
    return DataRefused(f"the data cannot train this spec (refused before any work): {exc}")


def check_data_in(spec: JobSpec) -> CheckedData | None:
    """The run's pre-flight: a table or image spec's data read and checked (DataRefused, exit 2, before
    the run directory is opened); None for a language model (its data stage checks its own sources)."""
    if spec.task not in TABULAR_TASKS and spec.task != IMAGE_TASK:
        return None
    return check_task_data(spec.task, spec.data, spec.seed)


def summarize_data(spec: JobSpec) -> DataSummary:
    """The spec's data summarised as the run will see it: a table or images read and checked; a text
    corpus only measured (its files and bytes)."""
    checked = check_data_in(spec)
    if checked is not None:
        return checked.summary
    if spec.data is None:  # a fine-tune on its own records: no top-level corpus
        return DataSummary(spec.task, "text", rows=0, features=0, bytes=0)
    files = [f for i, s in enumerate(spec.data.sources) for f in list_source_files(s, i)]
    return DataSummary(spec.task, "text", rows=len(files), features=0, bytes=sum(f.size for f in files))

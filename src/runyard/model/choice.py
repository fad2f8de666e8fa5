"""Which registered family suits a task and its data: the one rule behind a run's choice (a spec that
leaves `model.family` out, runyard.plan.families) and `runyard plan`'s recommendation (runyard.plan.recommend).

The rule follows the usual advice: simple, low-dimensional data rarely needs a deep network, while
images and text do. So a tabular task gets a family the torch loop does not train (trees, a linear
model), images and text one it does (a CNN, a decoder). Each family's registry data says the rest: the
tasks it trains, and the fewest rows it is recommended for (`ModelFamily.min_rows`: trees want enough
rows to early-stop on held-out ones). Among the families that fit, the one wanting the most rows the
data has is taken, then the first by name, so a choice is a pure function of the registry and the data.
"""

from __future__ import annotations

from dataclasses import dataclass

from runyard.model.registry import FamilyUnavailable, ModelFamily, family_names, get_family
from runyard.spec.checks import IMAGE_TASK, LANGUAGE_MODEL, TABULAR_TASKS

# High-dimensional data: a deep network trained by the loop.
DEEP_TASKS = (LANGUAGE_MODEL, IMAGE_TASK)


@dataclass(frozen=True)
class FamilyDecision:
    """The family for a task's data (None: no installed family trains the task), and the families that
    would suit the task but want more rows than the data has."""

    family: ModelFamily | None
    wanting_more_rows: tuple[ModelFamily, ...] = ()

    @property
    def fewest_rows_wanted(self) -> int | None:
        """The smallest `min_rows` among the families passed over for want of rows."""
        return min((f.min_rows for f in self.wanting_more_rows), default=None)


def installed_families() -> list[ModelFamily]:
    """The registered families whose libraries are installed (a family from a missing extra cannot be
    recommended here, and must not stop a choice that does not need it)."""
    families = []
    for name in family_names():
        try:
            families.append(get_family(name))
        except FamilyUnavailable:
            continue
    return families


def needs_deep_network(task: str) -> bool:
    """Whether `task`'s data is high-dimensional (images, text); ValueError for a task runyard lacks."""
    if task not in DEEP_TASKS and task not in TABULAR_TASKS:
        raise ValueError(f"unknown task {task!r}")
    return task in DEEP_TASKS


def choose_family(task: str, rows: int | None) -> FamilyDecision:
    """The family for `task` and data of `rows` rows (None: not counted, as if plenty); see the module doc."""
    deep = needs_deep_network(task)
    suited = [f for f in installed_families() if task in f.tasks and f.trains_with_loop == deep]
    enough = [f for f in suited if rows is None or rows >= f.min_rows]
    wanting = tuple(f for f in suited if f not in enough)
    if not enough:
        return FamilyDecision(None, wanting)
    return FamilyDecision(min(enough, key=lambda f: (-f.min_rows, f.name)), wanting)


def no_family_message(task: str) -> str:
    """Why nothing can be chosen for `task` here, and what to install."""
    return (f"no registered family trains {task!r} yet here (runyard has {family_names()}; a family from a missing "
            "extra, e.g. `pip install 'runyard[predict]'` for tables, is left out)")

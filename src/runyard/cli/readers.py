"""What the reading verbs (generate, serve, show, and the market's deploy) share: where a run's export
is, and a word on stderr when a writer still holds the run (readers read only committed results).
Needs no torch: the market's verbs import it."""

from __future__ import annotations

import sys
from pathlib import Path

from runyard.system import rundir


def export_dir_of(path: Path) -> Path:
    """A run directory's export/, or `path` itself when it is an export directory (see
    cli/run_progress.py's `finished_export` for the reading verbs, which refuse an unfinished run)."""
    return path / "export" if (path / "export").is_dir() else path


def say_if_live(path: Path) -> None:
    """When a writer holds the run (`path` is the run directory or its export/), say so on stderr."""
    run_dir = path.parent if path.name == "export" else path
    message = rundir.live_message(run_dir)
    if message:
        print(f"runyard: {message}", file=sys.stderr)

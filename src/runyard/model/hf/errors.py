"""The error a Hugging Face model directory raises when runyard cannot take it as it is."""

from __future__ import annotations

from pathlib import Path

from runyard.model.registry import ExportError


class ModelDirectoryError(ExportError):
    """A model directory is missing, incomplete, or holds something runyard does not compute exactly.
    The message names the file and, where there is one, the field or tensor."""

    def __init__(self, file: Path | str, message: str, field: str | None = None):
        self.file, self.field = str(file), field
        where = f"{file}: field {field!r}" if field else f"{file}"
        super().__init__(f"{where}: {message}")

"""Fixtures for the data stage: small real corpora written into tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.data.data_fixtures import write_corpus


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus")

"""A lease job's environment lock, checked before any work: the refusals that need nothing fetched.

(Building and running in the environment, confined, is tested end to end in
tests/e2e/test_reproduce_market.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runyard.control import lease_env
from runyard.reproduce.build import find_interpreter
from runyard.reproduce.errors import LockUnsatisfiable
from runyard.reproduce.lock import KIND_WHEEL, EnvironmentLock, LockedDist, write_lock

HERE = f"{sys.version_info.major}.{sys.version_info.minor}"


def _script(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def _lock(major_minor: str, wheel_tags: list[str]) -> EnvironmentLock:
    python = {"implementation": "CPython", "version": f"{major_minor}.1", "major_minor": major_minor,
              "interpreter_tag": "cp" + major_minor.replace(".", ""), "platform": "linux-x86_64"}
    dist = LockedDist(name="ry-demo", version="1.0", kind=KIND_WHEEL, tags=wheel_tags,
                      filename=f"ry_demo-1.0-{wheel_tags[0]}.whl", sha256="0" * 64)
    return EnvironmentLock(python=python, torch=None, device_libraries=[], distributions=[dist])


def test_a_name_on_path_that_does_not_run_as_that_python_is_no_interpreter(tmp_path, monkeypatch):
    # A pyenv shim for a version that is not selected is on PATH and fails; another answers the wrong version.
    _script(tmp_path, "python3.97", "echo 'pyenv: python3.97: command not found' >&2; exit 127")
    _script(tmp_path, "python3.98", "echo 3.11")
    _script(tmp_path, "python3.99", "echo 3.99")
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert find_interpreter("3.97") is None
    assert find_interpreter("3.98") is None
    assert find_interpreter("3.99") == tmp_path / "python3.99"
    assert find_interpreter(HERE) == Path(sys.executable)


def test_a_lock_for_another_python_is_refused_naming_the_interpreter_first(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    _script(tmp_path / "bin", "python2.7", "exit 127")  # a shim that does not run
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    write_lock(tmp_path / "lock", _lock("2.7", ["cp27-cp27m-macosx_10_9_x86_64"]))
    with pytest.raises(LockUnsatisfiable) as raised:
        lease_env.check_lock(tmp_path / "lock")
    names = [name for name, _ in raised.value.problems]
    assert names[0] == "python" and "ry-demo==1.0" in names
    assert "Python 2.7.1" in str(raised.value).splitlines()[1]


def test_a_lock_this_machine_can_install_passes_the_check(tmp_path):
    write_lock(tmp_path / "lock", _lock(HERE, ["py3-none-any"]))
    assert lease_env.check_lock(tmp_path / "lock").python["major_minor"] == HERE

"""`runyard control start`'s disk options reach the lease jobs' settings and their sandbox limits, and
are explained in --help; a bad size is refused naming the option."""

from __future__ import annotations

import subprocess
import sys

import pytest

from runyard.cli import build_parser
from runyard.cli.control import _options
from runyard.control.agent import LeaseJobSettings


def _settings(tmp_path, *flags: str) -> LeaseJobSettings:
    argv = ["control", "start", "--state-dir", str(tmp_path / "s"), "--cpu-slots", "2", *flags]
    return _options(build_parser(argv).parse_args(argv)).lease_settings


def test_the_disk_options_become_the_lease_settings(tmp_path):
    default = _settings(tmp_path)
    assert (default.disk_per_device, default.disk_files_per_device, default.disk_floor_bytes, default.disk_kernel) \
        == (LeaseJobSettings().disk_per_device, LeaseJobSettings().disk_files_per_device,
            LeaseJobSettings().disk_floor_bytes, True)
    set_ = _settings(tmp_path, "--lease-disk-per-device", "100G", "--lease-disk-files-per-device", "5000",
                     "--disk-floor", "20G", "--lease-disk-watchdog", "--lease-max-file-size", "8G")
    assert (set_.disk_per_device, set_.disk_files_per_device, set_.disk_floor_bytes, set_.disk_kernel) \
        == (100 << 30, 5000, 20 << 30, False)
    limits = set_.sandbox_limits(devices=2)
    assert limits["disk_bytes"] == 200 << 30 and limits["disk_files"] == 10_000
    assert limits["disk_floor_bytes"] == 20 << 30 and limits["disk_kernel"] is False
    assert limits["max_file_bytes"] == 8 << 30


@pytest.mark.parametrize(("flag", "value"), [("--lease-disk-per-device", "lots"), ("--disk-floor", "-1G"),
                                             ("--lease-disk-files-per-device", "0")])
def test_a_bad_disk_setting_is_refused_naming_the_option(tmp_path, flag, value, capsys):
    argv = ["control", "start", "--state-dir", str(tmp_path / "s"), flag, value]
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)
    assert flag in capsys.readouterr().err


def test_the_help_explains_the_disk_options():
    out = subprocess.run([sys.executable, "-m", "runyard", "control", "start", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for flag in ("--lease-disk-per-device", "--lease-disk-files-per-device", "--disk-floor", "--lease-disk-watchdog"):
        assert flag in text
    assert "tenant's failure (exit 8, disk_quota)" in text and "loop-mounted filesystem" in text

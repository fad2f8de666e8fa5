"""The environment lock: content digests that bind an installed distribution to its archive, the honest
sources of archive hashes, and the lock files themselves."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from runyard.reproduce.archives import ArchiveFinder, ArchiveMemo, PipLocations, pip_locations
from runyard.reproduce.errors import NotReproducible
from runyard.reproduce.installed import DigestMemo, installed_distributions, read_wheel, wheel_filename
from runyard.reproduce.lock import (
    KIND_SOURCE,
    KIND_WHEEL,
    EnvironmentLock,
    LockedDist,
    capture_environment,
    read_lock,
    write_lock,
)
from runyard.system.files import sha256_file

from .helpers import make_wheel, pip_install_target


@pytest.fixture
def installed(tmp_path):
    """ry_demo 1.0 installed by pip into a folder, and the wheel it came from, as if from an index (pip
    writes no direct_url.json then)."""
    wheel = make_wheel(tmp_path / "wheels")
    site = tmp_path / "site"
    pip_install_target(wheel, site)
    (site / "ry_demo-1.0.dist-info" / "direct_url.json").unlink()
    (dist,) = installed_distributions([str(site)])
    return dist, wheel


def test_installed_digest_equals_its_wheels_and_not_a_rebuilt_ones(installed, tmp_path):
    dist, wheel = installed
    assert dist.name == "ry-demo" and dist.version == "1.0" and dist.tags == ("py3-none-any",)
    assert dist.wheel_filename() == wheel.name
    assert read_wheel(wheel).content_sha256 == dist.content_sha256
    rebuilt = make_wheel(tmp_path / "other", body="VALUE = 2\n")  # same name and version, other files
    assert read_wheel(rebuilt).content_sha256 != dist.content_sha256


def test_digests_are_remembered_by_record_and_a_reinstall_is_read_again(installed, tmp_path):
    dist, wheel = installed
    site, memo_path = tmp_path / "site", tmp_path / "memo" / "installed-digests.json"
    memo = DigestMemo(memo_path)
    assert installed_distributions([str(site)], memo) == [dist]
    memo.save()
    (key, digest), = json.loads(memo_path.read_text()).items()
    assert key.startswith(str((site / "ry_demo-1.0.dist-info" / "RECORD").resolve())) and digest == dist.content_sha256
    # The memo answers without reading RECORD: a planted digest under the same key is what comes back.
    memo_path.write_text(json.dumps({key: "planted"}))
    (again,) = installed_distributions([str(site)], DigestMemo(memo_path))
    assert again.content_sha256 == "planted"
    # Another install rewrites RECORD (size or mtime): its digest is computed from the files, not the memo.
    rebuilt = make_wheel(tmp_path / "other", body="VALUE = 2\n")
    shutil.rmtree(site)
    pip_install_target(rebuilt, site)
    (reinstalled,) = installed_distributions([str(site)], DigestMemo(memo_path))
    assert reinstalled.content_sha256 == read_wheel(rebuilt).content_sha256 != dist.content_sha256


def test_finder_proves_a_local_wheel_and_rejects_an_impostor(installed, tmp_path):
    dist, wheel = installed
    impostor_dir = tmp_path / "impostor"
    make_wheel(impostor_dir, body="VALUE = 666\n")
    finder = ArchiveFinder(PipLocations(find_links=[impostor_dir]), memo=ArchiveMemo(tmp_path / "memo.json"))
    assert finder.find(dist) is None  # same file name, different content: no hash is claimed
    finder = ArchiveFinder(PipLocations(find_links=[impostor_dir, wheel.parent]), memo=ArchiveMemo(tmp_path / "memo.json"))
    match = finder.find(dist)
    assert match is not None and match.sha256 == sha256_file(wheel) and match.source == f"find-links {wheel.parent}"
    finder.memo.save()
    remembered = json.loads((tmp_path / "memo.json").read_text())
    assert any(v.get("sha256") == sha256_file(wheel) for v in remembered.values())


def test_finder_reads_pip_http_cache_bodies(installed, tmp_path):
    dist, wheel = installed
    cache = tmp_path / "pip-cache"
    body = cache / "http-v2" / "a" / "b" / "c" / "d" / "e" / "0123456789abcdef.body"
    body.parent.mkdir(parents=True)
    shutil.copy(wheel, body)
    (body.parent / "fedcba.body").write_bytes(b"<html>not a wheel</html>")
    match = ArchiveFinder(PipLocations(cache_dir=cache), memo=ArchiveMemo(None)).find(dist)
    assert match is not None and match.source == "pip cache" and match.sha256 == sha256_file(wheel)
    assert match.filename == wheel.name  # rebuilt from the installed WHEEL tags


def test_finder_reads_file_index_pages(installed, tmp_path):
    dist, wheel = installed
    index = tmp_path / "simple"
    (index / "ry-demo").mkdir(parents=True)
    (index / "ry-demo" / "index.html").write_text(f'<a href="{wheel.as_uri()}#sha256=ignored">{wheel.name}</a>')
    match = ArchiveFinder(PipLocations(file_indexes=[index]), memo=ArchiveMemo(None)).find(dist)
    assert match is not None and match.sha256 == sha256_file(wheel)  # hashed by us, not taken from the page


def test_direct_url_archive_hash_is_used(tmp_path):
    wheel = make_wheel(tmp_path / "wheels")
    site = tmp_path / "site"
    pip_install_target(wheel, site)  # pip records archive_info with the hash for a path install
    (dist,) = installed_distributions([str(site)])
    assert (dist.direct_url or {}).get("archive_info"), dist.direct_url
    match = ArchiveFinder(PipLocations(), memo=ArchiveMemo(None)).find(dist)
    assert match is not None and match.source == "direct_url" and match.sha256 == sha256_file(wheel)


def test_pip_locations_follow_pip_configuration(tmp_path, monkeypatch):
    links, index = tmp_path / "links", tmp_path / "index"
    links.mkdir()
    index.mkdir()
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nfind-links = {links}\nextra-index-url = {index.as_uri()} https://example.invalid/simple\n")
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_NO_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "cache"))
    found = pip_locations()
    assert links in found.find_links and found.file_indexes[-1] == index and found.cache_dir == tmp_path / "cache"
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))  # the environment wins over the files, as in pip
    assert pip_locations().find_links == [index]


def test_wheel_filename_compresses_tags():
    tags = ["cp311-cp311-manylinux_2_27_x86_64", "cp311-cp311-manylinux_2_28_x86_64"]
    assert wheel_filename("numpy", "2.4.6", None, tags) == \
        "numpy-2.4.6-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"


def _lock(*dists: LockedDist) -> EnvironmentLock:
    python = {"implementation": "CPython", "version": "3.11.7", "major_minor": "3.11", "interpreter_tag": "cp311",
              "platform": "linux-x86_64", "libc": "glibc 2.36"}
    return EnvironmentLock(python=python, torch={"__version__": "2.13.0+cpu", "cuda": None}, device_libraries=[],
                           distributions=list(dists), runyard={"commit": "abc", "source_sha256": "f" * 64, "files": {}})


def test_requirements_text_hashes_what_was_proven_and_says_what_was_not(tmp_path):
    alpha = make_wheel(tmp_path / "wheels", name="alpha", version="1.0")
    make_wheel(tmp_path / "wheels", name="beta", version="2.0")
    lock = _lock(LockedDist("alpha", "1.0", KIND_WHEEL, sha256=sha256_file(alpha)),
                 LockedDist("beta", "2.0", KIND_WHEEL),
                 LockedDist("runyard", "0.1.0", KIND_SOURCE))
    text = lock.requirements_text()
    assert f"alpha==1.0 \\\n    --hash=sha256:{sha256_file(alpha)}" in text
    assert "beta==2.0  # no archive at hand" in text
    assert "# runyard==0.1.0: runyard from commit abc" in text
    assert "torch: 2.13.0+cpu (cuda: none" in text
    write_lock(tmp_path / "lock", lock)
    again = read_lock(tmp_path / "lock")
    assert again.sha256 == lock.sha256 and [d.name for d in again.unhashed()] == ["beta"]
    # pip itself refuses a lock with a missing hash, naming it: the lock never installs half-checked.
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-index", "-d", str(tmp_path / "dl"),
                           "--find-links", str(tmp_path / "wheels"), "-r", str(tmp_path / "lock" / "requirements.txt")],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "beta==2.0" in proc.stderr and "Hashes are required" in proc.stderr


def test_read_lock_rejects_a_hand_edited_requirements_file(tmp_path):
    write_lock(tmp_path, _lock(LockedDist("alpha", "1.0", KIND_WHEEL, sha256="a" * 64)))
    req = tmp_path / "requirements.txt"
    req.write_text(req.read_text().replace("a" * 64, "b" * 64))
    with pytest.raises(NotReproducible, match="edited by hand"):
        read_lock(tmp_path)
    with pytest.raises(NotReproducible, match="holds no environment lock"):
        read_lock(tmp_path / "nowhere")


def test_capture_environment_of_this_venv(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNYARD_ENV_CACHE", str(tmp_path))
    lock = capture_environment(ArchiveFinder(PipLocations(), memo=ArchiveMemo(None)))
    names = {d.name: d for d in lock.distributions}
    assert {"torch", "numpy", "runyard", "packaging"} <= set(names)
    assert lock.torch["__version__"] == names["torch"].version and "cuda" in lock.torch
    assert names["numpy"].kind == KIND_WHEEL and names["numpy"].content_sha256
    assert lock.runyard["source_sha256"] and "runyard/reproduce/lock.py" in lock.runyard["files"]
    assert lock.python["major_minor"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert capture_environment(ArchiveFinder(PipLocations(), memo=ArchiveMemo(None))).sha256 == lock.sha256

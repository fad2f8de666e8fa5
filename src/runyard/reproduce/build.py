"""A fresh virtual environment from a lock, cached by the lock's hash.

`build_environment(lock)`:
1. checks, before anything is fetched or built, that the lock can be installed here: an interpreter of
   the lock's Python version, every wheel's tags supported on this platform, nothing installed from a
   directory that only the original machine has (`platform_problems`);
2. fetches every archive into the cache (`pip download`): hashed ones in pip's hash-checking mode,
   unhashed ones checked against the content digest the lock recorded, so a hash is only ever filled
   in from an archive proven to hold exactly the files that were installed. An archive no index or
   wheelhouse has is named in a refusal; nothing has been installed or run at that point;
3. builds runyard's own wheel (from the recorded commit, else the installed tree: source.py);
4. creates the venv without pip's bootstrap and installs exactly the lock with this interpreter's pip
   (`pip --python VENV install --no-index --no-deps --require-hashes --no-compile`: byte-code is no part
   of the lock's digests, and Python writes it on first import for only the modules a run uses, where
   pip would compile every file of every package), so the venv holds the lock's
   distributions and nothing else; a CUDA torch cannot sneak in: torch's line is pinned to the hash
   of the build that ran;
5. verifies the result by locking the new venv and comparing it with the lock (versions, content
   digests, torch's build), and only then writes `ready.json`. A directory without it is a build that
   did not finish and is rebuilt.
A second reproduction of the same lock finds `ready.json` and reinstalls nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging import tags as packaging_tags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import Version

from runyard.reproduce import source as runyard_source
from runyard.reproduce.archives import env_cache_root
from runyard.reproduce.env_cache import READY_FILE, exclusive_build, mark_used
from runyard.reproduce.errors import EnvironmentBuildFailed, LockUnsatisfiable
from runyard.reproduce.installed import read_wheel
from runyard.reproduce.lock import (
    KIND_LOCAL,
    KIND_SOURCE,
    KIND_UNRECORDED,
    KIND_WHEEL,
    EnvironmentLock,
)
from runyard.system.files import atomic_write_text, sha256_file

_PIP_TIMEOUT_S = 1800
_NO_MATCH = re.compile(r"(?:No matching distribution found for|satisfies the requirement) ([A-Za-z0-9._-]+)")
_HASH_MISMATCH = re.compile(r"^\s+([A-Za-z0-9._-]+)==\S+ from ", re.MULTILINE)


@dataclass
class BuiltEnvironment:
    """A ready environment in the cache."""

    key: str
    root: Path
    python: Path
    archives: Path
    reused: bool
    runyard_origin: str | None = None
    runyard_source_changes: list[str] = field(default_factory=list)
    completed_hashes: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def record(self) -> dict:
        data = asdict(self)
        for key in ("root", "python", "archives"):
            data[key] = str(data[key])
        return data


def find_interpreter(major_minor: str) -> Path | None:
    """An interpreter of the lock's Python version: this one, or python<X.Y> on PATH."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == major_minor:
        return Path(sys.executable)
    found = shutil.which(f"python{major_minor}")
    if not found:
        return None
    # A name on PATH is not an interpreter yet: a pyenv shim for a version not selected is there and fails.
    try:
        proc = subprocess.run([found, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(found) if proc.returncode == 0 and proc.stdout.strip() == major_minor else None


def supported_tags(major_minor: str) -> set[str]:
    """The wheel tags an interpreter of that version accepts on this platform."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == major_minor:
        return {str(t) for t in packaging_tags.sys_tags()}
    version = tuple(int(p) for p in major_minor.split("."))
    found = list(packaging_tags.cpython_tags(version)) + list(packaging_tags.compatible_tags(version))
    return {str(t) for t in found}


def platform_problems(lock: EnvironmentLock) -> list[tuple[str, str]]:
    """Why the lock cannot be installed on this machine, per package; empty when it can."""
    problems = []
    mm = lock.python["major_minor"]
    if find_interpreter(mm) is None:
        problems.append(("python", f"the lock needs Python {lock.python['version']} ({lock.python['interpreter_tag']}); "
                                   f"this machine has {sys.version.split()[0]} and no python{mm} on PATH"))
    tags = supported_tags(mm)
    for d in lock.distributions:
        if d.kind == KIND_LOCAL:
            url = (d.direct_url or {}).get("url", "?")
            problems.append((d.pin, f"installed from the local directory {url}; no index or wheelhouse has it"))
        elif d.kind == KIND_UNRECORDED:
            problems.append((d.pin, "installed without a RECORD (not by a wheel installer): nothing to rebuild it from"))
        elif d.kind == KIND_WHEEL and d.tags and not tags.intersection(d.tags):
            problems.append((d.pin, f"its wheel {d.filename} is built for {', '.join(sorted(set(d.tags)))}; "
                                    f"this platform takes {lock_platform_hint(tags)}"))
    return problems


def lock_platform_hint(tags: set[str]) -> str:
    platforms = sorted({t.split("-")[2] for t in tags if not t.endswith("-any")})
    return ", ".join(platforms[:3]) + (" ..." if len(platforms) > 3 else "")


def _pip(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)


def _failed_names(output: str) -> list[str]:
    names = _NO_MATCH.findall(output) + _HASH_MISMATCH.findall(output)
    return list(dict.fromkeys(n.split("==")[0] for n in names))


def _download(pins: dict[str, str], dest: Path, hashed: bool, source_args: list[str]) -> dict[str, str]:
    """pip download each pin (name -> requirement line) into `dest`; returns name -> why for those that failed.
    pip stops at its first failure, so a failed package is set aside and the rest tried again."""
    failures: dict[str, str] = {}
    remaining = dict(pins)
    while remaining:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="runyard-lock-", delete=False) as f:
            f.write("".join(line + "\n" for line in remaining.values()))
            req_file = f.name
        args = ["download", "--no-deps", "--only-binary=:all:", "--dest", str(dest), "-r", req_file, *source_args]
        if hashed:
            args.append("--require-hashes")
        try:
            proc = _pip(args)
        finally:
            os.unlink(req_file)
        if proc.returncode == 0:
            break
        output = proc.stdout + proc.stderr
        failed = [n for n in _failed_names(output) if n in remaining]
        if not failed:  # an error pip did not attribute to one package: report it whole
            failures.update({n: "pip download failed: " + output.strip()[-800:] for n in remaining})
            break
        for name in failed:
            why = "its archive does not match the lock's hash" if name in _HASH_MISMATCH.findall(output) else \
                "no archive of this version for this platform on the configured indexes or wheelhouse"
            failures[name] = why
            remaining.pop(name)
    return failures


def _archives_by_release(dest: Path) -> dict[tuple[str, str], Path]:
    """(canonical name, version) -> wheel file, from the file names alone (PEP 427)."""
    found = {}
    for path in sorted(dest.glob("*.whl")):
        try:
            name, version, _build, _tags = parse_wheel_filename(path.name)
        except InvalidWheelFilename:
            continue
        found[(name, str(version))] = path
    return found


def fetch_archives(lock: EnvironmentLock, dest: Path, source_args: list[str]) -> dict[str, str]:
    """Every wheel of the lock into `dest`, proven; returns the hashes completed here (name -> sha256).
    Raises LockUnsatisfiable naming every package that could not be had."""
    dest.mkdir(parents=True, exist_ok=True)
    wheels = [d for d in lock.distributions if d.kind == KIND_WHEEL]
    hashed = {d.name: f"{d.pin} --hash=sha256:{d.sha256}" for d in wheels if d.sha256}
    unhashed = {d.name: d.pin for d in wheels if not d.sha256}
    failures = _download(hashed, dest, True, source_args) if hashed else {}
    failures.update(_download(unhashed, dest, False, source_args) if unhashed else {})
    completed = {}
    fetched = _archives_by_release(dest)
    for d in wheels:
        if d.name in failures:
            continue
        path = fetched.get((d.name, str(Version(d.version))))
        if path is None:
            failures[d.name] = "pip reported it downloaded, but no wheel of it is in the archive folder"
        elif d.sha256 is None:
            facts = read_wheel(path)
            if d.content_sha256 is not None and facts.content_sha256 != d.content_sha256:
                failures[d.name] = (f"the index's archive {path.name} holds different files from the ones that were "
                                    "installed (content digests differ); the lock cannot be completed honestly")
                path.unlink()
            else:
                completed[d.name] = sha256_file(path)
    if failures:
        named = {d.name: d.pin for d in lock.distributions}
        raise LockUnsatisfiable([(named.get(n, n), why) for n, why in sorted(failures.items())],
                                hint="bundle the run on a machine that has them (`runyard env bundle RUN_DIR`), "
                                     "or pass --find-links DIR with the missing wheels")
    return completed


def runyard_wheel(lock: EnvironmentLock, dest: Path) -> tuple[Path | None, str | None, list[str]]:
    """runyard's wheel for a lock that records it by source: from the commit when its files are the recorded
    ones, else from the installed tree; with the files that still differ from the record."""
    if not any(d.kind == KIND_SOURCE for d in lock.distributions) or lock.runyard is None:
        return None, None, []
    recorded = lock.runyard.get("files", {})
    commit = lock.runyard.get("commit") or ""
    root = runyard_source.project_root()
    roots = [r for r in (root, Path(lock.runyard["checkout"]) if lock.runyard.get("checkout") else None) if r]
    reachable = next((r for r in roots if not commit.endswith("+dirty") and commit and
                      runyard_source.has_commit(r, commit)), None)
    wheel_dir = dest / "runyard-build"
    if reachable is not None:
        wheel, origin = runyard_source.build_wheel(wheel_dir, commit, reachable)
        changes = _wheel_source_changes(wheel, recorded)
        if not changes:
            return _moved(wheel, dest), origin, []
        shutil.rmtree(wheel_dir)
    tree_changes = runyard_source.changed_files(recorded, runyard_source.source_files())
    wheel, origin = runyard_source.build_wheel(wheel_dir, None, root)
    return _moved(wheel, dest), origin, tree_changes


def _moved(wheel: Path, dest: Path) -> Path:
    target = dest / wheel.name
    shutil.move(str(wheel), target)
    shutil.rmtree(wheel.parent, ignore_errors=True)
    return target


def _wheel_source_changes(wheel: Path, recorded: dict[str, str]) -> list[str]:
    unpacked = wheel.parent / "unpacked"
    shutil.unpack_archive(str(wheel), unpacked, format="zip")
    files = runyard_source.source_files(unpacked / "runyard")
    shutil.rmtree(unpacked)
    return runyard_source.changed_files(recorded, files)


def completed_requirements(lock: EnvironmentLock, completed: dict[str, str], own_wheel: Path | None) -> str:
    """The lock with every hash filled in (and runyard's wheel), ready for `pip install --require-hashes`."""
    lines = [f"# {lock.sha256}: the run's lock, its hashes completed from proven archives", ""]
    for d in lock.distributions:
        if d.kind == KIND_WHEEL:
            lines.append(f"{d.pin} --hash=sha256:{d.sha256 or completed[d.name]}")
        elif d.kind == KIND_SOURCE and own_wheel is not None:
            lines.append(f"{d.pin} --hash=sha256:{sha256_file(own_wheel)}")
    return "\n".join(lines) + "\n"


def verify_environment(python: Path, lock: EnvironmentLock) -> list[str]:
    """Differences between the built venv and the lock (empty when it is exactly the lock)."""
    proc = subprocess.run([str(python), "-m", "runyard", "env", "lock", "--json", "--no-archives"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return [f"runyard does not start in the new environment: {proc.stderr.strip()[-800:]}"]
    built = EnvironmentLock.from_json(json.loads(proc.stdout))
    want, have = lock.by_name(), built.by_name()
    problems = [f"{n}: in the lock, not installed" for n in sorted(set(want) - set(have))]
    problems += [f"{n}=={have[n].version}: installed, not in the lock" for n in sorted(set(have) - set(want))]
    for name in sorted(set(want) & set(have)):
        w, h = want[name], have[name]
        if w.version != h.version:
            problems.append(f"{name}: lock {w.version}, installed {h.version}")
        elif w.kind == KIND_WHEEL and w.content_sha256 and w.content_sha256 != h.content_sha256:
            problems.append(f"{name}=={w.version}: installed files differ from the locked ones")
    for key in ("__version__", "cuda", "hip"):
        if (lock.torch or {}).get(key) != (built.torch or {}).get(key):
            problems.append(f"torch build {key}: lock {(lock.torch or {}).get(key)!r}, installed {(built.torch or {}).get(key)!r}")
    return problems


def ready_environment(lock: EnvironmentLock, cache_root: Path | None = None) -> BuiltEnvironment | None:
    """The cached environment of `lock` if a finished build of it is there."""
    root = (cache_root if cache_root is not None else env_cache_root()) / lock.sha256[:24]
    python = root / "venv" / "bin" / "python"
    if not (root / READY_FILE).is_file() or not python.exists():
        return None
    record = json.loads((root / READY_FILE).read_text())
    mark_used(root)
    return BuiltEnvironment(**{**record, "root": root, "python": python, "archives": root / "archives", "reused": True})


def build_environment(
    lock: EnvironmentLock,
    cache_root: Path | None = None,
    find_links: list[Path] | None = None,
    offline: bool = False,
    say: Callable[[str], None] = lambda _msg: None,
) -> BuiltEnvironment:
    """The venv of `lock`, built now or found in the cache. Raises LockUnsatisfiable before any work when the
    lock cannot be installed here."""
    problems = platform_problems(lock)
    if problems:
        raise LockUnsatisfiable(problems)
    interpreter = find_interpreter(lock.python["major_minor"])
    key = lock.sha256
    cache_root = cache_root if cache_root is not None else env_cache_root()
    root = cache_root / key[:24]
    venv, archives = root / "venv", root / "archives"
    python = venv / "bin" / "python"
    with exclusive_build(cache_root, key):
        ready = ready_environment(lock, cache_root)
        if ready is not None:
            return ready
        started = time.monotonic()
        shutil.rmtree(root, ignore_errors=True)  # an unfinished earlier build
        root.mkdir(parents=True)
        # Archives of environments built before are proven ones (and pip checks every hash anyway): a
        # reproduction of a reproduction finds runyard's wheel there.
        earlier = sorted(p for p in cache_root.glob("*/archives") if p.is_dir() and p != archives)
        source_args = [arg for d in [*(find_links or []), *earlier] for arg in ("--find-links", str(d))]
        if offline:
            source_args.append("--no-index")
        try:
            say(f"fetching {sum(d.kind == KIND_WHEEL for d in lock.distributions)} archives "
                f"({len(lock.unhashed())} to prove against the installed files)")
            completed = fetch_archives(lock, archives, source_args)
            say("building runyard's wheel")
            wheel, origin, changes = runyard_wheel(lock, archives)
            atomic_write_text(root / "requirements.txt", completed_requirements(lock, completed, wheel))
            say(f"creating the venv with {interpreter} and installing {len(lock.distributions)} distributions")
            _run_checked([str(interpreter), "-m", "venv", "--without-pip", str(venv)], "creating the venv")
            _run_checked([sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python),
                          "install", "--no-index", "--no-deps", "--require-hashes", "--no-compile",
                          "--find-links", str(archives),
                          "-r", str(root / "requirements.txt")], "installing the lock")
            say("verifying the environment against the lock")
            mismatches = verify_environment(python, lock)
            if mismatches:
                raise EnvironmentBuildFailed("the built environment differs from the lock:\n  " + "\n  ".join(mismatches))
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        built = BuiltEnvironment(key=key, root=root, python=python, archives=archives, reused=False,
                                 runyard_origin=origin, runyard_source_changes=changes, completed_hashes=completed,
                                 seconds=round(time.monotonic() - started, 1))
        record = {k: v for k, v in built.record().items() if k not in ("root", "python", "archives", "reused")}
        atomic_write_text(root / READY_FILE, json.dumps(record, indent=1, sort_keys=True))
        return built


def _run_checked(argv: list[str], what: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    if proc.returncode != 0:
        raise EnvironmentBuildFailed(f"{what} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr).strip()[-2000:]}")

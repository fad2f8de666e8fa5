"""runyard's own source: the digest of its files, its git commit, and a wheel built from either.

A run made from a checkout (an editable install) has no archive on any index, so the lock records the
commit and a digest per source file instead; a reproduction installs a wheel built from that commit
when the commit is clean and reachable, else from the installed tree, and says which.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import runyard
from runyard.reproduce.errors import EnvironmentBuildFailed
from runyard.reproduce.installed import content_digest

PACKAGE_DIR = Path(runyard.__file__).resolve().parent
# What a wheel of the project holds besides the package: the files its pyproject.toml needs to build.
_PROJECT_FILES = ("pyproject.toml", "README.md", "LICENSE", "setup.cfg", "MANIFEST.in")


def source_files(package_dir: Path = PACKAGE_DIR) -> dict[str, str]:
    """sha256 of every file of the package (path relative to the package's parent), no byte-code."""
    files = {}
    for path in sorted(package_dir.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            rel = path.relative_to(package_dir.parent).as_posix()
            files[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


def source_digest(files: dict[str, str]) -> str:
    return content_digest(files)


def project_root(package_dir: Path = PACKAGE_DIR) -> Path | None:
    """The checkout the package is imported from (it has a pyproject.toml), or None for an installed wheel."""
    for candidate in (package_dir.parent, package_dir.parent.parent):
        if (candidate / "pyproject.toml").is_file():
            return candidate
    return None


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)


def git_commit(root: Path | None = None) -> str | None:
    """The checkout's commit; '+dirty' when tracked files have uncommitted changes. None if not a checkout."""
    root = root if root is not None else project_root()
    if root is None:
        return None
    try:
        head = _git(root, "rev-parse", "HEAD")
        if head.returncode != 0:
            return None
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def has_commit(root: Path, commit: str) -> bool:
    try:
        return _git(root, "cat-file", "-e", f"{commit}^{{commit}}").returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _export_commit(root: Path, commit: str, dest: Path) -> None:
    archive = dest.parent / "source.tar"
    with open(archive, "wb") as out:
        proc = subprocess.run(["git", "archive", "--format=tar", commit], cwd=root, stdout=out,
                              stderr=subprocess.PIPE, timeout=120)
    if proc.returncode != 0:
        raise EnvironmentBuildFailed(f"git archive {commit} in {root} failed: {proc.stderr.decode().strip()}")
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()


def _copy_tree(root: Path, dest: Path) -> None:
    for name in _PROJECT_FILES:
        if (root / name).is_file():
            shutil.copy2(root / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(PACKAGE_DIR, dest / PACKAGE_DIR.relative_to(root), ignore=ignore)


def build_wheel(out_dir: Path, commit: str | None, root: Path | None) -> tuple[Path, str]:
    """Build runyard's wheel into `out_dir` from `commit` in the checkout `root` when given (and clean),
    else from the installed tree. Returns the wheel and a line saying what it was built from."""
    root = root if root is not None else project_root()
    if root is None:
        raise EnvironmentBuildFailed(
            "runyard is not installed from a checkout and the run's commit is not reachable: no source to build "
            "its wheel from (install runyard from a clone that has the run's commit)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="runyard-wheel-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        if commit is not None:
            _export_commit(root, commit, src)
            origin = f"git commit {commit} of {root}"
        else:
            _copy_tree(root, src)
            origin = f"the installed tree {root}"
        args = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", tmp + "/out", str(src)]
        if importlib.util.find_spec("setuptools") is not None:
            args.insert(5, "--no-build-isolation")  # build with the setuptools at hand, no index needed
        proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
        wheels = sorted(Path(tmp, "out").glob("runyard-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise EnvironmentBuildFailed(f"building runyard's wheel from {origin} failed:\n{proc.stderr.strip()}")
        target = out_dir / wheels[0].name
        shutil.move(str(wheels[0]), target)
    return target, origin


def describe_source() -> dict:
    """The lock's record of runyard's source: version, commit, checkout, per-file digests."""
    files = source_files()
    root = project_root()
    return {
        "version": runyard.__version__,
        "commit": git_commit(root),
        "checkout": str(root) if root is not None else None,
        "source_sha256": source_digest(files),
        "files": files,
    }


def changed_files(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """Paths added, removed or changed between two per-file digest maps, sorted."""
    return sorted(p for p in set(recorded) | set(current) if recorded.get(p) != current.get(p))


"""A run's environment lock: `env/requirements.txt` and `env/environment.json`.

`requirements.txt` is pip's hash-checking requirements format: one `name==version --hash=sha256:...`
line per installed distribution, installable with `pip install --no-deps --require-hashes -r` by any pip
since 8.0 and by `uv pip install`. (PEP 751's pylock.toml would say the same, but the pip on these
machines, like most pips in the field, cannot install from it; uv can install both.) Its sha256 is the
lock's hash, the key of a rebuilt environment's cache, so it holds nothing that varies between two
identical environments (no paths, no times).

A hash is written only for an archive proven to be the installed one (archives.py). A distribution
with no such archive at hand is still pinned, with a comment saying so; pip's hash-checking mode then
refuses the file, naming it, until `runyard env bundle` or a reproduction has fetched an archive and
proven it against the content digest recorded here. runyard itself, run from a checkout, is recorded
by commit and per-file digests instead of a line (source.py).

`environment.json` carries what pip's format has no field for: the interpreter, torch's build and
device libraries, each distribution's wheel tags, content digest and where its hash came from, and the
environment variables that change numerics.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging import tags as packaging_tags

from runyard.reproduce import source as runyard_source
from runyard.reproduce.archives import ArchiveFinder, env_cache_root
from runyard.reproduce.errors import NotReproducible
from runyard.reproduce.installed import DigestMemo, InstalledDist, installed_distributions
from runyard.system.files import atomic_write_text

LOCK_DIR = "env"
REQUIREMENTS_FILE = "requirements.txt"
FACTS_FILE = "environment.json"
FORMAT = "runyard.environment/1"
DEVICE_LIBRARY_PREFIXES = ("nvidia-", "triton", "pytorch-triton", "cuda-", "intel-", "mkl", "rocm", "amd-")
NUMERICS_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE",
                "CUBLAS_WORKSPACE_CONFIG", "CUDA_VISIBLE_DEVICES", "NVIDIA_TF32_OVERRIDE", "PYTHONHASHSEED",
                "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "MKL_CBWR", "ATEN_CPU_CAPABILITY")

# How a distribution can be installed from the lock.
KIND_WHEEL = "wheel"  # a pinned line (hashed when an archive was proven)
KIND_SOURCE = "runyard-source"  # runyard from a checkout: built from the recorded commit or tree
KIND_LOCAL = "local-directory"  # another project installed from a directory: not installable elsewhere
KIND_UNRECORDED = "unrecorded"  # installed without a RECORD (not by a wheel installer)


@dataclass
class LockedDist:
    """One distribution as the lock records it."""

    name: str
    version: str
    kind: str
    tags: list[str] = field(default_factory=list)
    filename: str | None = None
    sha256: str | None = None
    hash_source: str | None = None
    content_sha256: str | None = None
    installer: str | None = None
    direct_url: dict | None = None

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass
class EnvironmentLock:
    """The whole lock: interpreter, torch build, distributions, runyard's source."""

    python: dict
    torch: dict | None
    device_libraries: list[dict]
    distributions: list[LockedDist]
    runyard: dict | None = None
    numerics_env: dict = field(default_factory=dict)
    format: str = FORMAT

    def by_name(self) -> dict[str, LockedDist]:
        return {d.name: d for d in self.distributions}

    def unhashed(self) -> list[LockedDist]:
        return [d for d in self.distributions if d.kind == KIND_WHEEL and d.sha256 is None]

    def requirements_text(self) -> str:
        """The hash-checking requirements file (deterministic for a given environment)."""
        py, torch = self.python, self.torch
        lines = [
            "# runyard environment lock: pip's hash-checking requirements format (details: environment.json)",
            f"# python: {py['implementation']} {py['version']} ({py['interpreter_tag']}), {py['platform']}"
            + (f", {py['libc']}" if py.get("libc") else ""),
        ]
        if torch is not None:
            lines.append(f"# torch: {torch.get('__version__')} (cuda: {torch.get('cuda') or 'none'}, "
                         f"hip: {torch.get('hip') or 'none'})")
        lines += ["# install: pip install --no-deps --require-hashes -r requirements.txt", ""]
        for d in self.distributions:
            if d.kind == KIND_WHEEL and d.sha256:
                lines += [f"{d.pin} \\", f"    --hash=sha256:{d.sha256}"]
            elif d.kind == KIND_WHEEL:
                lines.append(f"{d.pin}  # no archive at hand to prove a hash; `runyard env bundle` fetches one")
            elif d.kind == KIND_SOURCE and self.runyard is not None:
                lines.append(f"# {d.pin}: runyard from commit {self.runyard.get('commit')} "
                             f"(source sha256 {self.runyard.get('source_sha256')}), installed as a wheel built from it")
            else:
                lines.append(f"# {d.pin}: {d.kind}, cannot be installed from this lock")
        return "\n".join(lines) + "\n"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.requirements_text().encode()).hexdigest()

    def to_json(self) -> dict:
        data = asdict(self)
        data["lock_sha256"] = self.sha256
        return data

    @classmethod
    def from_json(cls, data: dict) -> EnvironmentLock:
        if data.get("format") != FORMAT:
            raise NotReproducible(f"environment lock format {data.get('format')!r} is not {FORMAT!r}")
        dists = [LockedDist(**d) for d in data["distributions"]]
        return cls(python=data["python"], torch=data.get("torch"), device_libraries=data.get("device_libraries", []),
                   distributions=dists, runyard=data.get("runyard"), numerics_env=data.get("numerics_env", {}))


def python_facts() -> dict:
    libc = " ".join(platform.libc_ver()).strip()
    first_tag = next(iter(packaging_tags.sys_tags()))
    return {
        "implementation": platform.python_implementation(),
        "version": platform.python_version(),
        "major_minor": f"{sys.version_info.major}.{sys.version_info.minor}",
        "interpreter_tag": f"{packaging_tags.interpreter_name()}{packaging_tags.interpreter_version()}",
        "platform": sysconfig.get_platform(),
        "machine": platform.machine(),
        "libc": libc or None,
        "best_tag": str(first_tag),
    }


def torch_build(dists: list[InstalledDist]) -> dict | None:
    """torch's build as its `torch/version.py` states it (version, CUDA, HIP, git), read without importing torch."""
    torch = next((d for d in dists if d.name == "torch"), None)
    if torch is None:
        return None
    facts: dict = {"__version__": torch.version}
    version_file = Path(torch.location) / "torch" / "version.py"
    try:
        tree = ast.parse(version_file.read_text())
    except (OSError, SyntaxError):
        return facts
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            facts[target.id] = value.value
    return facts


def _locked(dist: InstalledDist, finder: ArchiveFinder, own_source: dict | None) -> LockedDist:
    common = {"name": dist.name, "version": dist.version, "tags": list(dist.tags),
              "content_sha256": dist.content_sha256, "installer": dist.installer, "direct_url": dist.direct_url}
    if dist.name == "runyard" and dist.from_local_directory and own_source is not None:
        return LockedDist(kind=KIND_SOURCE, **common)
    if dist.from_local_directory:
        return LockedDist(kind=KIND_LOCAL, **common)
    if dist.content_sha256 is None and not (dist.direct_url or {}).get("archive_info"):
        return LockedDist(kind=KIND_UNRECORDED, **common)
    match = finder.find(dist)
    return LockedDist(kind=KIND_WHEEL, filename=match.filename if match else dist.wheel_filename(),
                      sha256=match.sha256 if match else None, hash_source=match.source if match else None, **common)


def capture_environment(finder: ArchiveFinder | None = None, paths: list[str] | None = None) -> EnvironmentLock:
    """The lock of the running interpreter's environment."""
    finder = finder if finder is not None else ArchiveFinder()
    digests = DigestMemo(env_cache_root() / "installed-digests.json")
    dists = installed_distributions(paths, digests)
    digests.save()
    own = next((d for d in dists if d.name == "runyard"), None)
    # Its files' digests are recorded however runyard is installed, so two runs' sources can be compared.
    own_source = runyard_source.describe_source() if own is not None else None
    locked = [_locked(d, finder, own_source) for d in dists]
    finder.memo.save()
    return EnvironmentLock(
        python=python_facts(),
        torch=torch_build(dists),
        device_libraries=[{"name": d.name, "version": d.version} for d in dists
                          if d.name.startswith(DEVICE_LIBRARY_PREFIXES)],
        distributions=locked,
        runyard=own_source,
        numerics_env={k: os.environ[k] for k in NUMERICS_ENV if k in os.environ},
    )


def write_lock(directory: Path, lock: EnvironmentLock) -> None:
    """Write requirements.txt and environment.json into `directory` (each atomically)."""
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_text(directory / REQUIREMENTS_FILE, lock.requirements_text())
    atomic_write_text(directory / FACTS_FILE, json.dumps(lock.to_json(), indent=1, sort_keys=True) + "\n")


def read_lock(directory: Path) -> EnvironmentLock:
    """The lock in `directory`; the requirements file must be the one environment.json describes."""
    facts_path, req_path = directory / FACTS_FILE, directory / REQUIREMENTS_FILE
    if not facts_path.is_file() or not req_path.is_file():
        raise NotReproducible(f"{directory} holds no environment lock ({REQUIREMENTS_FILE} and {FACTS_FILE}); "
                              "runs started before locks were written cannot be rebuilt from one")
    try:
        data = json.loads(facts_path.read_text())
    except json.JSONDecodeError as exc:
        raise NotReproducible(f"{facts_path} is not valid JSON ({exc})") from None
    lock = EnvironmentLock.from_json(data)
    if lock.requirements_text() != req_path.read_text():
        raise NotReproducible(f"{req_path} does not match {facts_path}: one of them was edited by hand")
    return lock

"""Where an installed distribution's archive can honestly be found, and its sha256.

A lock's hashes must be of the archive that was installed, so a candidate archive counts only if its
content digest (installed.py) equals the installed distribution's. Candidates come from:

- PEP 610 `direct_url.json`: an archive installed by path or URL carries its hash from install time;
- pip's local sources, read from pip's own configuration (files and PIP_* variables): `find-links`
  directories and `file://` indexes (simple-API pages);
- pip's HTTP cache (`http-v2`, pip 23.3 and newer, where each response body is a file of its own);
- directories the caller adds (a run's wheelhouse, an environment cache's archives).

Hashes and digests of local files are remembered by (path, size, mtime) in the environment cache, so a
run's start reads a large wheel once, not every time.
"""

from __future__ import annotations

import configparser
import os
import re
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from runyard.reproduce.installed import InstalledDist, WheelFacts, read_wheel
from runyard.system.files import JsonMemo, sha256_file

_HREF = re.compile(r'href="([^"]+)"', re.IGNORECASE)


def env_cache_root() -> Path:
    """$RUNYARD_ENV_CACHE, else ~/.cache/runyard/env: built environments and the archive memo."""
    chosen = os.environ.get("RUNYARD_ENV_CACHE")
    return Path(chosen).expanduser() if chosen else Path.home() / ".cache" / "runyard" / "env"


@dataclass(frozen=True)
class ArchiveMatch:
    """An archive proven to be the one a distribution was installed from."""

    filename: str
    sha256: str
    source: str  # how it was found: "direct_url", "find-links DIR", "index URL", "pip cache", "wheelhouse DIR"
    path: str | None = None  # the local file, when there is one


@dataclass
class PipLocations:
    """The local places pip itself would look for archives, from its configuration."""

    find_links: list[Path] = field(default_factory=list)
    file_indexes: list[Path] = field(default_factory=list)
    cache_dir: Path | None = None


def _pip_config_files() -> list[Path]:
    """pip's configuration files in the order pip reads them (later ones win)."""
    if os.environ.get("PIP_CONFIG_FILE") == os.devnull:
        return []
    xdg_dirs = os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(os.pathsep)
    files = [Path(d) / "pip" / "pip.conf" for d in xdg_dirs] + [Path("/etc/pip.conf")]
    home = Path.home()
    files += [home / ".pip" / "pip.conf", Path(os.environ.get("XDG_CONFIG_HOME", home / ".config")) / "pip" / "pip.conf"]
    files.append(Path(sys.prefix) / "pip.conf")
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(Path(os.environ["PIP_CONFIG_FILE"]))
    return [f for f in files if f.is_file()]


def _local_path(location: str) -> Path | None:
    if location.startswith("file:"):
        return Path(unquote(urlparse(location).path))
    if "://" in location:
        return None
    return Path(location).expanduser()


def pip_locations() -> PipLocations:
    """find-links directories, file:// indexes and the cache directory pip is configured with."""
    values: dict[str, list[str]] = {"find-links": [], "index-url": [], "extra-index-url": [], "cache-dir": []}
    for path in _pip_config_files():
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
        except configparser.Error:
            continue
        for section in ("global", "install", "download"):
            for key in values:
                if parser.has_option(section, key):
                    values[key] = parser.get(section, key).split()
    for key in values:
        env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if env:
            values[key] = env.split()
    locations = PipLocations()
    for entry in values["find-links"]:
        path = _local_path(entry)
        if path is not None and path.is_dir():
            locations.find_links.append(path)
    for entry in values["index-url"] + values["extra-index-url"]:
        path = _local_path(entry) if entry.startswith("file:") else None
        if path is not None and path.is_dir():
            locations.file_indexes.append(path)
    no_cache = os.environ.get("PIP_NO_CACHE_DIR", "").lower() in ("1", "true", "yes", "on")
    if not no_cache:
        cache = values["cache-dir"][0] if values["cache-dir"] else None
        default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pip"
        locations.cache_dir = Path(cache).expanduser() if cache else default
    return locations


class ArchiveMemo(JsonMemo):
    """(path, size, mtime) -> the wheel's facts and sha256, kept as JSON in the environment cache."""

    def facts(self, file: Path) -> dict | None:
        """{'wheel': WheelFacts fields, 'sha256'} of a wheel file, or None if it is not a readable wheel."""
        try:
            st = file.stat()
        except OSError:
            return None
        key = f"{file.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        if key not in self.entries:
            try:
                wheel = read_wheel(file)
            except (OSError, zipfile.BadZipFile, KeyError, ValueError) as exc:  # not a candidate, then
                self.remember(key, {"error": f"{type(exc).__name__}: {exc}"})
            else:
                self.remember(key, {"wheel": asdict(wheel), "sha256": sha256_file(file)})
        entry = self.entries[key]
        return None if "error" in entry else entry


def _same_release(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def _wheel_name_matches(filename: str, dist: InstalledDist) -> bool:
    try:
        name, version, _build, _tags = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return False
    return name == dist.name and _same_release(str(version), dist.version)


def _index_links(index_dir: Path, project: str) -> list[tuple[str, Path]]:
    """(file name, local path) of every file:// link on a simple-API project page."""
    page = index_dir / project / "index.html"
    if not page.is_file():
        page = index_dir / project
        if not page.is_file():
            return []
    base = page.resolve().as_uri()
    links = []
    for href in _HREF.findall(page.read_text(encoding="utf-8", errors="replace")):
        url = urljoin(base, href).split("#", 1)[0]
        if url.startswith("file:"):
            path = Path(unquote(urlparse(url).path))
            links.append((path.name, path))
    return links


class ArchiveFinder:
    """Finds, for an installed distribution, a local archive whose content is exactly what is installed."""

    def __init__(self, locations: PipLocations | None = None, extra_dirs: Iterable[tuple[str, Path]] = (),
                 memo: ArchiveMemo | None = None):
        self.locations = locations if locations is not None else pip_locations()
        self.extra_dirs = [(label, Path(d)) for label, d in extra_dirs]
        self.memo = memo if memo is not None else ArchiveMemo(env_cache_root() / "archives.json")
        self._cache_bodies: list[Path] | None = None

    def _candidates(self, dist: InstalledDist) -> Iterable[tuple[str, Path]]:
        dirs = self.extra_dirs + [(f"find-links {d}", d) for d in self.locations.find_links]
        for label, directory in dirs:
            try:
                names = os.listdir(directory)
            except OSError:
                continue
            for name in sorted(names):
                if name.endswith(".whl") and _wheel_name_matches(name, dist):
                    yield label, directory / name
        for index in self.locations.file_indexes:
            for name, path in _index_links(index, dist.name):
                if name.endswith(".whl") and _wheel_name_matches(name, dist):
                    yield f"index {index.as_uri()}", path
        for body in self._pip_cache_bodies():
            yield "pip cache", body

    def _pip_cache_bodies(self) -> list[Path]:
        """Response bodies in pip's http-v2 cache that are zip files (wheels, maybe)."""
        if self._cache_bodies is None:
            self._cache_bodies = []
            cache = self.locations.cache_dir
            root = cache / "http-v2" if cache is not None else None
            if root is not None and root.is_dir():
                for body in sorted(root.rglob("*.body")):
                    try:
                        with open(body, "rb") as f:
                            if f.read(4) == b"PK\x03\x04":
                                self._cache_bodies.append(body)
                    except OSError:
                        continue
        return self._cache_bodies

    def find(self, dist: InstalledDist) -> ArchiveMatch | None:
        """A proven archive for `dist`, or None when none is at hand."""
        from_url = _from_direct_url(dist)
        if from_url is not None:
            return from_url
        if dist.content_sha256 is None:
            return None  # nothing to prove a candidate against
        expected = dist.wheel_filename()
        for label, path in self._candidates(dist):
            facts = self.memo.facts(path)
            if facts is None:
                continue
            wheel = WheelFacts(**{**facts["wheel"], "tags": tuple(facts["wheel"]["tags"])})
            if wheel.name != dist.name or not _same_release(wheel.version, dist.version):
                continue
            if wheel.content_sha256 != dist.content_sha256:
                continue
            filename = path.name if path.suffix == ".whl" else (expected or path.name)
            return ArchiveMatch(filename=filename, sha256=facts["sha256"], source=label, path=str(path))
        return None


def _from_direct_url(dist: InstalledDist) -> ArchiveMatch | None:
    """PEP 610: an archive installed by URL or path records its hash."""
    info = (dist.direct_url or {}).get("archive_info")
    if not isinstance(info, dict):
        return None
    digest = (info.get("hashes") or {}).get("sha256")
    if digest is None and str(info.get("hash", "")).startswith("sha256="):
        digest = info["hash"].split("=", 1)[1]
    if not digest:
        return None
    url = dist.direct_url.get("url", "")
    name = Path(unquote(urlparse(url).path)).name
    local = _local_path(url)
    return ArchiveMatch(filename=name, sha256=digest, source="direct_url",
                        path=str(local) if local is not None and local.is_file() else None)

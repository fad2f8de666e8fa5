"""A demand's job: the spec the tenant wants run, the data it carries, and where its results go.

The market carries the job; it does not interpret it. The spec is checked only as what the market
can promise about it: text within a size limit that parses as a YAML mapping. Whether it is a valid
runyard job spec is the provider's question (its agent loads it with `runyard.spec.job.load_spec` and
rejects the lease, returning the escrow, when it is not) -- so the market needs none of the
training stack and never refuses a spec written for a newer runyard than its own.

The data a lease's job may read is only what the demand carries (a provider runs the job in a
sandbox that shows it nothing else, see `runyard.control.sandbox`):

- `files`: relative path -> base64 content, uploaded with the demand, at most MAX_JOB_FILES files
  and MAX_JOB_FILES_BYTES decoded bytes in all. The spec names them by those relative paths.
- `data_urls`: http(s) URLs the provider fetches for the job before it starts (the job itself has
  no network). The spec names them by the exact URL.

`env_lock` (optional): the run's environment lock (`runyard.reproduce.lock`: env/requirements.txt
and env/environment.json, at most MAX_ENV_LOCK_BYTES in all). The provider's agent builds the job's
environment from it (cached by the lock's hash) and runs the job inside it, so the job runs with the
tenant's versions, not whatever the provider has; the delivery then carries the reproduction inputs.

`init_export` (optional): the export the job starts from (its spec's `model.init: {from: export}`),
carried as a standing demand's deployment carries its export: `export_files` uploaded (base64, bounded
like `files`) and `export_urls` the provider fetches into it. The provider's agent lays it out in the
lease's folder and points the spec's `model.init.path` there (`runyard.control.lease_job`), so a job can
continue a tenant's model without the provider having it.

`results_to` is a string: an absolute local path (where provider and tenant share a filesystem) or
a URL (`file://`, or a scheme the provider supports, such as a signed upload URL).

Only the lease's two parties see the job (see `leases.list_leases`); the provider's signature on
the lease terms covers `job_sha256` (spec, results_to, files, data_urls, env_lock and init_export), so an
accepted lease binds the provider to exactly this job, this data and these starting weights.

Stored with the demand as three columns (JOB_COLUMNS): the spec, results_to, and `job_inputs`, the
JSON of files, data_urls, env_lock and init_export (null when the job carries none).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import yaml

MAX_SPEC_BYTES = 32 * 1024
MAX_RESULTS_TO = 1000
MAX_JOB_FILES = 64
MAX_JOB_FILES_BYTES = 256 * 1024  # decoded; larger data goes by data_urls
MAX_FILE_PATH = 200
MAX_DATA_URLS = 16
MAX_DATA_URL = 2000
MAX_ENV_LOCK_BYTES = 256 * 1024
MAX_EXPORT_URLS = 64
# A demand's body carries the files and an init export's files base64-encoded (4/3 of their size)
# beside the spec and the lock.
MAX_DEMAND_BODY_BYTES = 2 * 1024 * 1024
JOB_COLUMNS = ("job_spec", "job_results_to", "job_inputs")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://\S+$")
_PATH_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")


def check_spec_text(text: str) -> str:
    """The spec text itself if it is at most MAX_SPEC_BYTES of UTF-8 and a YAML mapping; else ValueError."""
    size = len(text.encode("utf-8"))
    if size > MAX_SPEC_BYTES:
        raise ValueError(f"job.spec is {size} bytes; at most {MAX_SPEC_BYTES} are accepted")
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ValueError(f"job.spec is not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise ValueError("job.spec nests too deeply to be a job spec") from None
    if not isinstance(loaded, dict) or not loaded:
        raise ValueError(f"job.spec must be a YAML mapping (a job spec), not {type(loaded).__name__}")
    return text


def check_results_to(value: str) -> str:
    """An absolute path (no '..' parts) or a URL with a scheme; else ValueError."""
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError("job.results_to contains control characters")
    if _URL.match(value):
        return value
    if not value.startswith("/"):
        raise ValueError(f"job.results_to must be an absolute path or a URL, not {value[:100]!r}")
    if ".." in value.split("/"):
        raise ValueError("job.results_to must not contain '..' parts")
    return value


def check_file_path(path: str) -> str:
    """A relative POSIX path of plain names (letters, digits, '_', '.', '+', '-'; no '..', no
    hidden or empty parts) of at most MAX_FILE_PATH characters; else ValueError."""
    if not isinstance(path, str) or not path or len(path) > MAX_FILE_PATH:
        raise ValueError(f"job.files: a path is 1-{MAX_FILE_PATH} characters, got {str(path)[:100]!r}")
    if not all(_PATH_PART.match(part) for part in path.split("/")):
        raise ValueError(f"job.files: {path[:100]!r} must be a relative path of plain names "
                         "(letters, digits, '_', '.', '+', '-'; no leading '/' or '.', no '..')")
    return path


def decode_files(files: dict[str, str]) -> dict[str, bytes]:
    """The uploaded files decoded, after checking every path, the count and the total size; else ValueError."""
    if not isinstance(files, dict):
        raise ValueError("job.files must be an object of relative path -> base64 content")
    if len(files) > MAX_JOB_FILES:
        raise ValueError(f"job.files has {len(files)} files; at most {MAX_JOB_FILES} are accepted")
    decoded: dict[str, bytes] = {}
    total = 0
    for path, content in sorted(files.items()):
        check_file_path(path)
        if not isinstance(content, str):
            raise ValueError(f"job.files[{path!r}] must be base64 text")
        try:
            data = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"job.files[{path!r}] is not valid base64") from None
        total += len(data)
        if total > MAX_JOB_FILES_BYTES:
            raise ValueError(f"job.files hold more than {MAX_JOB_FILES_BYTES} bytes; send larger data "
                             "as data_urls")
        decoded[path] = data
    paths = set(decoded)
    for path in paths:  # "a" and "a/b" cannot both be files
        parts = path.split("/")
        clash = next(("/".join(parts[:i]) for i in range(1, len(parts)) if "/".join(parts[:i]) in paths), None)
        if clash is not None:
            raise ValueError(f"job.files: {clash!r} is a file, so {path!r} cannot be inside it")
    return decoded


def encode_files(named: dict[str, bytes]) -> dict[str, str]:
    """`files` for a job from relative path -> content, checked as the market will check them."""
    files = {path: base64.b64encode(data).decode("ascii") for path, data in named.items()}
    decode_files(files)
    return files


def check_data_url(url: str) -> str:
    """An http(s) URL without credentials or control characters, at most MAX_DATA_URL long; else ValueError."""
    if not isinstance(url, str) or not url or len(url) > MAX_DATA_URL:
        raise ValueError(f"job.data_urls: a URL is 1-{MAX_DATA_URL} characters")
    if any(ord(c) <= 32 or ord(c) == 127 for c in url):
        raise ValueError(f"job.data_urls: {url[:100]!r} contains spaces or control characters")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        raise ValueError(f"job.data_urls: {url[:100]!r} must be an http:// or https:// URL")
    host = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    if not host or "@" in host:
        raise ValueError(f"job.data_urls: {url[:100]!r} must name a host and carry no credentials")
    return url


def check_data_urls(urls: list[str]) -> list[str]:
    """At most MAX_DATA_URLS distinct http(s) URLs (see check_data_url); else ValueError."""
    if not isinstance(urls, list):
        raise ValueError("job.data_urls must be a list of URLs")
    if len(urls) > MAX_DATA_URLS:
        raise ValueError(f"job.data_urls has {len(urls)} URLs; at most {MAX_DATA_URLS} are accepted")
    for url in urls:
        check_data_url(url)
    if len(set(urls)) != len(urls):
        raise ValueError("job.data_urls names a URL twice")
    return urls


def check_env_lock(lock: Any) -> dict[str, str]:
    """{"requirements": text, "environment": JSON text} within MAX_ENV_LOCK_BYTES, the environment a JSON
    object; else ValueError. (Whether the lock can be installed is the provider's question.)"""
    if not isinstance(lock, dict) or set(lock) != {"requirements", "environment"}:
        raise ValueError("job.env_lock must be {'requirements': text, 'environment': JSON text}")
    if not all(isinstance(v, str) for v in lock.values()):
        raise ValueError("job.env_lock's requirements and environment are text")
    size = sum(len(v.encode("utf-8")) for v in lock.values())
    if size > MAX_ENV_LOCK_BYTES:
        raise ValueError(f"job.env_lock is {size} bytes; at most {MAX_ENV_LOCK_BYTES} are accepted")
    try:
        facts = json.loads(lock["environment"])
    except ValueError:
        raise ValueError("job.env_lock.environment is not JSON (env/environment.json)") from None
    if not isinstance(facts, dict):
        raise ValueError("job.env_lock.environment must be a JSON object (env/environment.json)")
    return lock


def check_export_files(files: dict[str, str], urls: dict[str, str], where: str) -> dict[str, bytes]:
    """An export's uploaded files decoded, after checking them and its URLs: well formed, bounded, each
    path named once and none inside another; else ValueError naming `where` (the field)."""
    decoded = decode_files(files)
    if not isinstance(urls, dict):
        raise ValueError(f"{where}.export_urls must be an object of relative path -> http(s) URL")
    if len(urls) > MAX_EXPORT_URLS:
        raise ValueError(f"{where}.export_urls has {len(urls)} entries; at most {MAX_EXPORT_URLS}")
    for path, url in urls.items():
        check_file_path(path)
        check_data_url(url)
    both = set(files) & set(urls)
    if both:
        raise ValueError(f"{where}: {sorted(both)[:5]} given both as a file and as a URL")
    if not files and not urls:
        raise ValueError(f"{where}: the export has no files (give export_files or export_urls)")
    if len(set(urls.values())) != len(urls):
        raise ValueError(f"{where}.export_urls names a URL twice")
    paths = set(files) | set(urls)
    for path in paths:
        parts = path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in paths:
                raise ValueError(f"{where}: {'/'.join(parts[:i])!r} is a file, so {path!r} cannot be inside it")
    return decoded


def check_init_export(init: Any) -> dict[str, Any]:
    """A job's `init_export`: {"export_files": {path: base64}, "export_urls": {path: URL}} checked as a
    deployment's export is (check_export_files); else ValueError."""
    if not isinstance(init, dict) or not set(init) <= {"export_files", "export_urls"}:
        raise ValueError("job.init_export must be {'export_files': {path: base64}, 'export_urls': {path: URL}}")
    check_export_files(init.get("export_files") or {}, init.get("export_urls") or {}, "job.init_export")
    return init


def init_export_body(export: Path | None, urls: dict[str, str] | None = None) -> dict[str, Any]:
    """A job's `init_export` from an export directory (its files uploaded, except those the provider
    fetches from `urls`: relative path -> URL), checked as the market will check it; else ValueError."""
    urls = dict(urls or {})
    named = {}
    if export is not None:
        named = {p.relative_to(export).as_posix(): p.read_bytes() for p in sorted(Path(export).rglob("*"))
                 if p.is_file() and p.relative_to(export).as_posix() not in urls}
    init = {k: v for k, v in (("export_files", encode_files(named)), ("export_urls", urls)) if v}
    return check_init_export(init)


def _nonempty(init: dict | None) -> dict | None:
    """An init export as stored and digested: only its non-empty parts (None when it has none)."""
    return {k: v for k, v in init.items() if v} or None if init else None


def job_columns(job: Any) -> dict[str, Any]:
    """The demand row's job columns for a checked job (a JobIn or a dict), or all None without one."""
    if job is None:
        return dict.fromkeys(JOB_COLUMNS)
    get = job.get if isinstance(job, dict) else lambda k, d=None: getattr(job, k, d)
    files, urls, lock, init = get("files") or {}, get("data_urls") or [], get("env_lock"), get("init_export")
    if lock is not None and not isinstance(lock, dict):
        lock = lock.model_dump()
    if init is not None and not isinstance(init, dict):
        init = init.model_dump()
    init = _nonempty(init)
    inputs = {k: v for k, v in (("files", files), ("data_urls", urls), ("env_lock", lock), ("init_export", init))
              if v}
    return {"job_spec": get("spec"), "job_results_to": get("results_to"),
            "job_inputs": json.dumps(inputs, sort_keys=True) if inputs else None}


def job_of(row) -> dict | None:  # type: ignore[no-untyped-def]
    """The job stored with a demand row (JOB_COLUMNS), or None. `files` and `data_urls` appear only
    when the job carries them."""
    if row.get("job_spec") is None:
        return None
    job = {"spec": row["job_spec"], "results_to": row["job_results_to"]}
    if row.get("job_inputs"):
        job.update(json.loads(row["job_inputs"]))
    return job


def job_sha256(job: dict | None) -> str | None:
    """Digest of a job (spec text, results_to, and its files, data_urls, env_lock and init_export when
    it carries any), signed with the lease terms; None without one. Empty files or data_urls digest as
    absent, so the digests of jobs without them are what they were before these fields existed."""
    if job is None:
        return None
    body: dict[str, Any] = {"spec": job["spec"], "results_to": job["results_to"]}
    if job.get("files"):
        body["files"] = job["files"]
    if job.get("data_urls"):
        body["data_urls"] = job["data_urls"]
    if job.get("env_lock"):
        body["env_lock"] = job["env_lock"]
    if _nonempty(job.get("init_export")):
        body["init_export"] = _nonempty(job["init_export"])
    canonical = json.dumps(body, sort_keys=True)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()

"""A demand's job: the spec the tenant wants run and where its results should go.

The market carries the job; it does not interpret it. The spec is checked only as what the market
can promise about it: text within a size limit that parses as a YAML mapping. Whether it is a valid
runyard job spec is the provider's question (its agent loads it with `runyard.spec.load_spec` and
rejects the lease, returning the escrow, when it is not) -- so the market needs none of the
training stack and never refuses a spec written for a newer runyard than its own.

`results_to` is a string: an absolute local path (where provider and tenant share a filesystem) or
a URL (`file://`, or a scheme the provider supports, such as a signed upload URL).

Only the lease's two parties see the job (see `leases.list_leases`); the provider's signature on
the lease terms covers `job_sha256`, so an accepted lease binds the provider to exactly this job.
"""

from __future__ import annotations

import hashlib
import json
import re

import yaml

MAX_SPEC_BYTES = 32 * 1024
MAX_RESULTS_TO = 1000
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://\S+$")


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


def job_of(row) -> dict | None:  # type: ignore[no-untyped-def]
    """The job stored with a demand row (columns job_spec, job_results_to), or None."""
    if row.get("job_spec") is None:
        return None
    return {"spec": row["job_spec"], "results_to": row["job_results_to"]}


def job_sha256(job: dict | None) -> str | None:
    """Digest of a job (spec text and results_to), signed with the lease terms; None without one."""
    if job is None:
        return None
    canonical = json.dumps({"spec": job["spec"], "results_to": job["results_to"]}, sort_keys=True)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()

"""`runyard market demand`: a demand built from flags and files.

The requirement comes from flags or a file (a requirement, or a job spec's resources.requirement).
A block demand may carry a job: its spec, data files, data URLs, environment lock (a run's env/
directory) and the export it starts from (uploaded, or fetched by the provider from URLs), read here. A standing demand (`--form standing`) states its period and term and may
carry a deployment: an export directory (uploaded), export files the provider fetches by URL, the
`runyard serve` options, and a fresh endpoint token, written to a 0600 file (the market sees only its
digest, and the provider's endpoint admits only this token).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import yaml

from runyard.cli.market_common import client_for, print_json, timestamp
from runyard.cli.readers import export_dir_of
from runyard.errors import RunyardError
from runyard.market.jobs import (
    MAX_SPEC_BYTES,
    check_data_urls,
    check_env_lock,
    encode_files,
    init_export_body,
)
from runyard.market.operations import Operation
from runyard.market.requirement import Requirement
from runyard.market.serving import deployment_body
from runyard.system.files import atomic_write_text


def demand_args(parser: argparse.ArgumentParser, op: Operation) -> Callable[[argparse.Namespace], int]:
    parser.add_argument(
        "--idempotency-key", help="reuse a key to retry a request safely (default: a fresh key)"
    )
    parser.add_argument(
        "--requirement",
        type=Path,
        help="YAML/JSON file: a requirement, or a job spec (its resources.requirement)",
    )
    parser.add_argument("--kinds", help="acceptable accelerator kinds, comma-separated")
    parser.add_argument("--devices", type=int, help="devices in total")
    parser.add_argument("--duration-s", type=int, help="seconds needed")
    parser.add_argument("--regions", help="allowed regions or jurisdictions, comma-separated")
    parser.add_argument("--latest-start", type=timestamp, help="latest acceptable start (Unix s or ISO)")
    parser.add_argument("--start-classes", help="accepted start classes, e.g. immediate,queued")
    parser.add_argument("--min-interconnect", help="ethernet, infiniband or nvlink")
    parser.add_argument(
        "--max-price", type=int, required=True, help="maximum price per device-hour (minor units)"
    )
    parser.add_argument("--job-spec", type=Path, metavar="FILE", help="job spec (YAML) to run on the lease")
    parser.add_argument(
        "--results-to",
        metavar="PATH",
        help="where the provider delivers the results (required with --job-spec)",
    )
    parser.add_argument(
        "--job-file",
        action="append",
        default=[],
        metavar="[NAME=]FILE",
        help="a data file uploaded with the job (repeatable; at most 256 KiB in all); the spec names it "
        "by NAME (default: the file's name), a relative path",
    )
    parser.add_argument(
        "--data-url",
        action="append",
        default=[],
        metavar="URL",
        help="an http(s) URL the provider fetches for the job before it starts (repeatable); the spec "
        "names it as a data source by this exact URL",
    )
    parser.add_argument("--env-lock", type=Path, metavar="DIR",
                        help="a run's env/ directory (requirements.txt, environment.json): the provider builds "
                        "the job's environment from this lock and runs the job in it")
    parser.add_argument("--init-export", type=Path, metavar="DIR",
                        help="the export the job starts from (a run directory or its export/), uploaded with the job "
                        "(at most 256 KiB; larger files by --init-export-url): the provider points the spec's "
                        "model.init.path at its copy")
    parser.add_argument("--init-export-url", action="append", default=[], metavar="PATH=URL",
                        help="a file of the job's init export the provider fetches instead of receiving it (repeatable)")
    s = parser.add_argument_group("standing demands (serving capacity billed per period)")
    s.add_argument("--form", choices=["block", "standing"], default="block",
                   help="block: devices for a window (default); standing: a shape available continuously")
    s.add_argument("--period-s", type=int, help="billing period in seconds (standing; matched exactly)")
    s.add_argument("--term-periods", type=int, default=1, help="periods committed to, escrowed up front (default 1)")
    s.add_argument("--min-memory-gib", type=int, default=0, help="least memory per device, GiB")
    s.add_argument("--min-availability-bps", type=int, default=0,
                   help="least availability a listing must commit to, basis points (9950 = 99.5%%)")
    s.add_argument("--deploy", type=Path, metavar="DIR",
                   help="serve this export (a run directory or its export/) on the lease: its files are "
                   "uploaded with the demand (at most 256 KiB; larger ones by --export-url)")
    s.add_argument("--export-url", action="append", default=[], metavar="PATH=URL",
                   help="an export file the provider fetches instead of receiving it (repeatable)")
    s.add_argument("--serve-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a runyard serve option for the deployment: model_name, max_batch, max_queue, "
                   "kv_cache_mb, max_prefill_tokens (repeatable)")
    s.add_argument("--token-file", type=Path, metavar="FILE",
                   help="where the deployment's endpoint token is written (0600; it must not exist): the "
                   "market sees only its digest, and the endpoint admits only this token")

    def handler(args: argparse.Namespace) -> int:
        client = client_for(args)
        standing, deployment, token = _standing(args)
        placed = client.place_demand(_requirement(args), args.max_price, args.idempotency_key, job=_job(args),
                                     form=args.form, standing=standing, deployment=deployment)
        if token is not None:
            atomic_write_text(args.token_file, token + "\n", mode=0o600)
            placed["token_file"] = str(args.token_file)
        print_json(placed)
        return 0

    return handler


def _standing(args: argparse.Namespace) -> tuple[dict | None, dict | None, str | None]:
    """A standing demand's terms and deployment from the flags, and the endpoint token (not yet written)."""
    wants_deployment = args.deploy is not None or args.export_url
    if args.form != "standing":
        if args.period_s is not None or wants_deployment:
            raise RunyardError("--period-s, --deploy and --export-url are for a standing demand: add --form standing")
        return None, None, None
    if args.period_s is None:
        raise RunyardError("a standing demand needs --period-s (its billing period)")
    standing = {"period_s": args.period_s, "term_periods": args.term_periods, "min_memory_gib": args.min_memory_gib,
                "min_availability_bps": args.min_availability_bps}
    if not wants_deployment:
        return standing, None, None
    if args.token_file is None or args.token_file.exists():
        raise RunyardError("a deployment needs --token-file FILE, a file that does not exist yet: its endpoint "
                           "token is written there")
    urls = dict(_pair(item, "--export-url") for item in args.export_url)
    files = {}
    if args.deploy is not None:
        export = export_dir_of(args.deploy)
        named = {p.relative_to(export).as_posix(): p.read_bytes() for p in sorted(export.rglob("*"))
                 if p.is_file() and p.relative_to(export).as_posix() not in urls}
        try:
            files = encode_files(named)
        except ValueError as exc:
            raise RunyardError(f"--deploy {export}: {exc}; give large files with --export-url PATH=URL") from exc
    options = {}
    for item in args.serve_option:
        key, value = _pair(item, "--serve-option")
        options[key] = value if key == "model_name" else int(value) if value.isdigit() else value
    try:
        body, token = deployment_body(files=files, urls=urls, serve=options)
    except ValueError as exc:
        raise RunyardError(f"invalid deployment: {exc}") from exc
    return standing, body, token


def _pair(item: str, flag: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key or not value:
        raise RunyardError(f"{flag} {item!r}: expected KEY=VALUE")
    return key, value


def _requirement(args: argparse.Namespace) -> dict:
    data: dict = {}
    if args.requirement:
        loaded = yaml.safe_load(args.requirement.read_text()) or {}
        if not isinstance(loaded, dict):
            raise RunyardError(f"{args.requirement}: expected a mapping")
        data = (
            dict((loaded.get("resources") or {}).get("requirement") or {})
            if "resources" in loaded
            else loaded
        )
    for key, value in (
        ("accelerator_kinds", args.kinds and args.kinds.split(",")),
        ("device_count", args.devices),
        ("duration_s", args.duration_s),
        ("allowed_regions", args.regions and args.regions.split(",")),
        ("start_classes", args.start_classes and args.start_classes.split(",")),
        ("min_interconnect", args.min_interconnect),
        ("latest_start", args.latest_start),
    ):
        if value is not None:
            data[key] = value
    if args.form == "standing" and args.period_s is not None:
        data.setdefault("duration_s", args.period_s * args.term_periods)  # a standing demand's span is its term
    try:
        return Requirement.model_validate(data).model_dump(mode="json")
    except ValueError as exc:
        raise RunyardError(f"invalid requirement: {exc}") from exc


def read_env_lock(folder: Path) -> dict[str, str]:
    """A run's lock (its env/ directory, or the run directory holding it) as a job carries it."""
    folder = folder / "env" if (folder / "env").is_dir() else folder
    try:
        lock = {"requirements": (folder / "requirements.txt").read_text(encoding="utf-8"),
                "environment": (folder / "environment.json").read_text(encoding="utf-8")}
        return check_env_lock(lock)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise RunyardError(f"--env-lock {folder}: {exc}") from exc


def _job(args: argparse.Namespace) -> dict | None:
    """The demand's job from --job-spec, --results-to, --job-file and --data-url (a local path is
    made absolute)."""
    if args.job_spec is None and args.results_to is None:
        if args.job_file or args.data_url or args.env_lock or args.init_export or args.init_export_url:
            raise RunyardError("--job-file, --data-url, --env-lock and --init-export belong to a job: give --job-spec "
                               "and --results-to")
        return None
    if args.job_spec is None or args.results_to is None:
        raise RunyardError("--job-spec and --results-to go together: a job needs both")
    try:
        size = args.job_spec.stat().st_size
        if size > MAX_SPEC_BYTES:
            raise RunyardError(
                f"{args.job_spec}: {size} bytes; a demand's job spec is at most {MAX_SPEC_BYTES}"
            )
        spec = args.job_spec.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RunyardError(f"cannot read --job-spec {args.job_spec}: {exc}") from exc
    results_to = args.results_to
    if "://" not in results_to:
        results_to = str(Path(results_to).expanduser().resolve())
    job: dict = {"spec": spec, "results_to": results_to}
    if args.env_lock is not None:
        job["env_lock"] = read_env_lock(args.env_lock)
    try:
        named = {}
        for item in args.job_file:
            name, sep, path = item.partition("=")
            path = Path(path if sep else name)
            named[name if sep else path.name] = path.read_bytes()
        if named:
            job["files"] = encode_files(named)
        if args.data_url:
            job["data_urls"] = check_data_urls(args.data_url)
    except (OSError, ValueError) as exc:
        raise RunyardError(f"--job-file/--data-url: {exc}") from exc
    if args.init_export is not None or args.init_export_url:
        job["init_export"] = read_init_export(args.init_export, dict(_pair(i, "--init-export-url")
                                                                      for i in args.init_export_url))
    return job


def read_init_export(export: Path | None, urls: dict[str, str] | None = None) -> dict:
    """A job's init export from --init-export (a run directory or its export/) and --init-export-url."""
    try:
        return init_export_body(export_dir_of(export) if export is not None else None, urls)
    except (OSError, ValueError) as exc:
        raise RunyardError(f"--init-export {export}: {exc}; give large files with --init-export-url PATH=URL") from exc

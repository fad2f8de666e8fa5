"""Trading verbs of `runyard market`: one per market operation that names a `cli` verb in
`runyard.market.operations`, sent over HTTP through `MarketClient` as the account in an identity
file (token and Ed25519 private key, written by `register`).

A verb's arguments come from the client method of the same name: path parameters are positional,
every other parameter is an option (`--kebab-case`), required when the method has no default.
Two verbs take more than their fields: `register` (makes a key pair and saves the identity file)
and `demand` (builds the requirement from flags or a file, and reads the job spec from a file).
"""

from __future__ import annotations

import argparse
import enum
import inspect
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from runyard.cli.market_common import print_json, timestamp
from runyard.errors import RunyardError
from runyard.market.client import MarketClient
from runyard.market.jobs import MAX_SPEC_BYTES, check_data_urls, encode_files
from runyard.market.operations import OPERATIONS, Operation
from runyard.market.requirement import Requirement

DEFAULT_IDENTITY = os.environ.get("RUNYARD_MARKET_IDENTITY", str(Path.home() / ".runyard" / "market.json"))
DEFAULT_URL = os.environ.get("RUNYARD_MARKET_URL")
TIME_SUFFIXES = ("_start", "_end", "_from", "_until")


def client_for(args: argparse.Namespace) -> MarketClient:
    """The client acting as the saved identity (or anonymous, with --url, when there is none)."""
    path = Path(args.identity)
    if path.exists():
        return MarketClient.from_identity_file(path, base_url=args.url)
    if args.url and not getattr(args, "needs_identity", True):
        return MarketClient(args.url)
    raise RunyardError(
        f"no market identity at {path}; run `runyard market register` first (or pass --identity)"
    )


def _identity_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--identity",
        default=DEFAULT_IDENTITY,
        help="file with this account's token and private key (env RUNYARD_MARKET_IDENTITY; default %(default)s)",
    )
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        help="market URL (env RUNYARD_MARKET_URL; default: the one in the identity)",
    )


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the type inside Optional[...], whether None is allowed)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else annotation), True
    return annotation, False


def _option(
    parser: argparse.ArgumentParser, name: str, annotation: Any, default: Any, help_text: str
) -> None:
    flag = "--" + name.replace("_", "-")
    inner, _ = _unwrap(annotation)
    required = default is inspect.Parameter.empty
    kwargs: dict[str, Any] = {"dest": name, "help": help_text}
    if not required:
        kwargs["default"] = default.value if isinstance(default, enum.Enum) else default
    if inner is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, required=required, **kwargs)
        return
    if typing.get_origin(inner) is typing.Literal:
        kwargs["choices"] = list(typing.get_args(inner))
    elif isinstance(inner, type) and issubclass(inner, enum.Enum):
        kwargs["choices"] = [e.value for e in inner]
    elif inner is int:
        kwargs["type"] = timestamp if name.endswith(TIME_SUFFIXES) else int
        if name.endswith(TIME_SUFFIXES):
            kwargs["help"] += " (Unix seconds or ISO 8601)"
    elif _structured(inner):
        kwargs["type"] = structured_value
        kwargs["metavar"] = "JSON|@FILE"
        kwargs["help"] += " (JSON or YAML text, or @FILE)"
    elif inner is not str:
        raise TypeError(f"no command-line form for {name}: {annotation!r}")
    parser.add_argument(flag, required=required, **kwargs)


def _structured(annotation: Any) -> bool:
    """A nested object or list (a pydantic model, dict or list) rather than one plain value."""
    if typing.get_origin(annotation) in (list, dict):
        return True
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def structured_value(text: str) -> Any:
    """The value of an option that takes an object or a list: JSON or YAML text, or @FILE holding it."""
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read {text[1:]}: {exc}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise argparse.ArgumentTypeError(f"not JSON or YAML: {exc}") from exc


def _describe(op: Operation, name: str) -> str:
    field = op.body.model_fields.get(name) if op.body is not None else None
    if field is not None and field.description:
        return field.description
    if name in op.query:
        return op.query[name].description
    return name.replace("_", " ")


def _generic(parser: argparse.ArgumentParser, op: Operation) -> Callable[[argparse.Namespace], int]:
    """Add the arguments of client method `op.name` to `parser`; return the verb's handler."""
    method = getattr(MarketClient, op.name)
    signature = inspect.signature(method)
    hints = typing.get_type_hints(method) if not hasattr(method, "__signature__") else {}
    names = []
    for name, param in list(signature.parameters.items())[1:]:
        annotation = hints.get(name, param.annotation)
        if name in op.path_params:
            parser.add_argument(name, type=int if name.endswith("_id") else str, help=name.replace("_", " "))
        elif name == "idempotency_key":
            parser.add_argument(
                "--idempotency-key", help="reuse a key to retry a request safely (default: a fresh key)"
            )
        else:
            _option(parser, name, annotation, param.default, _describe(op, name))
        names.append(name)

    def handler(args: argparse.Namespace) -> int:
        print_json(getattr(client_for(args), op.name)(**{n: getattr(args, n) for n in names}))
        return 0

    return handler


# -- the two verbs that do more than send their fields ----------------------------------------------


def _register_args(parser: argparse.ArgumentParser, op: Operation) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("name", help="account name (letters, digits, . _ -)")
    parser.add_argument(
        "--role", choices=["tenant", "provider"], required=True, help="tenant buys, provider sells"
    )

    def handler(args: argparse.Namespace) -> int:
        if not args.url:
            raise RunyardError("register needs the market's --url (or RUNYARD_MARKET_URL)")
        path = Path(args.identity)
        if path.exists():
            raise RunyardError(f"{path} already holds an identity; pass another --identity")
        path.parent.mkdir(parents=True, exist_ok=True)
        with MarketClient(args.url) as client:
            result = client.register(args.name, args.role)
            client.save_identity(path)
        print_json({k: v for k, v in result.items() if k != "token"} | {"identity": str(path)})
        return 0

    return handler


def _demand_args(parser: argparse.ArgumentParser, op: Operation) -> Callable[[argparse.Namespace], int]:
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

    def handler(args: argparse.Namespace) -> int:
        client = client_for(args)
        print_json(
            client.place_demand(_requirement(args), args.max_price, args.idempotency_key, job=_job(args))
        )
        return 0

    return handler


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
    try:
        return Requirement.model_validate(data).model_dump(mode="json")
    except ValueError as exc:
        raise RunyardError(f"invalid requirement: {exc}") from exc


def _job(args: argparse.Namespace) -> dict | None:
    """The demand's job from --job-spec, --results-to, --job-file and --data-url (a local path is
    made absolute)."""
    if args.job_spec is None and args.results_to is None:
        if args.job_file or args.data_url:
            raise RunyardError("--job-file and --data-url belong to a job: give --job-spec and --results-to")
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
    return job


CUSTOM = {"register": _register_args, "place_demand": _demand_args}


def add_verbs(verbs: argparse._SubParsersAction) -> None:
    """Add one verb per operation with a `cli` name (grouped under their first word when two)."""
    groups: dict[str, argparse._SubParsersAction] = {}
    for op in OPERATIONS:
        if op.cli is None:
            continue
        if len(op.cli) == 1:
            parent = verbs
        else:
            if op.cli[0] not in groups:
                group = verbs.add_parser(op.cli[0], help=f"{op.cli[0]} actions")
                groups[op.cli[0]] = group.add_subparsers(
                    dest=f"{op.cli[0]}_verb", metavar="ACTION", required=True
                )
            parent = groups[op.cli[0]]
        parser = parent.add_parser(op.cli[-1], help=f"{op.summary} ({op.method} {op.path})")
        _identity_args(parser)
        build = CUSTOM.get(op.name, _generic)
        parser.set_defaults(handler=build(parser, op), needs_identity=op.auth != "none")

"""Trading verbs of `runyard market`: one per market operation that names a `cli` verb in
`runyard.market.operations`, sent over HTTP through `MarketClient` as the account in an identity
file (token and Ed25519 private key, written by `register`).

A verb's arguments come from the client method of the same name: path parameters are positional,
every other parameter is an option (`--kebab-case`), required when the method has no default.
Some verbs take more than their fields: `register` (makes a key pair and saves the identity file),
`demand` (cli/market_demand.py) and `deployment rollout|rollback` (cli/market_deployment.py, which
upload an export or name none).
"""

from __future__ import annotations

import argparse
import enum
import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from runyard.cli.market_common import DEFAULT_IDENTITY, DEFAULT_URL, client_for, print_json, timestamp
from runyard.cli.market_demand import demand_args
from runyard.cli.market_deployment import rollback_args, rollout_args
from runyard.errors import RunyardError
from runyard.market.client import MarketClient
from runyard.market.operations import OPERATIONS, Operation

TIME_SUFFIXES = ("_start", "_end", "_from", "_until")


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
    """The option's help, escaped for argparse (which formats it with %)."""
    field = op.body.model_fields.get(name) if op.body is not None else None
    if field is not None and field.description:
        text = field.description
    elif name in op.query:
        text = op.query[name].description
    else:
        text = name.replace("_", " ")
    return text.replace("%", "%%")


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


CUSTOM = {"register": _register_args, "place_demand": demand_args, "request_rollout": rollout_args}
# Verbs beside an operation's own: (group, verb) -> (operation, arguments builder).
EXTRA = {("deployment", "rollback"): ("request_rollout", rollback_args,
                                      "Serve the export served before the one serving now (tenant)")}


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
    for (group_name, verb), (name, build, summary) in EXTRA.items():
        op = next(o for o in OPERATIONS if o.name == name)
        parser = groups[group_name].add_parser(verb, help=f"{summary} ({op.method} {op.path})")
        _identity_args(parser)
        parser.set_defaults(handler=build(parser, op), needs_identity=True)

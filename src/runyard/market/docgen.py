"""The generated parts of docs/market-protocol.md: the operations, the error codes and the state
machines, rendered from the code so that the document cannot drift from it (a test compares).

    python -m runyard.market.docgen docs/market-protocol.md     # rewrite the generated sections
"""

from __future__ import annotations

import re
import sys
import typing
from pathlib import Path

from runyard.market import errors
from runyard.market.operations import OPERATIONS
from runyard.market.states import Machine
from runyard.market.states.demand import DEMAND
from runyard.market.states.dispute import DISPUTE
from runyard.market.states.identity import IDENTITY
from runyard.market.states.lease import LEASE
from runyard.market.states.listing import LISTING
from runyard.market.states.period import PERIOD
from runyard.market.states.record import RECORD
from runyard.market.states.rollout import ROLLOUT
from runyard.system.files import atomic_write_text

MACHINES = (IDENTITY, LISTING, DEMAND, LEASE, PERIOD, RECORD, DISPUTE, ROLLOUT)
SECTION = re.compile(r"(<!-- generated:(\w+) -->\n)(.*?)(<!-- /generated:\2 -->)", re.S)


def _name(annotation: typing.Any) -> str:
    if typing.get_origin(annotation) is list:
        return f"list of {_name(typing.get_args(annotation)[0])}"
    return getattr(annotation, "__name__", str(annotation))


def operations_table() -> str:
    rows = ["| operation | method and path | who | Idempotency-Key | body | answer |", "|---|---|---|---|---|---|"]
    who = {"none": "anyone", "account": "an account", "operator": "a verified operator", "rail": "a rail (signed)"}
    for op in OPERATIONS:
        query = "?" + "&".join(op.query) if op.query else ""
        rows.append(
            f"| `{op.name}` | `{op.method} {op.path}{query}` | {who[op.auth]} | {op.key or '-'} | "
            f"{op.body.__name__ if op.body else '-'} | {op.status} {_name(op.response)} |"
        )
    return "\n".join(rows) + "\n"


def errors_table() -> str:
    rows = ["| status | code | meaning |", "|---|---|---|"]
    found = [
        cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, errors.MarketError)
    ]
    for cls in sorted(found, key=lambda c: (c.status, c.code)):
        doc = " ".join((cls.__doc__ or "").split())
        rows.append(f"| {cls.status} | `{cls.code}` | {doc} |")
    rows.append("| 500 | `internal` | A bug; nothing was applied. |")
    return "\n".join(rows) + "\n"


def machine_table(machine: Machine) -> str:
    terminal = ", ".join(f"`{s}`" for s in sorted(machine.terminal)) or "none"
    rows = [f"`{machine.entity}`: starts `{machine.initial}`; terminal: {terminal}", "",
            "| from | to | who may |", "|---|---|---|"]  # fmt: skip
    for (a, b), sides in machine.table_of_transitions.items():
        rows.append(f"| `{a}` | `{b}` | {', '.join(sorted(sides))} |")
    return "\n".join(rows) + "\n"


def sections() -> dict[str, str]:
    return {
        "operations": operations_table(),
        "errors": errors_table(),
        "states": "\n".join(machine_table(m) for m in MACHINES),
    }


def render(text: str) -> str:
    """`text` with every generated section replaced by what the code says now."""
    fresh = sections()
    return SECTION.sub(lambda m: m.group(1) + fresh[m.group(2)] + m.group(4), text)


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else "docs/market-protocol.md")
    atomic_write_text(path, render(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

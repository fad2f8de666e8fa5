"""Read pyproject.toml and write the floors: every runtime dependency of the base install and the role
extras pinned at its stated floor (`name>=floor` -> `name==floor`), and the market extra's requirements
alone. Usage: floor_pins.py PYPROJECT FLOORS_TXT MARKET_TXT"""

import re
import sys
import tomllib
from pathlib import Path

ROLES = ["market", "control", "serve"]
REQUIREMENT = re.compile(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*).*")

pyproject, floors_txt, market_txt = sys.argv[1:4]
project = tomllib.loads(Path(pyproject).read_text())["project"]
extras = project["optional-dependencies"]
pins: dict[str, str] = {}
for requirement in project["dependencies"] + [r for role in ROLES for r in extras[role]]:
    match = REQUIREMENT.fullmatch(requirement)
    if not match:
        sys.exit(f"{pyproject}: dependency {requirement!r} has no '>=' floor to test")
    name, floor = match.group(1).lower(), match.group(3)
    if pins.setdefault(name, floor) != floor:
        sys.exit(f"{pyproject}: {name} has two different floors ({pins[name]} and {floor})")
Path(floors_txt).write_text("".join(f"{name}=={floor}\n" for name, floor in pins.items()))
Path(market_txt).write_text("".join(f"{requirement}\n" for requirement in extras["market"]))
print("floors:", " ".join(f"{name}=={floor}" for name, floor in pins.items()))

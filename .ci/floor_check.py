"""Fail unless every pinned distribution that is installed here is at its floor.
Usage: floor_check.py FLOORS_TXT"""

import importlib.metadata
import re
import sys
from pathlib import Path


def release(version: str) -> tuple[int, ...]:
    """2.13.0+cpu -> (2, 13); 3.1 -> (3, 1): the release numbers, trailing zeros dropped."""
    numbers = [int(n) for n in re.match(r"[0-9]+(?:\.[0-9]+)*", version).group(0).split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


wrong, checked = [], 0
for line in Path(sys.argv[1]).read_text().splitlines():
    name, floor = line.strip().split("==")
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        continue
    checked += 1
    if release(installed) != release(floor):
        wrong.append(f"{name}: installed {installed}, floor {floor}")
if wrong:
    sys.exit("not at the floors: " + "; ".join(wrong))
print(f"installed at the floors ({checked} distributions)")

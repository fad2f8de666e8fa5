"""The market imports no torch (DESIGN.md): a market host needs none of the training stack."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import importlib, pkgutil, sys
import runyard.market
names = [m.name for m in pkgutil.walk_packages(runyard.market.__path__, "runyard.market.")]
for name in names + ["runyard.cli.market"]:
    if ".migrations.versions." in name or name.endswith("migrations.env"):
        continue  # run by Alembic, not importable on their own
    importlib.import_module(name)
assert len(names) > 15, names
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "tokenizers"))
print("IMPORTED", len(names), "HEAVY", heavy)
"""


def test_importing_every_market_module_loads_no_torch():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout

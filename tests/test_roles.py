"""Packaging by role, checked inside the venvs .ci/floors.sh builds (RUNYARD_ROLE names which):
`pip install runyard` is the trainer and holds no server or database stack; a market host runs the
market with no torch installed. In the development venv, where everything is installed, these skip."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import subprocess
import sys

import pytest

import runyard
from runyard.cli import VERBS

ROLE = os.environ.get("RUNYARD_ROLE")
SERVER_STACK = ["fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "psycopg", "httpx", "prometheus_client"]
TRAINING_STACK = ["torch", "tokenizers", "safetensors", "numpy", "pyarrow", "matplotlib"]


def runyard_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runyard", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(ROLE != "trainer", reason="runs in .ci/floors.sh's trainer venv (RUNYARD_ROLE=trainer)")
class TestTrainer:
    def test_no_server_or_database_library_is_installed(self):
        assert [name for name in SERVER_STACK if importlib.util.find_spec(name)] == []

    def test_every_base_verb_parses_and_the_others_name_their_extra(self):
        named = []
        for verb, (_, extra, _) in VERBS.items():
            proc = runyard_cli(verb, "--help")
            assert "Traceback" not in proc.stderr, (verb, proc.stderr)
            if extra is None:
                assert proc.returncode == 0, (verb, proc.stderr)
            elif proc.returncode != 0:  # a verb whose module needs its extra to build its parser
                assert f"pip install 'runyard[{extra}]'" in proc.stderr, (verb, proc.stderr)
                named.append(verb)
        assert {"serve", "market"} <= set(named)

    def test_a_spec_plans_without_the_server_stack(self, tmp_path):
        spec = tmp_path / "spec.yaml"
        assert runyard_cli("spec", "init", str(spec)).returncode == 0
        proc = runyard_cli("plan", str(spec))
        assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(ROLE != "market", reason="runs in .ci/floors.sh's market-host venv (RUNYARD_ROLE=market)")
class TestMarketHost:
    def test_no_training_library_is_installed(self):
        assert [name for name in TRAINING_STACK if importlib.util.find_spec(name)] == []

    def test_every_market_module_imports(self):
        market = importlib.import_module("runyard.market")
        names = [m.name for m in pkgutil.walk_packages(market.__path__, "runyard.market.")
                 if ".migrations" not in m.name]
        for name in names:
            importlib.import_module(name)
        assert "torch" not in sys.modules and len(names) > 10

    def test_the_market_verbs_parse(self):
        for args in (["market", "--help"], ["market", "serve", "--help"], ["market", "admin", "--help"]):
            proc = runyard_cli(*args)
            assert proc.returncode == 0, (args, proc.stderr)

    def test_a_training_verb_fails_clearly(self, tmp_path):
        spec = tmp_path / "spec.yaml"
        assert runyard_cli("spec", "init", str(spec)).returncode == 0
        proc = runyard_cli("train", str(spec), "--run-dir", str(tmp_path / "run"))
        assert proc.returncode != 0
        assert "is not installed: pip install 'runyard'" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_the_package_root_imports_nothing_heavy():
    # runyard/__init__.py is shared by every role: it must stay light.
    probe = "import sys, runyard; print(sorted(set(%r) & set(sys.modules)))" % (SERVER_STACK + TRAINING_STACK)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert runyard.__version__

"""The command line for real: `runyard market serve` in a subprocess, client verbs against it, and the
operator's `admin verify` and `admin audit` on the live store."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from runyard.cli.market_admin import admin_market
from runyard.errors import RunyardError
from runyard.system.http_thread import free_port
from runyard.system.processes import popen_dying_with_me


def runyard(*args: str, env: dict, check: bool = True, cwd=None) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "runyard", "market", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=cwd,
    )
    if check:
        assert out.returncode == 0, out.stderr
    return out


@pytest.mark.slow
def test_serve_register_verify_credit_audit(tmp_path):
    db, port = str(tmp_path / "market.db"), free_port()
    env = {**os.environ, "RUNYARD_MARKET_IDENTITY": str(tmp_path / "tenant.json")}
    token_file = tmp_path / "operator.token"
    server = popen_dying_with_me(
        [sys.executable, "-m", "runyard", "market", "serve", "--db", db, "--port", str(port), "--fee-bps", "150",
         "--operator-token-file", str(token_file), "--sweep-interval", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"

        registered = json.loads(
            runyard("register", "cli-lab", "--role", "tenant", "--url", url, env=env).stdout
        )
        assert registered["state"] == "unverified" and "token" not in registered
        assert oct((tmp_path / "tenant.json").stat().st_mode & 0o777) == "0o600"
        # Money comes in through a rail or an operator's credit, even before verification (it
        # cannot be spent until then).
        runyard("admin", "credit", "--account", "cli-lab", "--amount", "500", "--reason", "wire 42", "--db", db, env=env)
        runyard("verify-request", "--evidence", "company 42", env=env)
        verdict = runyard(
            "admin", "verify", "cli-lab", "--approve", "--reason", "papers fine", "--db", db, env=env
        )
        assert json.loads(verdict.stdout)["state"] == "verified"
        assert json.loads(runyard("verify-status", env=env).stdout)["state"] == "verified"
        placed = runyard("demand", "--kinds", "h100-80gb", "--devices", "2", "--duration-s", "3600",
                         "--max-price", "100", env=env)  # fmt: skip
        assert json.loads(placed.stdout)["state"] == "open"
        (tmp_path / "job.yaml").write_text("name: tiny\nseed: 3\n")
        with_job = runyard("demand", "--kinds", "h100-80gb", "--devices", "1", "--duration-s", "60",
                           "--max-price", "100", "--job-spec", str(tmp_path / "job.yaml"),
                           "--results-to", "out/tiny", env=env, cwd=tmp_path)  # fmt: skip
        assert json.loads(with_job.stdout)["job"] == {
            "spec": "name: tiny\nseed: 3\n",
            "results_to": str(tmp_path / "out" / "tiny"),  # made absolute on the tenant's side
        }
        half = runyard("demand", "--kinds", "h100-80gb", "--devices", "1", "--duration-s", "60",
                       "--max-price", "100", "--job-spec", str(tmp_path / "job.yaml"), env=env, check=False)  # fmt: skip
        assert half.returncode == 1 and "--results-to" in half.stderr
        too_much = runyard("demand", "--kinds", "h100-80gb", "--devices", "64", "--duration-s", "3600",
                           "--max-price", "100", env=env, check=False)  # fmt: skip
        assert too_much.returncode == 1 and "insufficient_funds" in too_much.stderr
        # A standing demand with a deployment: the export uploaded, the token written 0600 and never sent.
        export = tmp_path / "run" / "export"
        export.mkdir(parents=True)
        (export / "config.json").write_text("{}")
        token_file = tmp_path / "endpoint.token"
        deployed = runyard("demand", "--kinds", "l4", "--devices", "1", "--max-price", "10", "--form", "standing",
                           "--period-s", "600", "--deploy", str(tmp_path / "run"), "--serve-option", "kv_cache_mb=16",
                           "--serve-option", "model_name=mine", "--token-file", str(token_file), env=env)  # fmt: skip
        placed = json.loads(deployed.stdout)
        token = token_file.read_text().strip()
        assert oct(token_file.stat().st_mode & 0o777) == "0o600" and token not in deployed.stdout
        assert placed["deployment"]["token_sha256"] == "sha256:" + hashlib.sha256(token.encode()).hexdigest()
        assert placed["deployment"]["serve"] == {"kv_cache_mb": 16, "model_name": "mine"}
        assert placed["deployment"]["export_files"] == {"config.json": "e30="} and placed["form"] == "standing"
        again = runyard("demand", "--kinds", "l4", "--devices", "1", "--max-price", "10", "--form", "standing",
                        "--period-s", "600", "--deploy", str(export), "--token-file", str(token_file), env=env,
                        check=False)  # fmt: skip
        assert again.returncode == 1 and "does not exist yet" in again.stderr  # never overwrites a token
        mixed = runyard("demand", "--kinds", "l4", "--devices", "1", "--max-price", "10", "--period-s", "600",
                        env=env, check=False)  # fmt: skip
        assert mixed.returncode == 1 and "--form standing" in mixed.stderr
        statement = json.loads(runyard("statement", env=env).stdout)
        assert statement["totals"]["deposited"] == 500 and statement["totals"]["reconciles"]
        assert statement["market_fee_bps"] == 150
        audit = runyard("admin", "audit", "--db", db, env=env)
        assert audit.stdout.startswith("audit ok")
        bad = runyard(
            "demand", "--kinds", "h100-8gb", "--devices", "1", "--max-price", "1", env=env, check=False
        )
        assert bad.returncode == 1 and "unknown accelerator kind" in bad.stderr
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_admin_on_an_unreadable_store_is_a_clear_error(tmp_path):
    not_a_db = tmp_path / "market.db"
    not_a_db.write_text("this is not SQLite\n" * 100)
    with pytest.raises(RunyardError, match="cannot open the market store .*not a database"):
        admin_market(argparse.Namespace(db=str(not_a_db)), lambda m: None)
    with pytest.raises(RunyardError, match=r"cannot open the market store postgresql://u:\*\*\*@"):
        admin_market(argparse.Namespace(db="postgresql://u:secret@127.0.0.1:1/none"), lambda m: None)

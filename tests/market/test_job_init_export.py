"""The export a demand's job starts from (`job.init_export`), over real HTTP on both backends: stored with
the demand, shown to the lease's parties exactly, covered by the digest the provider signs, refused with a
clear 4xx (changing nothing) when it is malformed, and uploaded by `runyard market demand --init-export`."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest

from runyard.market.client import MarketClientError
from runyard.market.jobs import MAX_JOB_FILES_BYTES, decode_files, encode_files, init_export_body, job_sha256
from runyard.market.server import ServerThread

from .helpers import (
    assert_audit_ok,
    fingerprint,
    listing,
    new_party,
    open_market,
    operator_client,
    requirement,
)

SPEC = "name: again\nmodel:\n  init: {from: export, path: /home/lab/runs/served/export}\n"
EXPORT = {"model.safetensors": b"\x00weights" * 50, "config.json": b'{"family": "decoder"}',
          "tokenizer/tokenizer.json": b'{"model": {}}'}
INIT = {"export_files": encode_files(EXPORT), "export_urls": {"big.bin": "https://data.example.org/big.bin"}}
JOB = {"spec": SPEC, "results_to": "/srv/results/lab-1", "init_export": INIT}


@pytest.fixture
def world(store_url):
    market = open_market(store_url)
    with ServerThread(market) as server:
        ops = operator_client(market, server.url)
        provider = new_party(server.url, "p-one", "provider", ops).client
        tenant = new_party(server.url, "t-one", "tenant", ops).client
        ops.credit("t-one", 50_000, "opening balance")
        provider.create_listing(**listing(price_per_device_hour=300))
        yield {"market": market, "provider": provider, "tenant": tenant}
    assert_audit_ok(market)
    market.store.dispose()


def test_the_init_export_reaches_the_provider_exactly_and_is_signed(world):
    provider, tenant = world["provider"], world["tenant"]
    demand = tenant.place_demand(requirement(), 300, job=JOB)
    assert demand["job"] == JOB
    lease = provider.lease(demand["lease_id"])
    assert lease["job"] == JOB
    assert decode_files(lease["job"]["init_export"]["export_files"]) == EXPORT
    assert lease["job_sha256"] == lease["terms"]["job_sha256"] == job_sha256(JOB)
    # The digest covers the weights: other weights, or none, are another job.
    other = {**JOB, "init_export": {"export_files": encode_files({**EXPORT, "model.safetensors": b"other"})}}
    plain = {k: v for k, v in JOB.items() if k != "init_export"}
    assert len({job_sha256(JOB), job_sha256(other), job_sha256(plain)}) == 3
    # An empty part digests as absent: the tenant's own digest matches the one the market shows.
    assert job_sha256({**JOB, "init_export": {**INIT, "export_urls": {}}}) == job_sha256(
        {**JOB, "init_export": {"export_files": INIT["export_files"]}})
    assert provider.accept_lease(lease["id"])["state"] == "accepted"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


BAD_INIT_EXPORTS = {
    "no files": ({}, "the export has no files"),
    "parent path": ({"export_files": {"../x": _b64(b"x")}}, "relative path"),
    "too large": ({"export_files": {"a.bin": _b64(b"\0" * (MAX_JOB_FILES_BYTES + 1))}}, "more than"),
    "file and url": ({"export_files": {"a": _b64(b"x")}, "export_urls": {"a": "https://a.example/a"}},
                     "both as a file and as a URL"),
    "file inside a file": ({"export_files": {"a": _b64(b"x"), "a/b": _b64(b"y")}}, "cannot be inside"),
    "ftp url": ({"export_urls": {"a": "ftp://a.example/a"}}, "http:// or https://"),
    "same url twice": ({"export_urls": {"a": "https://a.example/x", "b": "https://a.example/x"}}, "twice"),
    "unknown field": ({"export_files": {"a": _b64(b"x")}, "weights": {}}, "weights"),
}


def test_bad_init_exports_are_refused_and_change_nothing(world):
    tenant = world["tenant"]
    balances, before = tenant.balances(), fingerprint(world["market"])
    for case, (init, words) in BAD_INIT_EXPORTS.items():
        with pytest.raises(MarketClientError) as err:
            tenant.place_demand(requirement(), 300, job={**JOB, "init_export": init})
        assert err.value.status == 422, (case, err.value)
        assert words in err.value.message, (case, err.value.message)
        assert fingerprint(world["market"]) == before, case
    assert tenant.balances() == balances and tenant.demands() == []


def test_the_demand_verb_uploads_the_init_export(world, tmp_path):
    tenant = world["tenant"]
    tenant.save_identity(tmp_path / "tenant.json")
    (tmp_path / "spec.yaml").write_text(SPEC)
    run = tmp_path / "run"
    for rel, data in EXPORT.items():
        (run / "export" / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / "export" / rel).write_bytes(data)
    base = [sys.executable, "-m", "runyard", "market", "demand", "--identity", str(tmp_path / "tenant.json"),
            "--kinds", "h100-80gb", "--devices", "1", "--duration-s", "3600", "--max-price", "300",
            "--job-spec", str(tmp_path / "spec.yaml"), "--results-to", "/srv/results/lab-1"]
    out = subprocess.run([*base, "--init-export", str(run), "--init-export-url", "big.bin=https://data.example.org/big.bin"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert tenant.demand(json.loads(out.stdout)["id"])["job"] == JOB
    assert init_export_body(run / "export") == {"export_files": encode_files(EXPORT)}
    bad = subprocess.run([*base, "--init-export", str(tmp_path / "empty")], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--init-export" in bad.stderr and "no files" in bad.stderr, bad.stderr
    orphan = subprocess.run([*base[:-4], "--init-export", str(run)], capture_output=True, text=True, timeout=60)
    assert orphan.returncode != 0 and "belong to a job" in orphan.stderr, orphan.stderr

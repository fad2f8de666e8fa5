"""The data a demand's job carries -- uploaded files and the URLs a provider fetches -- over real HTTP
on both backends: stored with the demand, shown to the lease's parties exactly, covered by the
digest the provider signs, and refused with a clear 4xx (changing nothing) when a path could
escape its folder, the files are too many or too large, or a URL is not plain http(s)."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys

import pytest

from runyard.market.client import MarketClientError
from runyard.market.jobs import (
    MAX_DATA_URLS,
    MAX_JOB_FILES,
    MAX_JOB_FILES_BYTES,
    decode_files,
    encode_files,
    job_sha256,
)
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

SPEC = "name: tiny\ndata:\n  sources:\n  - path: data/train.txt\n  - path: https://data.example.org/more.txt\n"
FILES = encode_files({"data/train.txt": b"hello world\n" * 100, "tok/tokenizer.json": b'{"model": {}}'})
JOB = {"spec": SPEC, "results_to": "/srv/results/lab-1", "files": FILES,
       "data_urls": ["https://data.example.org/more.txt"]}


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


def test_files_and_urls_reach_the_provider_exactly_and_are_signed(world):
    provider, tenant = world["provider"], world["tenant"]
    demand = tenant.place_demand(requirement(), 300, job=JOB)
    assert demand["job"] == JOB
    lease = provider.lease(demand["lease_id"])
    assert lease["job"] == JOB
    assert decode_files(lease["job"]["files"])["data/train.txt"] == b"hello world\n" * 100
    assert lease["job_sha256"] == lease["terms"]["job_sha256"] == job_sha256(JOB)
    # The digest covers the data: another file content or another URL is another job.
    other_file = {**JOB, "files": encode_files({"data/train.txt": b"other"})}
    other_url = {**JOB, "data_urls": ["https://data.example.org/other.txt"]}
    assert len({job_sha256(JOB), job_sha256(other_file), job_sha256(other_url)}) == 3
    assert provider.accept_lease(lease["id"])["state"] == "accepted"


def test_a_job_without_data_digests_as_before():
    """Leases signed before jobs carried data keep verifying: no files and no URLs digest as absent."""
    plain = {"spec": SPEC, "results_to": "/r"}
    before = "sha256:" + hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()
    assert job_sha256(plain) == job_sha256({**plain, "files": {}, "data_urls": []}) == before


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


BAD_INPUTS = {
    "absolute path": ({"/etc/passwd": _b64(b"x")}, None, "relative path"),
    "parent path": ({"data/../../x": _b64(b"x")}, None, "relative path"),
    "hidden file": ({".bashrc": _b64(b"x")}, None, "relative path"),
    "empty part": ({"data//x": _b64(b"x")}, None, "relative path"),
    "not base64": ({"a.txt": "not base64!"}, None, "not valid base64"),
    "too large": ({"a.bin": _b64(b"\0" * (MAX_JOB_FILES_BYTES + 1))}, None, "more than"),
    "too many": ({f"f{i}.txt": _b64(b"x") for i in range(MAX_JOB_FILES + 1)}, None, "at most"),
    "file and folder": ({"a": _b64(b"x"), "a/b": _b64(b"y")}, None, "cannot be inside"),
    "ftp url": ({}, ["ftp://data.example.org/x"], "http:// or https://"),
    "file url": ({}, ["file:///etc/passwd"], "http:// or https://"),
    "url with credentials": ({}, ["https://user:pw@data.example.org/x"], "no credentials"),
    "url with spaces": ({}, ["https://data.example.org/a b"], "spaces"),
    "same url twice": ({}, ["https://a.example/x", "https://a.example/x"], "twice"),
    "too many urls": ({}, [f"https://a.example/{i}" for i in range(MAX_DATA_URLS + 1)], "at most"),
}


def test_bad_inputs_are_refused_and_change_nothing(world):
    tenant = world["tenant"]
    balances, before = tenant.balances(), fingerprint(world["market"])
    for case, (files, urls, words) in BAD_INPUTS.items():
        job = {"spec": SPEC, "results_to": "/r", "files": files, "data_urls": urls or []}
        with pytest.raises(MarketClientError) as err:
            tenant.place_demand(requirement(), 300, job=job)
        assert err.value.status == 422, (case, err.value)
        assert words in err.value.message, (case, err.value.message)
        assert fingerprint(world["market"]) == before, case
    assert tenant.balances() == balances and tenant.demands() == []


def test_the_demand_verb_uploads_files_and_names_urls(world, tmp_path):
    tenant = world["tenant"]
    tenant.save_identity(tmp_path / "tenant.json")
    (tmp_path / "spec.yaml").write_text(SPEC)
    (tmp_path / "train.txt").write_bytes(b"hello world\n" * 100)
    (tmp_path / "tokenizer.json").write_bytes(b'{"model": {}}')
    base = [sys.executable, "-m", "runyard", "market", "demand", "--identity", str(tmp_path / "tenant.json"),
            "--kinds", "h100-80gb", "--devices", "1", "--duration-s", "3600", "--max-price", "300",
            "--job-spec", str(tmp_path / "spec.yaml"), "--results-to", "/srv/results/lab-1"]
    out = subprocess.run([*base, "--job-file", f"data/train.txt={tmp_path / 'train.txt'}",
                          "--job-file", str(tmp_path / "tokenizer.json"),
                          "--data-url", "https://data.example.org/more.txt"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    job = tenant.demand(json.loads(out.stdout)["id"])["job"]
    assert job == {**JOB, "files": encode_files({"data/train.txt": b"hello world\n" * 100,
                                                 "tokenizer.json": b'{"model": {}}'})}
    bad = subprocess.run([*base, "--job-file", f"../x={tmp_path / 'train.txt'}"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode != 0 and "--job-file/--data-url" in bad.stderr and "relative path" in bad.stderr

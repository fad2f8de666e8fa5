"""What a lease's spec may name: the demand's files (relative paths and globs) and the demand's URLs,
nothing else -- each reach outside is refused with the field that reaches -- and the spec the job
runs points at the lease's own copies."""

from __future__ import annotations

import pytest
import yaml

from runyard.control.lease_job import (
    LeaseFolder,
    LeaseJobRefused,
    copy_drop_folder,
    runnable_spec,
    url_file_name,
    url_files,
    write_files,
)

URL = "https://data.example.org/corpus/train.jsonl.gz?sig=abc"


@pytest.fixture
def folder(tmp_path):
    folder = LeaseFolder(tmp_path / "lease-1").create()
    write_files(folder, {"data/a.txt": b"a", "data/b.txt": b"b", "tok/tokenizer.json": b"{}"})
    return folder


def spec(*sources: str, **data) -> dict:
    return {"name": "t", "data": {"sources": [{"path": s} for s in sources], **data}}


def test_the_demands_files_and_urls_become_the_lease_folders_copies(folder):
    run = runnable_spec(spec("data/a.txt", "data/*.txt", URL, tokenizer={"path": "tok/tokenizer.json"}),
                        folder, [URL])
    # Files keep the tenant's paths (the job runs in files/); a URL becomes its copy, the same on every provider.
    paths = [s["path"] for s in run["data"]["sources"]]
    assert paths == ["data/a.txt", "data/*.txt", "../urls/0-train.jsonl.gz"]
    assert (folder.files / paths[2]).resolve() == (folder.urls / "0-train.jsonl.gz").resolve()
    assert run["data"]["tokenizer"]["path"] == "tok/tokenizer.json"
    assert url_files([URL, "https://x.example/"]) == {URL: "0-train.jsonl.gz", "https://x.example/": "1-x.example"}


HOSTILE = {
    "a provider file": (spec("/etc/passwd"), "reaches outside the demand's files"),
    "the daemon's environment": (spec("/proc/self/environ"), "reaches outside the demand's files"),
    "the interpreter's sources": (spec("{stdlib}/json/*.py"), "reaches outside the demand's files"),
    "a parent folder": (spec("data/../../lease-2/files/x"), "reaches outside the demand's files"),
    "the provider's home": (spec("~/.aws/credentials"), "reaches outside the demand's files"),
    "a URL it does not name": (spec("http://127.0.0.1:5432/"), "a URL the demand does not name"),
    "a local file URL": (spec("file:///etc/passwd"), "a URL the demand does not name"),
    "a bucket": (spec("s3://provider-bucket/*"), "a URL the demand does not name"),
    "a file it does not carry": (spec("data/c.txt"), "matches none of the files"),
    "a tokenizer elsewhere": (spec("data/a.txt", tokenizer={"path": "/srv/models/tokenizer.json"}),
                              "data.tokenizer.path"),
    "a cache outside the lease": (spec("data/a.txt", cache_dir="/var/cache/x"), "data.cache_dir must be unset"),
    "a store to publish to": (spec("data/a.txt", store={"url": "/srv/shards"}), "data.store must be unset"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_spec_reaching_outside_what_the_demand_carries_is_refused(folder, case):
    raw, words = HOSTILE[case]
    with pytest.raises(LeaseJobRefused, match=words.replace(".", r"\.")):
        runnable_spec(raw, folder, [URL])


def test_the_error_names_the_field(folder):
    with pytest.raises(LeaseJobRefused) as err:
        runnable_spec(spec("data/a.txt", "/etc/shadow"), folder, [])
    assert str(err.value).startswith("data.sources[1].path '/etc/shadow'")


def test_a_drop_folder_gives_its_regular_files_but_no_links(tmp_path, folder):
    drop = tmp_path / "drop"
    (drop / "data").mkdir(parents=True)
    (drop / "spec.yaml").write_text(yaml.safe_dump(spec("data/*.txt")))
    (drop / "data" / "x.txt").write_text("mine")
    (tmp_path / "secret.txt").write_text("provider's")
    (drop / "data" / "link.txt").symlink_to(tmp_path / "secret.txt")
    (drop / "results").mkdir()
    (drop / "results" / "old.txt").write_text("an earlier delivery")
    copy_drop_folder(drop, folder, max_bytes=1 << 20)
    assert sorted(p.relative_to(folder.files).as_posix() for p in folder.files.rglob("*") if p.is_file()) == [
        "data/x.txt"]
    with pytest.raises(LeaseJobRefused, match="more than 2 bytes"):
        copy_drop_folder(drop, folder, max_bytes=2)


def test_url_file_names_keep_the_extension_and_nothing_else(folder):
    assert url_file_name(3, "https://h.example/a/b/../c%2F..%2Fd.parquet") == "3-c_2F.._2Fd.parquet"
    assert url_file_name(0, "https://h.example/") == "0-h.example"
    assert "/" not in url_file_name(1, "https://h.example/a/" + "x" * 500)

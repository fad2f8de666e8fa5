"""prepare_data end to end on small real corpora: outputs, cache reuse, report, errors, crash resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import runyard.data.work_units as tasks_module
from runyard.data.dedup import exact_duplicates, near_duplicates
from runyard.data.loader import DocumentIndex, TokenLoader, TokenStream, eval_sample
from runyard.data.partstore import PartReader
from runyard.data.pipeline import PreparedData, prepare_data, train_token_counts
from runyard.data.shards import load_index, verify_index
from runyard.data.split import heldout_mask
from runyard.data.tokenize import encode_documents
from runyard.data.tokenizer import load_tokenizer, train_bpe
from runyard.errors import DataError
from tests.data.data_fixtures import spec_for, write_corpus


def shard_hashes(prepared: PreparedData) -> dict[str, list[str]]:
    return {
        name: [s["sha256"] for s in load_index(idx)["shards"]]
        for name, idx in (("train", prepared.train_index), ("heldout", prepared.heldout_index))
    }


def heldout_ids(prepared: PreparedData) -> list[str]:
    split = json.loads((prepared.dataset_dir / "split.json").read_text())
    lines = (prepared.dataset_dir / split["heldout_ids"]).read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_prepare_produces_a_usable_dataset(corpus: Path, tmp_path: Path):
    spec = spec_for(str(corpus / "*.txt"))
    prepared = prepare_data(spec, seed=0, report_dir=tmp_path / "report", cache_dir=tmp_path / "cache")
    assert prepared.vocab_size == 320 and prepared.eos_id == 0
    assert prepared.tokenizer_path.name == "tokenizer.json" and prepared.tokenizer_path.exists()
    verify_index(prepared.train_index)
    verify_index(prepared.heldout_index)
    split = prepared.stats["split"]
    assert split["train"]["documents"] + split["heldout"]["documents"] == 40
    assert split["heldout"]["documents"] >= 1
    json.dumps(prepared.stats)  # JSON-serialisable
    assert any(k.startswith("sources[0]") for k in prepared.input_fingerprints)
    # The tokens decode back to the documents (end-of-document separated).
    tok = load_tokenizer(prepared.tokenizer_path)
    first = TokenLoader(prepared.train_index, 16, 2, seed=0, shuffle=False).next_batch()[0][0].tolist()
    assert tok.decode(first).startswith("# document")
    assert eval_sample(prepared.heldout_index, 16, 2, 4, seed=0).batches[0][0].shape == (2, 16)
    for name in ("report.md", "report.json", "doc_lengths.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    assert "## Deduplication" in (tmp_path / "report" / "report.md").read_text()


def test_second_prepare_reuses_the_cache(corpus: Path, tmp_path: Path):
    spec = spec_for(str(corpus / "*.txt"))
    a = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "cache", progress=False)
    marker = (a.dataset_dir / "prepared.json").stat().st_mtime_ns
    b = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "cache", progress=False)
    assert b.fingerprint == a.fingerprint and b.train_index == a.train_index
    assert (b.dataset_dir / "prepared.json").stat().st_mtime_ns == marker  # not rebuilt
    # A change of input or seed is a different dataset.
    (corpus / "doc_0000.txt").write_text("changed text " * 50)
    c = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "cache", progress=False)
    d = prepare_data(spec, seed=1, report_dir=None, cache_dir=tmp_path / "cache", progress=False)
    assert len({a.fingerprint, c.fingerprint, d.fingerprint}) == 3


def test_cache_dir_from_environment(corpus: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("RUNYARD_CACHE_DIR", str(tmp_path / "envcache"))
    prepared = prepare_data(spec_for(str(corpus / "*.txt")), seed=0, report_dir=None, progress=False)
    assert prepared.dataset_dir.is_relative_to(tmp_path / "envcache")


def test_empty_input_is_a_clear_error(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data.sources\[0\].path .* matched no files"):
        prepare_data(
            spec_for(str(tmp_path / "empty" / "*.txt")),
            seed=0,
            report_dir=None,
            cache_dir=tmp_path / "c",
            progress=False,
        )
    for i in range(3):
        (tmp_path / "empty" / f"{i}.txt").write_text("")
    with pytest.raises(DataError, match="only 0 document"):
        prepare_data(
            spec_for(str(tmp_path / "empty" / "*.txt")),
            seed=0,
            report_dir=None,
            cache_dir=tmp_path / "c",
            progress=False,
        )


def test_missing_tokenizer_path_is_a_clear_error(corpus: Path, tmp_path: Path):
    spec = spec_for(str(corpus / "*.txt"), tokenizer={"path": str(tmp_path / "absent.json")})
    with pytest.raises(DataError, match=r"data.tokenizer.path .*absent.json.*cannot read"):
        prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "c", progress=False)


_KILLER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import runyard.data.tokenize as t
    sys.path.insert(0, sys.argv[3])
    from data_fixtures import spec_for
    calls = 0
    real = t.encode_documents
    def dying(*a, **k):
        global calls
        calls += 1
        if calls == int(sys.argv[4]):
            os.kill(os.getpid(), signal.SIGKILL)  # a hard kill: no cleanup handlers run
        return real(*a, **k)
    t.encode_documents = dying
    from runyard.data.pipeline import prepare_data
    spec = spec_for(sys.argv[1], chunk_bytes=3000)
    prepare_data(spec, seed=0, report_dir=None, cache_dir=Path(sys.argv[2]), progress=False)
""")


def test_killed_prepare_resumes_to_identical_shards(tmp_path: Path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus", n_docs=60)
    pattern = str(corpus / "*.txt")
    whole = prepare_data(
        spec_for(pattern), seed=0, report_dir=None, cache_dir=tmp_path / "c1", progress=False
    )

    script = tmp_path / "killer.py"
    script.write_text(_KILLER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, str(script), pattern, str(tmp_path / "c2"), str(Path(__file__).parent), "5"],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    dataset = next((tmp_path / "c2" / "datasets").iterdir())
    assert not (dataset / "prepared.json").exists()
    done_chunks = sorted((dataset / "work").glob("*.npz"))
    assert len(done_chunks) >= 3  # chunks finished before the kill were kept (two run at a time)
    import runyard.data.tokenize as tokenize_module

    calls = []
    real = tokenize_module.encode_documents

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenize_module, "encode_documents", counting)
    resumed = prepare_data(
        spec_for(pattern, chunk_bytes=3000),
        seed=0,
        report_dir=None,
        cache_dir=tmp_path / "c2",
        progress=False,
    )
    assert resumed.fingerprint == whole.fingerprint
    assert shard_hashes(resumed) == shard_hashes(whole)
    assert resumed.tokenizer_path.read_bytes() == whole.tokenizer_path.read_bytes()
    assert not (dataset / "work").exists()
    # Resumed work encoded only the chunks that were not finished before the kill.
    whole_calls = []
    monkeypatch.setattr(
        tokenize_module, "encode_documents", lambda *a, **k: whole_calls.append(1) or real(*a, **k)
    )
    prepare_data(
        spec_for(pattern, chunk_bytes=3000),
        seed=0,
        report_dir=None,
        cache_dir=tmp_path / "c3",
        progress=False,
    )
    assert len(calls) == len(whole_calls) - len(done_chunks)


def test_split_is_by_document_and_seeded(corpus: Path, tmp_path: Path):
    spec = spec_for(str(corpus / "*.txt"), heldout_fraction=0.3)
    a = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "c", progress=False)
    b = prepare_data(spec, seed=7, report_dir=None, cache_dir=tmp_path / "c", progress=False)
    held_a, held_b = heldout_ids(a), heldout_ids(b)
    assert held_a and held_b and held_a != held_b
    assert a.stats["split"]["heldout"]["documents"] == len(held_a)
    assert json.loads((a.dataset_dir / "split.json").read_text())["heldout_documents"] == len(held_a)
    # A held-out document's text is in the held-out stream and never in the train stream.
    tok = load_tokenizer(a.tokenizer_path)
    train = TokenStream(a.train_index)
    held = TokenStream(a.heldout_index)
    train_text = tok.decode(train.read(0, train.total).tolist(), skip_special_tokens=False)
    held_text = tok.decode(held.read(0, held.total).tolist(), skip_special_tokens=False)
    first_line = Path(held_a[0]).read_text().split("\n")[0] + "\n"
    assert first_line in held_text and first_line not in train_text


@pytest.mark.slow
def test_process_count_does_not_change_the_dataset(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=24)
    one = prepare_data(
        spec_for(str(corpus / "*.txt")), seed=0, report_dir=None, cache_dir=tmp_path / "a", progress=False
    )
    two = prepare_data(
        spec_for(str(corpus / "*.txt"), workers=2),
        seed=0,
        report_dir=None,
        cache_dir=tmp_path / "b",
        progress=False,
    )
    assert two.fingerprint == one.fingerprint  # the process count is not part of the fingerprint
    assert shard_hashes(two) == shard_hashes(one)
    assert two.stats["steps"] == one.stats["steps"]


def test_clean_step_is_reused_when_only_later_settings_change(corpus: Path, tmp_path: Path, monkeypatch):
    calls = []
    real = tasks_module.clean_part
    monkeypatch.setattr(tasks_module, "clean_part", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = tmp_path / "c"
    a = prepare_data(
        spec_for(str(corpus / "*.txt")), seed=0, report_dir=None, cache_dir=cache, progress=False
    )
    first = len(calls)
    assert first >= 1 and list((cache / "steps" / "clean").glob("*/meta.json"))
    b = prepare_data(
        spec_for(str(corpus / "*.txt"), tokenizer={"vocab_size": 400}, heldout_fraction=0.3),
        seed=0,
        report_dir=None,
        cache_dir=cache,
        progress=False,
    )
    assert len(calls) == first  # cleaning reused; tokenizer and split redone
    assert b.fingerprint != a.fingerprint and b.vocab_size == 400
    assert b.stats["steps"] == a.stats["steps"] and b.stats["removed"] == a.stats["removed"]
    prepare_data(
        spec_for(str(corpus / "*.txt"), filters={"min_words": 5}),
        seed=0,
        report_dir=None,
        cache_dir=cache,
        progress=False,
    )
    assert len(calls) == 2 * first  # a cleaning setting changed: cleaned again


def test_the_dataset_is_the_in_memory_pipelines(tmp_path: Path):
    """Every step computed again in memory from the cleaned parts (the way pipeline version 1 held the
    corpus): the same documents kept, the same split, the same tokenizer, the same tokens, documents
    and counts."""
    corpus = write_corpus(tmp_path / "corpus", n_docs=50)
    for i in range(6):  # exact and near copies, so both dedup steps remove something
        text = (corpus / f"doc_{i:04d}.txt").read_text()
        (corpus / f"copy_{i}.txt").write_text(text if i % 2 else text.replace("alpha", "omega", 1))
    spec = spec_for(str(corpus / "*.txt"), shard_tokens=1024, dedup={"threshold": 0.7})
    prepared = prepare_data(spec, seed=3, report_dir=None, cache_dir=tmp_path / "c", progress=False)

    parts = [PartReader(d) for d in sorted((tmp_path / "c" / "steps" / "clean").iterdir(), key=part_order)]
    texts = [t for p in parts for t in p.texts(0, p.n_docs)]
    ids = [i for p in parts for i in p.ids()]
    hashes = [bytes(h) for p in parts for h in p.exact()]
    sigs = np.concatenate([p.signatures() for p in parts])
    keep = ~exact_duplicates(hashes)
    kept_idx = np.flatnonzero(keep)
    near = near_duplicates(sigs[kept_idx], 0.7, texts=[texts[i] for i in kept_idx], ngram=spec.dedup.ngram)
    keep[kept_idx[near.duplicate]] = False
    assert prepared.stats["dedup"]["exact_removed"] >= 1 and prepared.stats["dedup"]["near_removed"] >= 1
    kept = [i for i in range(len(texts)) if keep[i]]
    held = heldout_mask([hashes[i] for i in kept], 3, spec.heldout_fraction)
    assert heldout_ids(prepared) == [ids[i] for i, h in zip(kept, held, strict=True) if h]
    train = [texts[i] for i, h in zip(kept, held, strict=True) if not h]
    reference_tok = train_bpe(train, 320, 2, spec.tokenizer.train_max_bytes)
    assert json.loads(prepared.tokenizer_path.read_text()) == json.loads(reference_tok.to_str())

    tok = load_tokenizer(prepared.tokenizer_path)
    tokens, lengths = encode_documents(tok, train, prepared.eos_id, np.dtype(np.uint16))
    stream = TokenStream(prepared.train_index)
    np.testing.assert_array_equal(stream.read(0, stream.total), tokens)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    np.testing.assert_array_equal(DocumentIndex(stream).starts(), starts)
    np.testing.assert_array_equal(train_token_counts(prepared), np.bincount(tokens, minlength=prepared.vocab_size))
    assert prepared.stats["split"]["train"]["documents"] == len(train)


def part_order(path: Path) -> str:
    """The order of a dataset's parts: by the first file each read (parts hold consecutive files)."""
    return json.loads((path / "meta.json").read_text())["files"][0]["path"]


def test_the_held_out_documents_are_listed_beside_the_report(tmp_path: Path):
    """data/held_out.txt names each held-out document with its bytes and tokens, in the split's order,
    the figures those of the documents themselves (tokens without the end-of-document token)."""
    corpus = write_corpus(tmp_path / "corpus", n_docs=60)
    spec = spec_for(str(corpus / "*.txt"), shard_tokens=1024, heldout_fraction=0.3)
    prepared = prepare_data(spec, seed=5, report_dir=tmp_path / "report", cache_dir=tmp_path / "c", progress=False)
    listed = (tmp_path / "report" / "held_out.txt").read_text().splitlines()
    assert listed[0].startswith("# the held-out documents") and listed[1] == "# bytes\ttokens\tsource"
    rows = [line.split("\t") for line in listed[2:]]
    assert [source for _, _, source in rows] == heldout_ids(prepared)
    assert len(rows) == prepared.stats["split"]["heldout"]["documents"] >= 5
    tok = load_tokenizer(prepared.tokenizer_path)
    for nbytes, tokens, source in rows:
        text = Path(source).read_text()
        assert int(nbytes) == len(text.encode())
        assert int(tokens) == len(tok.encode(text).ids)
    assert sum(int(b) for b, _, _ in rows) == prepared.stats["split"]["heldout"]["bytes"]
    assert sum(int(t) + 1 for _, t, _ in rows) == prepared.stats["split"]["heldout"]["tokens"]
    # The cache holds it too (a hydrated or reused dataset lists the same documents).
    assert (prepared.dataset_dir / "held_out.txt").read_text() == "\n".join(listed) + "\n"

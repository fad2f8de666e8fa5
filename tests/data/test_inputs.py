"""Inputs read once and hashed as they are read; a source that changes or disappears mid-prepare is
named and never mixed into the cache; a warm cache is found without reading the sources."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

import runyard.data.sources as sources_module
import runyard.data.work_units as tasks_module
from runyard.data.budget import MemoryBudget
from runyard.data.clean import clean_part
from runyard.data.errors import DocumentTooLarge, InputChanged, MemoryBudgetTooSmall
from runyard.data.pipeline import fingerprint_inputs, prepare_data
from runyard.data.sources import iter_file_documents, list_input_files
from runyard.spec.data import SourceSpec
from tests.data.data_fixtures import age_file, spec_for, write_corpus


def _budget() -> MemoryBudget:
    return MemoryBudget.for_local(1 << 30, 1)


def test_a_file_changed_after_listing_is_refused_and_nothing_is_kept(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=3)
    spec = spec_for(str(corpus / "*.txt"))
    files = list_input_files(spec.sources)
    (corpus / "doc_0001.txt").write_text("new contents, longer than before " * 40)
    out = tmp_path / "part"
    with pytest.raises(InputChanged, match=r"doc_0001.txt \(data.sources\[0\]\) changed while the data stage read it"):
        clean_part(files, spec, out, _budget())
    assert not out.exists() and list(tmp_path.glob(".part.tmp-*")) == []


def test_a_file_gone_after_listing_is_named(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=3)
    spec = spec_for(str(corpus / "*.txt"))
    files = list_input_files(spec.sources)
    (corpus / "doc_0002.txt").unlink()
    with pytest.raises(InputChanged, match=r"doc_0002.txt \(data.sources\[0\]\) disappeared after it was listed"):
        clean_part(files, spec, tmp_path / "part", _budget())
    assert not (tmp_path / "part").exists()


def test_a_file_changed_after_its_part_was_read_fails_the_prepare_and_mixes_nothing(tmp_path: Path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus", n_docs=8)
    spec = spec_for(str(corpus / "*.txt"))
    real = tasks_module.clean_part

    def clean_then_edit(*args, **kwargs):  # the part is read whole, then one of its files changes
        result = real(*args, **kwargs)
        (corpus / "doc_0003.txt").write_text("edited while the data stage ran " * 30)
        return result

    monkeypatch.setattr(tasks_module, "clean_part", clean_then_edit)
    with pytest.raises(InputChanged, match="doc_0003.txt .*changed or disappeared while the data stage ran"):
        prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "c", progress=False)
    assert not (tmp_path / "c" / "datasets").exists()  # no dataset from the old or a mixed content
    monkeypatch.setattr(tasks_module, "clean_part", real)
    age_file(corpus / "doc_0003.txt")
    again = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "c", progress=False)
    fresh = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "fresh", progress=False)
    assert again.fingerprint == fresh.fingerprint  # the new content, as a cold cache sees it
    assert again.input_fingerprints == fresh.input_fingerprints


def test_each_source_byte_is_read_once_cold_and_never_warm(tmp_path: Path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus", n_docs=12)
    spec = spec_for(str(corpus / "*.txt"))
    opened: Counter = Counter()
    real_open = sources_module._open_raw

    def counting_open(path):
        opened[path] += 1
        return real_open(path)

    monkeypatch.setattr(sources_module, "_open_raw", counting_open)
    cold = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "c", progress=False)
    assert sorted(opened) == sorted(str(p) for p in corpus.iterdir()) and set(opened.values()) == {1}
    opened.clear()
    warm = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "c", progress=False)
    assert warm.fingerprint == cold.fingerprint and not opened
    # The fingerprint is the one the sources' bytes give, hashed apart from any cleaning.
    assert cold.input_fingerprints["sources[0] " + spec.sources[0].path] == next(
        iter(fingerprint_inputs(spec, list_input_files(spec.sources)).values())
    )


def test_a_file_modified_just_before_it_was_read_is_read_again_next_time(tmp_path: Path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus", n_docs=6)
    spec = spec_for(str(corpus / "*.txt"))
    (corpus / "doc_0004.txt").write_text("written a moment ago " * 20)  # racy: its identity cannot vouch
    cleaned = []
    real = tasks_module.clean_part
    monkeypatch.setattr(tasks_module, "clean_part", lambda *a, **k: cleaned.append(1) or real(*a, **k))
    first = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "c", progress=False)
    again = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "c", progress=False)
    assert len(cleaned) == 2 and again.fingerprint == first.fingerprint
    age_file(corpus / "doc_0004.txt")  # an mtime change is a new identity: cleaned once more, then settled
    prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "c", progress=False)
    prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "c", progress=False)
    assert len(cleaned) == 3


def test_a_document_larger_than_a_workers_share_is_a_clear_error(tmp_path: Path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "small.txt").write_text("small document\n")
    big = tmp_path / "corpus" / "huge.txt"
    spec = spec_for(str(tmp_path / "corpus" / "*.txt"), memory_limit="512MiB")
    limit = MemoryBudget.for_local(int(spec.memory_limit), 1).max_document_bytes
    with open(big, "wb") as f:
        f.truncate(limit + 1)  # sparse: no disk needed
    with pytest.raises(DocumentTooLarge, match=r"huge.txt: the file .* larger than .* data.memory_limit"):
        prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "c", progress=False)
    lines = tmp_path / "lines.jsonl"
    lines.write_bytes(b'{"text": "fine"}\n' + b'{"text": "' + b"x" * (limit + 10) + b'"}\n')
    source = SourceSpec(path=str(lines), format="jsonl")
    docs = iter_file_documents(source, list_input_files([source])[0], Counter(),
                               sources_module.ReadLimits(max_document_bytes=limit))
    assert next(docs)[1] == "fine"
    with pytest.raises(DocumentTooLarge, match="lines.jsonl: line 2 is larger than"):
        next(docs)


def test_a_memory_limit_too_small_for_the_workers_is_refused_before_work(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=3)
    spec = spec_for(str(corpus / "*.txt"), memory_limit="512MiB", workers=4)
    with pytest.raises(MemoryBudgetTooSmall, match=r"data.memory_limit \(512 MiB\) is too small for 4 worker"):
        prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "c", progress=False)
    assert not (tmp_path / "c").exists()


def test_memory_limit_is_not_in_the_fingerprint(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=6)
    a = prepare_data(spec_for(str(corpus / "*.txt")), seed=0, report_dir=None, cache_dir=tmp_path / "c",
                     progress=False)
    b = prepare_data(spec_for(str(corpus / "*.txt"), memory_limit="600MB"), seed=0, report_dir=None,
                     cache_dir=tmp_path / "c", progress=False)
    assert a.fingerprint == b.fingerprint and os.path.samefile(a.dataset_dir, b.dataset_dir)

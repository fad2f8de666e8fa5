"""Which tokens end a generation with an export: what generation_config.json and tokenizer_config.json
say, as transformers reads them (Llama 3 lists two), not a guess from common token names."""

from __future__ import annotations

import json

from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from runyard.model.hf.export import export_eos_ids

VOCAB = {"<unk>": 0, "hello": 1, "<|end_of_text|>": 2, "<|eot_id|>": 3, "<|endoftext|>": 4}


def _tokenizer() -> Tokenizer:
    return Tokenizer(WordLevel(VOCAB, unk_token="<unk>"))


def test_every_listed_end_token_ends_a_generation(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    # <|endoftext|> is in the vocabulary but neither file names it: it does not end anything
    assert export_eos_ids(tmp_path, _tokenizer()) == {2, 3}


def test_a_single_id_and_the_tokenizers_own_token_are_both_read(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|eot_id|>"}}))
    assert export_eos_ids(tmp_path, _tokenizer()) == {2, 3}


def test_ids_outside_the_vocabulary_and_unreadable_files_are_ignored(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 99, True, "3"]}))
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert export_eos_ids(tmp_path, _tokenizer()) == {2}
    assert export_eos_ids(tmp_path / "missing", _tokenizer()) == set()


def test_config_json_names_end_tokens_too(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 4}))  # what vLLM's engine read alone
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert export_eos_ids(tmp_path, _tokenizer()) == {2, 4}

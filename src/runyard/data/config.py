"""The `data:` section of a job spec. Owned by the data stage; spec.py embeds it.

Every cleaning step is an optional section with defaults chosen so that a corpus of source code (the
stdlib demo) passes almost untouched: prose-oriented quality filters are off until a spec sets them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceSpec(_Strict):
    """One input. `path` is a local path, a glob, or an fsspec URL. `{stdlib}` in it expands to the
    running interpreter's standard library directory."""

    path: str
    format: Literal["text", "jsonl", "parquet"] = "text"
    text_field: str = Field(default="text", description="JSONL field / Parquet column holding the text")
    exclude: list[str] = Field(default_factory=list, description="glob patterns of paths to leave out")
    encoding_errors: Literal["replace", "skip"] = "replace"
    compression: Literal["infer", "none", "gzip", "zstd"] = Field(
        default="infer", description="infer from the file name (.gz, .zst) unless set"
    )


class TokenizerSpec(_Strict):
    """Train a byte-level BPE tokenizer on the training split, or load one (`path`)."""

    path: str | None = None
    vocab_size: int = Field(default=4096, ge=260, le=1_000_000)
    min_frequency: int = Field(default=2, ge=1)
    train_max_bytes: int = Field(default=50_000_000, gt=0, description="cap on text fed to BPE training")


class NormalizeSpec(_Strict):
    """Text normalisation applied to every document before filtering."""

    nfc: bool = Field(default=True, description="Unicode NFC composition")
    line_endings: bool = Field(default=True, description="CRLF and CR become LF")
    control_chars: bool = Field(default=True, description="drop C0/C1 controls other than tab and newline")
    trailing_whitespace: bool = Field(default=True, description="strip spaces and tabs at line ends")


class FilterSpec(_Strict):
    """Quality filters. Each is off when its bound is null. The defaults only drop empty documents and
    degenerate ones (nearly all lines the same), so source code passes; prose corpora should set the
    Gopher-style bounds (e.g. min_words 50, max_symbol_word_ratio 0.1, max_non_alpha_word_fraction 0.2)."""

    enabled: bool = True
    min_chars: int | None = Field(default=1, ge=0)
    max_chars: int | None = Field(default=None, ge=1)
    min_words: int | None = Field(default=None, ge=0)
    max_words: int | None = Field(default=None, ge=1)
    min_mean_word_length: float | None = Field(default=None, ge=0)
    max_mean_word_length: float | None = Field(default=None, gt=0)
    max_symbol_word_ratio: float | None = Field(default=None, ge=0, description="('#' + '...') per word")
    max_non_alpha_word_fraction: float | None = Field(
        default=None, ge=0, le=1, description="fraction of words with no alphabetic character"
    )
    max_duplicate_line_fraction: float | None = Field(
        default=0.9, ge=0, le=1, description="fraction of non-blank lines that repeat an earlier line"
    )
    max_duplicate_paragraph_fraction: float | None = Field(default=None, ge=0, le=1)
    top_ngram_n: int = Field(default=2, ge=1, le=10)
    max_top_ngram_fraction: float | None = Field(
        default=None, ge=0, le=1, description="characters covered by the most frequent word n-gram"
    )
    max_ellipsis_line_fraction: float | None = Field(default=None, ge=0, le=1)
    max_bullet_line_fraction: float | None = Field(default=None, ge=0, le=1)
    samples_per_reason: int = Field(
        default=3, ge=0, le=100, description="removed documents kept in the report"
    )


class PiiSpec(_Strict):
    """PII scrubbing, off by default: matches are replaced by placeholders and counted."""

    enabled: bool = False
    emails: bool = True
    phones: bool = True
    ip_addresses: bool = True
    credit_cards: bool = True


class DedupSpec(_Strict):
    """Exact (hash of normalised text) and near-duplicate (MinHash + LSH) removal."""

    exact: bool = True
    near: bool = True
    threshold: float = Field(default=0.8, gt=0, lt=1, description="Jaccard similarity of word n-gram sets")
    num_perm: int = Field(default=128, ge=16, le=1024)
    ngram: int = Field(default=5, ge=1, le=20, description="words per shingle")
    bands: int | None = Field(default=None, ge=1, description="LSH bands; default tuned to the threshold")
    seed: int = Field(default=1, ge=0, description="seed of the MinHash permutations")
    report_clusters: int = Field(default=10, ge=0)

    @model_validator(mode="after")
    def _bands_divide(self) -> DedupSpec:
        if self.bands is not None and self.num_perm % self.bands:
            raise ValueError(f"bands ({self.bands}) must divide num_perm ({self.num_perm})")
        return self


class StoreSpec(_Strict):
    """Where prepared shards are kept (the cold store): a path or any fsspec URL, labelled with a region."""

    url: str
    region: str | None = None


class DataSpec(_Strict):
    sources: list[SourceSpec] = Field(min_length=1)
    heldout_fraction: float = Field(default=0.05, gt=0.0, lt=0.5)
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    shard_tokens: int = Field(default=1 << 20, ge=1024, description="tokens per shard file")
    cache_dir: str | None = Field(default=None, description="token cache; default ~/.cache/runyard/data")
    residency: list[str] | None = Field(default=None, description="regions where the data may sit")
    workers: int | None = Field(default=None, ge=1, description="processes; default the core count")
    chunk_bytes: int = Field(
        default=1 << 22,
        ge=1,
        description="text per tokenization chunk (the unit of resume; not in the fingerprint)",
    )
    normalize: NormalizeSpec = Field(default_factory=NormalizeSpec)
    filters: FilterSpec = Field(default_factory=FilterSpec)
    pii: PiiSpec = Field(default_factory=PiiSpec)
    dedup: DedupSpec = Field(default_factory=DedupSpec)
    store: StoreSpec | None = Field(default=None, description="cold store the shards are published to")
    cache_region: str | None = Field(
        default=None, description="region of the local cache; default env RUNYARD_REGION"
    )

"""The spec checked against its prepared data, before a stage starts: what only the data can reveal.

A problem is reported like any spec error (field path, value, what was expected, and a fix); a value
the run would use differently from what the spec says, or that cannot be honoured in full, is logged as
a warning that names the field. Nothing is changed silently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from runyard.data.loader import TokenStream
from runyard.data.pipeline import PreparedData
from runyard.data.tokenizer import vocab_shortfall
from runyard.errors import SpecError
from runyard.spec.job import JobSpec, reference_hint, resolved_stage

log = logging.getLogger(__name__)

MAX_HELDOUT_FRACTION = 0.49  # data.heldout_fraction must stay below 0.5


@dataclass(frozen=True)
class SplitSize:
    name: str  # "train" or "held-out"
    tokens: int
    documents: int


def _split_sizes(prepared: PreparedData) -> tuple[SplitSize, SplitSize]:
    split = prepared.stats.get("split", {})
    return (
        SplitSize("train", TokenStream(prepared.train_index).total, split.get("train", {}).get("documents", 0)),
        SplitSize("held-out", TokenStream(prepared.heldout_index).total, split.get("heldout", {}).get("documents", 0)),
    )


def _too_short(spec: JobSpec, split: SplitSize, context: int) -> str:
    need = context + 1
    fix = f"lower model.context_length to at most {max(1, split.tokens - 1)}"
    if split.name == "held-out":
        fraction = spec.data.heldout_fraction
        # Held-out tokens grow about in proportion to the fraction; ask for half again to be safe.
        wanted = fraction * need / max(1, split.tokens) * 1.5
        if wanted < MAX_HELDOUT_FRACTION:
            fix = f"raise data.heldout_fraction from {fraction} to about {wanted:.2f}, or {fix}"
        else:
            fix = f"add documents (no held-out fraction below 0.5 would hold a sequence), or {fix}"
    else:
        fix = f"add documents, or {fix}"
    return (
        f"a sequence the {split.name} split can fill: it has {split.tokens:,} tokens in {split.documents:,} "
        f"documents and one sequence needs context_length + 1 = {need:,}. Fix: {fix}"
    )


def check_spec_against_data(spec: JobSpec, prepared: PreparedData) -> list[tuple[str, object, str]]:
    """Raise SpecError for what cannot run on this data; return (and log) the warnings."""
    problems: list[tuple[str, object, str]] = []
    warnings: list[tuple[str, object, str]] = []
    splits = _split_sizes(prepared)
    for stage in spec.stages:
        resolved = resolved_stage(spec, stage.name)
        where = f"stages[{resolved.index}].model" if stage.model else "model"
        vocab = resolved.model.vocab_size
        if vocab is not None and vocab < prepared.vocab_size:
            problems.append((f"{where}.vocab_size", vocab,
                             f"at least the tokenizer's vocabulary, {prepared.vocab_size:,}, or null to take it "
                             f"{reference_hint('model.vocab_size')}"))
        elif vocab is not None and vocab > prepared.vocab_size:
            warnings.append((f"{where}.vocab_size", vocab,
                             f"{vocab - prepared.vocab_size:,} embedding rows beyond the tokenizer's "
                             f"{prepared.vocab_size:,} tokens will never be used; null takes the tokenizer's size"))
        for split in splits:
            if split.tokens < resolved.model.context_length + 1:
                problems.append((f"{where}.context_length", resolved.model.context_length,
                                 _too_short(spec, split, resolved.model.context_length)))
    warnings += _data_warnings(spec, prepared) + _evaluation_warnings(spec, splits[1])
    if problems:
        raise SpecError("(spec checked against its prepared data)", problems)
    for field, value, message in warnings:
        log.warning("spec: %s = %r: %s", field, value, message)
    return warnings


def _data_warnings(spec: JobSpec, prepared: PreparedData) -> list[tuple[str, object, str]]:
    """What the data stage could not do as the spec says: a smaller vocabulary, a held-out split that
    had to take a document the fraction did not give it."""
    out = []
    tokenizer = prepared.stats.get("tokenizer", {})
    asked = tokenizer.get("requested_vocab_size")
    if asked is not None and asked > prepared.vocab_size:
        out.append(("data.tokenizer.vocab_size", asked, vocab_shortfall(asked, prepared.vocab_size)))
    split = prepared.stats.get("split", {})
    held = split.get("heldout", {}).get("documents", 0)
    total = held + split.get("train", {}).get("documents", 0)
    fraction = spec.data.heldout_fraction
    if held == 1 and total and fraction * total < 0.5:
        out.append(("data.heldout_fraction", fraction,
                    f"expects {fraction * total:.2f} held-out documents of {total:,}; the split holds out one "
                    f"so that evaluation has data ({1 / total:.1%} of the documents)"))
    return out


def _evaluation_warnings(spec: JobSpec, heldout: SplitSize) -> list[tuple[str, object, str]]:
    """Held-out batches the spec asks for that the held-out split cannot fill."""
    last = resolved_stage(spec, spec.stages[-1].name)
    width = last.model.context_length + 1
    sequences = heldout.tokens // width
    out = []
    for field, batches in (("eval.final_batches", spec.eval.final_batches), ("eval.batches", spec.eval.batches)):
        wanted = batches * last.train.batch_size
        if sequences < wanted:
            full = sequences // last.train.batch_size
            out.append((field, batches,
                        f"asks for {wanted:,} held-out sequences of {width:,} tokens; the held-out split holds "
                        f"{sequences:,} ({heldout.tokens:,} tokens), {full:,} full batches of "
                        f"{last.train.batch_size}: fewer are scored. Raise data.heldout_fraction to score more"))
    return out

"""The data stage: sources -> normalise -> quality filters -> PII scrub -> exact and near-duplicate
removal -> train/held-out split -> tokenizer -> token shards -> hydration -> loader.

`runyard.data.pipeline.prepare_data` runs it; `runyard.data.loader.TokenLoader` feeds training.
Imports here stay light (no torch) so worker processes start fast.
"""

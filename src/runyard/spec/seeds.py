"""Seeds derived from the spec's `seed`: every source of randomness in a run (a stage's weights, its data
order, a rank's stream, an evaluation sample, a request's second completion) draws from
`derive_seed(spec.seed, *names)`, so the spec alone fixes them and the manifest records them."""

from __future__ import annotations

import hashlib


def derive_seed(base: int, *parts: object) -> int:
    """A stable 63-bit seed for a sub-task (a stage, a rank), independent of Python's hash salt."""
    digest = hashlib.sha256(repr((base, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def evaluation_seeds(spec_seed: int) -> dict[str, int]:
    """The seeds of the evaluation samples, fixed for the run (recorded in the manifest): the held-out
    sample scored during training, and the final held-out and train samples."""
    return {
        "eval.heldout": derive_seed(spec_seed, "eval", "heldout"),
        "eval.final_heldout": derive_seed(spec_seed, "eval", "final", "heldout"),
        "eval.final_train": derive_seed(spec_seed, "eval", "final", "train"),
    }

"""One decoding sequence's steps as a compiled graph, on CPU: the serving engine's `compile` option there.

With one sequence decoding and no prompt in the step, an eager step is ~900 small operator calls around 17
one-row matrix products, and the calls cost more than the products (benchmarks/results/serve_profile.md).
Compiled whole by inductor's C++ backend (fused norms, rotary and SwiGLU, its C++ wrapper instead of a
Python one, GEMM templates chosen by autotuning), one client's time per output token fell from 4.37x
llama.cpp's to 2.27x (benchmarks/serve_throughput.py, results/serve_throughput.json).

A compiled graph needs fixed shapes, so the step attends over a fixed number of key positions (a
`DecodeRows` view: positions past the sequence's own masked) from a few buckets (doubling from
max_len/32, at least 64, up to max_len): a sequence's steps use one graph per bucket it passes through,
each compiled the first time it is needed (seconds: the first requests are slow). Steps with several
sequences or with prompts stay eager. Fused kernels round differently from eager ones, so a near-tie
can pick another greedy token. If compiling fails (no C++ compiler on the
machine), the step runs eager from then on, with one warning.
"""

from __future__ import annotations

import logging

import torch

from runyard.model.kv_cache import DecodeRows, KVPool

log = logging.getLogger(__name__)

# inductor's options for a one-row step on CPU: its C++ wrapper (no Python between kernels) and
# autotuned GEMM templates (a one-row product is a GEMV, which the default template does not favour).
_CPU_OPTIONS = {"cpp_wrapper": True, "max_autotune": True}
_FIRST_BUCKET = 64


def key_buckets(max_len: int) -> list[int]:
    """The key lengths steps are compiled for: doubling from max_len/32 (at least 64), then max_len."""
    bucket, buckets = max(_FIRST_BUCKET, max_len >> 5), []
    while bucket < max_len:
        buckets.append(bucket)
        bucket *= 2
    return [*buckets, max_len]


class DecodeGraph:
    """Logits for one sequence's next position from a compiled graph (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, pool: KVPool):
        self.model = model
        self.buckets = key_buckets(pool.max_len)
        self._views = {keys: DecodeRows(pool, 1, keys) for keys in self.buckets}
        self._compiled = torch.compile(self._logits, dynamic=False, options=_CPU_OPTIONS)
        self.failed: str | None = None
        self.steps = 0  # steps it served (tests and the benchmarks read it)

    def _logits(self, view: DecodeRows, token: torch.Tensor) -> torch.Tensor:
        return self.model(token[None], kv_cache=view, positions=view.positions[None],
                          logits_at=torch.zeros(1, dtype=torch.long, device=token.device))

    def logits(self, token: int, position: int) -> torch.Tensor | None:
        """[1, vocab] for `token` at `position` (its keys and values written to slot 0), or None when
        compiling failed and the caller must run the step eagerly."""
        if self.failed is not None:
            return None
        keys = next((b for b in self.buckets if b > position), None)
        if keys is None:  # past the pool's length: the eager step says so
            return None
        view = self._views[keys]
        view.move_to([position])
        try:
            logits = self._compiled(view, torch.tensor([token], device=view.positions.device))
        except Exception as exc:  # inductor's errors have no common base; any means: eager from now on
            self.failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
            log.warning("compiled decoding is off for this engine (%s); steps run eagerly", self.failed)
            return None
        self.steps += 1
        return logits

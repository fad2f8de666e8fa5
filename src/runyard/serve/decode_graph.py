"""Decode-only steps as compiled graphs, on CPU: the serving engine's `compile` option there.

A step that only decodes (no prompt in it) is, eagerly, ~900 small operator calls around 17 matrix products
of a few rows, and at a few sequences the calls cost more than the products
(benchmarks/results/serve_profile.md). Compiled whole by inductor's C++ backend, the step is a few fused
loops (norms, rotary, SwiGLU) around GEMM kernels, with a C++ wrapper instead of a Python one between them
(benchmarks/serve_throughput.py records one client's time per output token against llama.cpp's).

- Two graphs: one for a lone sequence (one row, the fastest kernels for one token) and one for any number
  of sequences from two up. Each attends over a dynamic number of keys (`DecodeRows`' mask), so neither is
  recompiled as sequences grow, and the second's row count is dynamic too.
- The weights are frozen into each graph (inductor's `freezing`): constants packed once into the layout its
  GEMM templates read, instead of inputs read as they lie. Each packed copy is memory a graph holds beside
  the model's own weights, and it is why the served weights must not change in place (the engine never
  changes them).
- Both graphs are compiled when the engine is built (seconds to a minute: inductor times its GEMM kernels),
  so a server listens once its steps are ready. Steps with prompts stay eager, as do a sequence's first
  position and the pool's last (outside the dynamic sizes' range).
- Fused kernels round differently from eager ones, so a near-tie can pick another greedy token.
- Compiling tries inductor's C++ GEMM templates alone first (autotuning against the library GEMM picked
  the slower one now and then), then with the library GEMM beside them. If both fail (no C++ compiler on
  the machine), that graph's steps run eager from then on, with one warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from runyard.model.kv_cache import DecodeRows, KVPool

log = logging.getLogger(__name__)

# inductor's options for a decode step on CPU, in the order tried: its C++ wrapper (no Python between
# kernels) and its GEMM templates, which read the frozen weights prepacked.
_CPU_OPTION_SETS = (
    {"cpp_wrapper": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"},
    {"cpp_wrapper": True, "max_autotune": True},
)


class _Compiled:
    """One graph: `fn` compiled with each option set in turn until one compiles; None once all failed."""

    def __init__(self, fn: Callable[..., torch.Tensor], name: str):
        self.name = name
        self.tries = [torch.compile(fn, dynamic=False, options=opts) for opts in _CPU_OPTION_SETS]
        self.compiled = False  # whether the current try has compiled its graph
        self.failed: str | None = None  # why this graph is off

    def __call__(self, *args) -> torch.Tensor | None:
        error = ""
        while self.tries and self.failed is None:
            try:
                return self._call(*args)
            except Exception as exc:  # inductor's errors have no common base; any means: the next try
                error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                self.tries.pop(0)
                self.compiled = False
        if self.failed is None:
            self.failed = error
            log.warning("compiled decoding of %s is off for this engine (%s); those steps run eagerly",
                        self.name, self.failed)
        return None

    def _call(self, *args) -> torch.Tensor:
        if self.compiled:
            return self.tries[0](*args)
        # Deferred: importing inductor takes a second, which an engine that never compiles need not pay.
        import torch._inductor.config as inductor_config

        # Dynamo reads `freezing` while it traces, not from torch.compile's options, so it is set around the
        # compiling call (a global setting: a model another thread compiles meanwhile is frozen too).
        with inductor_config.patch(freezing=True):
            logits = self.tries[0](*args)
        self.compiled = True
        return logits


class DecodeGraph:
    """Logits for a decode-only step from a compiled graph (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, pool: KVPool):
        self.model, self.pool = model, pool
        # Separate functions, so Dynamo keeps each graph's cache on its own code object.
        self._one = _Compiled(self._one_row, "one sequence")
        self._many = _Compiled(self._rows, "several sequences") if pool.n_slots > 1 else None
        # Compiled now rather than on the first requests: steps at position 1 of slots that no sequence holds yet.
        with torch.inference_mode():
            self._run([0], [1])
            if self._many is not None:
                self._run([0, 0], [1, 1])
        self.steps = 0  # steps it served (tests and the benchmarks read it)

    @property
    def failed(self) -> str | None:
        """Why compiled decoding is off (for one sequence: the graph every client count meets), or None."""
        return self._one.failed

    def _rows(self, view: DecodeRows, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens[None], kv_cache=view, positions=view.positions[None],
                          logits_at=torch.arange(tokens.shape[0], device=tokens.device))

    def _one_row(self, view: DecodeRows, tokens: torch.Tensor) -> torch.Tensor:
        return self._rows(view, tokens)  # the same step; its own code object holds the one-row graph

    def logits(self, tokens: list[int], positions: list[int],
               before_compute: Callable[[], None] | None = None) -> torch.Tensor | None:
        """[B, vocab] for the step of slots 0..B-1 taking `tokens` at `positions` (their keys and values
        written to those slots), or None when the caller must run the step eagerly (that graph failed to
        compile, or a position is outside its range). `before_compute` is called once the step's inputs
        are made, just before the graph runs."""
        logits = self._run(tokens, positions, before_compute)
        if logits is not None:
            self.steps += 1
        return logits

    def _run(self, tokens: list[int], positions: list[int],
             before_compute: Callable[[], None] | None = None) -> torch.Tensor | None:
        rows, max_len = len(tokens), self.pool.max_len
        graph = self._one if rows == 1 else self._many
        if graph is None or graph.failed is not None or not (min(positions) > 0 and max(positions) < max_len - 1):
            return None
        view = DecodeRows(self.pool, positions)
        token_row = torch.tensor(tokens, device=self.pool.device)
        # Keys 2..max_len-1 (rows 2..n_slots): Dynamo specialises sizes 0 and 1, and a slice of the whole
        # pool's length is another graph. With two slots, the rows are always two.
        torch._dynamo.mark_dynamic(view.bias, 3, min=2, max=max_len - 1)
        if rows > 1 and self.pool.n_slots > 2:
            for t in (view.bias, view.positions, view.decode_slots, token_row):
                torch._dynamo.mark_dynamic(t, 0, min=2, max=self.pool.n_slots)
        if before_compute is not None:
            before_compute()
        return graph(view, token_row)
